"""What one client may ask of the server, and how long it may take to ask: the limits
`omniwalk serve` enforces so that no request stalls, starves or balloons the server.

Where each is enforced:

    max_request_body_bytes   guard.py, while the body is read (Content-Length first): a 413
    max_upload_bytes         guard.py for a multipart body as a whole (+ FORM_OVERHEAD_BYTES),
                             while it streams; transcription.py for the file part itself
    max_audio_seconds        transcription.py: the header's duration and the decoded data (audio.py)
    max_n                    openai_api.py: `n` above it is a 400
    timeout_body_s           guard.py: no body data for this long while the app reads it: a 408
    timeout_header_s         connections.py: a request's headers not complete this long after
                             its first byte (or the connection's opening): the connection is closed
    timeout_keep_alive_s     uvicorn: an idle keep-alive connection is closed
    max_connections          connections.py: a connection past this many open ones gets a 503
                             (Retry-After) and is closed before its request is read
    allowed_origins          guard.py: a state-changing request (POST, ...) whose `Origin` is not
                             listed is a 403 (browsers send Origin: a web page cannot drive the
                             server); same-origin requests to a loopback or allowed host pass
    allowed_hosts            guard.py: when set, a `Host` header naming another host is a 400
                             (DNS rebinding against a server on localhost)
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20

#: JSON bodies: one --max-media-bytes (20 MiB) item as a base64 data: URL is 26.7 MiB
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * MiB
#: the audio file of a transcription upload (OpenAI's limit)
DEFAULT_MAX_UPLOAD_BYTES = 25 * MiB
#: the form fields beside the file (model, prompt, language, ...) and the multipart framing
FORM_OVERHEAD_BYTES = 1 * MiB
#: an hour: a 25 MiB MP3 at 56 kbit/s; decoded at 16 kHz it is 230 MB of samples
DEFAULT_MAX_AUDIO_SECONDS = 3600.0
DEFAULT_MAX_N = 16
DEFAULT_TIMEOUT_HEADER_S = 10.0
DEFAULT_TIMEOUT_BODY_S = 30.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0      # uvicorn's default
DEFAULT_MAX_CONNECTIONS = 2048
#: seconds a client told 429 (queue full) or 503 should wait before retrying: a closed-loop
#: request of a few hundred tokens frees its slot in about that long
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerLimits:
    """The limits of one server (`omniwalk serve` flags of the same names)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    max_n: int = DEFAULT_MAX_N
    timeout_header_s: float = DEFAULT_TIMEOUT_HEADER_S
    timeout_body_s: float = DEFAULT_TIMEOUT_BODY_S
    timeout_keep_alive_s: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: origins ("https://app.example.com", or "*" for any) whose pages may POST to the server
    allowed_origins: tuple[str, ...] = ()
    #: host names the Host header may name ("*.example.com" matches subdomains); empty: any
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("max_request_body_bytes", "max_upload_bytes", "max_n", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_audio_seconds", "timeout_header_s", "timeout_body_s", "timeout_keep_alive_s"):
            if not getattr(self, name) > 0:
                flag = name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"--{flag} must be > 0, got {getattr(self, name)}")
        object.__setattr__(self, "allowed_origins", tuple(_origin(o) for o in self.allowed_origins))
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower() for h in self.allowed_hosts))

    @property
    def max_multipart_body_bytes(self) -> int:
        """A multipart body as a whole: the file and the other fields."""
        return self.max_upload_bytes + FORM_OVERHEAD_BYTES


def _origin(text: str) -> str:
    """An origin as browsers send it: scheme://host[:port], lower case, no trailing slash."""
    origin = text.strip().rstrip("/").lower()
    if origin != "*" and "://" not in origin:
        raise ValueError(f"--allowed-origins {text!r}: an origin is scheme://host[:port] (or *)")
    return origin
