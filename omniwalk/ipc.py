"""Messages between the API process and the engine process: pickle protocol 5 frames over a
Unix socket pair, large buffers out of band.

One frame per message, written with one `sendmsg` (scatter-gather: nothing is joined):

    [u64 size of the rest][u32 n] [u64 length of buffer i] * n  [pickle stream] [buffer 0] ... [buffer n-1]

Buffers are what pickle protocol 5 hands to `buffer_callback`: numpy arrays (Orpheus' PCM
chunks, Whisper's features) and CPU tensors (as numpy views) of at least
`OUT_OF_BAND_MIN_BYTES`; they go from their own memory to the socket, and the reader
rebuilds them as views of the one buffer it received the frame into. A PCM chunk is thus
copied from pinned memory to the kernel and from the kernel to the API process, never into
a pickle stream.

Why this transport (measured on CPU, benchmarks in docs/architecture.md, "The engine loop
and its process"): the standard library only (pyzmq and msgspec are not installed on the
GPU machine); a socket pair costs one system call per message each way, as a ZMQ socket
would; a step's outputs are tens of KB of text ids or ~1 MB of audio, so a shared-memory
ring would save a copy of at most ~1 MB per step (~0.1 ms) while adding its own wake-ups
and flow control. End of file on the socket is how each side learns the other died.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import socket
import struct
import threading
from typing import Any, Callable

import numpy as np
import torch

_SIZE = struct.Struct("<QI")          # bytes after this header, number of out-of-band buffers
_LENGTH = struct.Struct("<Q")
OUT_OF_BAND_MIN_BYTES = 1024          # smaller buffers stay in the pickle stream
SOCKET_BUFFER_BYTES = 4 << 20         # a burst of submissions or a step of audio without blocking
_MAX_IOV = 512                        # pieces per sendmsg call (IOV_MAX is 1024 on Linux)


class ChannelClosed(Exception):
    """The other end of the channel is gone (its process exited or closed it)."""


class Channel:
    """One end of a message channel. `send` may be called from several threads (it locks);
    `recv` from one thread at a time."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            except OSError:   # capped by the kernel: keep its size
                pass

    @staticmethod
    def inherited(fd: int) -> "Channel":
        """The channel over a socket this process inherited as `fd`."""
        return Channel(inherited_socket(fd))

    @staticmethod
    def pair() -> tuple["Channel", socket.socket]:
        """(this process's end, the socket to hand to the other process)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return Channel(ours), theirs

    def send(self, message: Any, persistent_id: Callable[[Any], Any] | None = None) -> None:
        """Raises ChannelClosed when the other end is gone. `persistent_id`: pickle's hook
        (an object it names is sent as that name; omniwalk.tensor_edges moves tensors so)."""
        pieces = encode(message, persistent_id)
        with self._send_lock:
            try:
                _send_all(self.sock, pieces)
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise ChannelClosed(f"the channel is closed ({exc})") from None

    def recv(self, persistent_load: Callable[[Any], Any] | None = None) -> Any:
        """The next message; raises ChannelClosed at end of file. `persistent_load`: pickle's
        hook, the object for each name the sender's `persistent_id` gave."""
        header = self._read(_SIZE.size)
        size, count = _SIZE.unpack(header)
        body = self._read(size)
        view = memoryview(body)
        lengths = [_LENGTH.unpack_from(view, 8 * i)[0] for i in range(count)]
        start = 8 * count
        stream_length = size - start - sum(lengths)
        stream = view[start:start + stream_length]
        buffers, offset = [], start + stream_length
        for length in lengths:
            buffers.append(view[offset:offset + length])
            offset += length
        if persistent_load is None:
            return pickle.loads(stream, buffers=buffers)
        unpickler = pickle.Unpickler(io.BytesIO(stream), buffers=buffers)
        unpickler.persistent_load = persistent_load
        return unpickler.load()

    def _read(self, size: int) -> bytearray:
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            try:
                n = self.sock.recv_into(view[got:])
            except (ConnectionResetError, OSError) as exc:
                raise ChannelClosed(f"the channel is closed ({exc})") from None
            if n == 0:
                raise ChannelClosed("the other end closed the channel")
            got += n
        return data

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def inherited_socket(fd: int) -> socket.socket:
    """A socket this process inherited as `fd`, not passed on to its own children: once this
    process is gone, nothing holds it open, and the peer reads end of file."""
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    return sock


def encode(message: Any, persistent_id: Callable[[Any], Any] | None = None) -> list:
    """The pieces of one frame: header, pickle stream, out-of-band buffers."""
    stream = io.BytesIO()
    buffers: list[memoryview] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND_MIN_BYTES:
            return True   # true: serialize in band
        buffers.append(raw)
        return False

    pickler = pickle.Pickler(stream, protocol=5, buffer_callback=out_of_band)
    pickler.dispatch_table = _DISPATCH
    if persistent_id is not None:
        pickler.persistent_id = persistent_id
    pickler.dump(message)
    body = stream.getbuffer()
    lengths = b"".join(_LENGTH.pack(b.nbytes) for b in buffers)
    size = len(lengths) + body.nbytes + sum(b.nbytes for b in buffers)
    return [_SIZE.pack(size, len(buffers)) + lengths, body, *buffers]


def _send_all(sock: socket.socket, pieces: list) -> None:
    pieces = [memoryview(p).cast("B") for p in pieces if len(p)]
    while pieces:
        sent = sock.sendmsg(pieces[:_MAX_IOV])
        while sent:   # drop what went out; a partly sent piece keeps its rest
            if sent >= pieces[0].nbytes:
                sent -= pieces[0].nbytes
                pieces.pop(0)
            else:
                pieces[0] = pieces[0][sent:]
                sent = 0


# CPU tensors travel as numpy arrays, so their bytes go out of band (torch's own reduction
# copies the storage into the stream); bfloat16, which numpy lacks, as its int16 bits.
def _reduce_tensor(tensor: torch.Tensor):
    if tensor.device.type != "cpu" or tensor.requires_grad or tensor.layout != torch.strided:
        return tensor.__reduce_ex__(5)
    dtype = tensor.dtype
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    try:
        array = tensor.contiguous().numpy()
    except (TypeError, RuntimeError):   # a dtype numpy cannot hold
        return tensor.__reduce_ex__(5)
    return _tensor_from_numpy, (array, dtype)


def _tensor_from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if not array.flags.writeable:   # in-band arrays are rebuilt over bytes
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor.view(dtype) if tensor.dtype != dtype else tensor


_DISPATCH = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}   # a dict: looked up in C
