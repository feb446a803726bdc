"""The little HTTP/1.1 that an OpenAI-compatible server needs, on asyncio streams.

No third-party server: one request per connection (`Connection: close`), bodies
by Content-Length, responses either whole (JSON, text) or a Server-Sent-Events
stream that ends when the connection closes. Closing after each response also
means that once a request is read, the only thing the client can still send is
EOF, so `wait_disconnect` sees a client that goes away at once.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024
READ_TIMEOUT_S = 30.0

REASONS = {200: "OK", 100: "Continue", 400: "Bad Request", 401: "Unauthorized",
           404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           411: "Length Required", 413: "Payload Too Large", 429: "Too Many Requests",
           431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable"}


class HttpError(Exception):
    """A request the server cannot parse at the HTTP level (before any JSON)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class HttpRequest:
    method: str
    path: str                      # without the query string
    headers: dict[str, str]        # keys lower-case
    body: bytes


async def read_request(reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> HttpRequest | None:
    """One request, or None if the client closed the connection without sending one."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise HttpError(400, "the request ended inside its headers") from None
    except asyncio.LimitOverrunError:
        raise HttpError(431, f"request headers exceed {MAX_HEADER_BYTES} bytes") from None
    except asyncio.TimeoutError:
        raise HttpError(408, f"no complete request headers within {READ_TIMEOUT_S:.0f} s") from None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, f"malformed request line {lines[0][:100]!r}")
    method, target, _ = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(400, f"malformed header line {line[:100]!r}")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HttpError(411, "chunked request bodies are not supported; send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HttpError(400, f"Content-Length {headers['content-length']!r} is not a number") from None
    if length < 0 or length > MAX_BODY_BYTES:
        raise HttpError(413, f"Content-Length {length} is outside 0..{MAX_BODY_BYTES}")
    if length and headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    try:
        body = await asyncio.wait_for(reader.readexactly(length), READ_TIMEOUT_S) if length else b""
    except asyncio.IncompleteReadError:
        raise HttpError(400, f"the body ended after fewer than Content-Length={length} bytes") from None
    except asyncio.TimeoutError:
        raise HttpError(408, f"the body did not arrive within {READ_TIMEOUT_S:.0f} s") from None
    return HttpRequest(method=method.upper(), path=target.split("?", 1)[0], headers=headers,
                       body=body)


def _head(status: int, content_type: str, length: int | None, extra: dict | None) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}",
             f"Content-Type: {content_type}", "Connection: close"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def response(status: int, body: bytes | str | dict, content_type: str = "application/json",
             headers: dict | None = None) -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    return _head(status, content_type, len(body), headers) + body


def sse_head() -> bytes:
    return _head(200, "text/event-stream", None, {"Cache-Control": "no-cache"})


def sse_event(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def wait_disconnect(reader: asyncio.StreamReader) -> None:
    """Returns when the client closes its side (EOF or reset). The request was read in
    full and the connection is not reused, so any byte read here is ignored."""
    try:
        while await reader.read(4096):
            pass
    except (ConnectionError, OSError):
        pass
