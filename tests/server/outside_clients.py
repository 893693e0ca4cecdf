"""Clients that run as processes of their own, as other users of a server do: a client in
the test process shares the interpreter lock with the servers the tests run there, and
would time (or cause) its own stalls.

    python outside_clients.py health URL        GET /health each time a line arrives on stdin,
                                                until "stop"; then the latencies, as JSON
    python outside_clients.py post URL PATH MIB length|chunked
                                                POST a JSON body of MIB MiB, with a
                                                Content-Length or chunked; prints the status
                                                line and the MiB sent, then the body
"""

from __future__ import annotations

import json
import socket
import sys
import time
from urllib.parse import urlsplit


def health(url: str) -> None:
    import httpx

    latencies = []
    with httpx.Client(timeout=5) as client:
        client.get(url + "/health")   # connected: the latencies are those of a client already there
        print("ready", flush=True)
        while not sys.stdin.readline().startswith("stop"):
            start = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.perf_counter() - start)
    print(json.dumps(latencies))


def post(url: str, path: str, mib: int, framing: str) -> None:
    address = urlsplit(url)
    body = b'{"prompt": "' + b"a" * (mib * 2**20) + b'"}'
    head = f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\ncontent-type: application/json\r\n"
    head += "transfer-encoding: chunked\r\n\r\n" if framing == "chunked" else f"content-length: {len(body)}\r\n\r\n"
    sock = socket.create_connection((address.hostname, address.port))
    sock.sendall(head.encode())
    sent = 0
    try:
        for start in range(0, len(body), 2**20):
            piece = body[start:start + 2**20]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece)
            sent += 1
        if framing == "chunked":
            sock.sendall(b"0\r\n\r\n")
    except OSError:   # the server closed the connection: the answer is already here
        pass
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except OSError:
        pass
    head, _, content = answer.partition(b"\r\n\r\n")
    print(head.split(b"\r\n")[0].decode(), sent)
    print(content.decode())


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "health":
        health(*args)
    else:
        post(args[0], args[1], int(args[2]), args[3])
