"""A lean HTTP/1.1 client for the load tools: stream one response, timestamp each server-sent event.

The load generator shares the machine's cores with the server it measures (2 cores here). Every
cycle it spends on a chunk preempts one of the server's threads, and a CPU server's OpenMP
partner thread then waits at the next barrier, so the client's CPU per token shows up in the
server's step time. httpx (h11, `aiter_lines`, a json parse per chunk) cost ~0.6 ms of CPU per
streamed token on the 2-core Xeon, about as much as the whole serving side of the server it was
measuring (docs/performance.md, "The load generator"). Here a chunk costs one `data_received`
call: the time is taken, the bytes are de-chunked and split into events, nothing is parsed until
the response has ended.

Only what the load tools send is spoken: plain http (no TLS), one request at a time on a
connection, a connection kept for the next request when the server allows it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class HTTPProtocolError(ConnectionError):
    """The server's response could not be read as HTTP/1.1 (or the connection ended mid-response)."""


@dataclass
class StreamedResponse:
    status: int  # the HTTP status code
    # Each server-sent event's `data` field, with the perf_counter() time at which the bytes that
    # completed the event arrived (before any parsing), in arrival order.
    events: list[tuple[float, bytes]] = field(default_factory=list)
    body: bytes = b""  # the whole body of a response that is not an event stream (errors, JSON)


class _ResponseReader(asyncio.Protocol):
    """One connection's reader: parses a response's head, de-chunks its body and splits events.

    States: head (until the blank line), body (Content-Length, chunked, or until close), done."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False  # the connection is gone (by either side)
        self.expect(None)

    def expect(self, done: asyncio.Future | None) -> None:
        """Start reading the next response: `done` gets it (None: no request is out yet)."""
        self._done = done  # resolved with the StreamedResponse when the response has ended
        self._buf = b""  # undecoded bytes (head, or chunked framing not yet complete)
        self.head_seen = False  # this response's status line and headers have arrived
        self._response: StreamedResponse | None = None
        self._is_events = False  # text/event-stream: split into events as bytes arrive
        self._events_buf = b""  # decoded body bytes of an event stream not yet ending in a blank line
        self._body_parts: list[bytes] = []
        self._chunked = False
        # Bytes of the current chunk still to come; -1: a size line is due, -2: the CRLF closing a
        # chunk's data, -3: trailers after the last chunk, up to a blank line.
        self._chunk_left = -1
        self._length_left: int | None = None  # Content-Length still to come; None: until close
        self.keep_alive = True

    # ---- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()  # arrival, before any work on the bytes
        if self._done is None or self._done.done():
            return  # bytes after a finished response (a misbehaving server): nothing waits for them
        try:
            self._feed(data, now)
        except HTTPProtocolError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is None or self._done.done():
            return
        if self.head_seen and self._length_left is None and not self._chunked:
            self._finish()  # a body delimited by the connection's end
        else:
            self._fail(HTTPProtocolError(f"the server closed the connection mid-response ({exc or 'EOF'})"))

    # ---- parsing --------------------------------------------------------------------------
    def _feed(self, data: bytes, now: float) -> None:
        if not self.head_seen:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > 65536:
                    raise HTTPProtocolError("response head over 64 KiB")
                return
            head, data, self._buf = self._buf[:end], self._buf[end + 4:], b""
            self._parse_head(head)
            if self._done.done():
                return  # an empty body (Content-Length: 0)
        if self._chunked:
            self._feed_chunked(data, now)
        else:
            if self._length_left is not None:
                data = data[: self._length_left]
                self._length_left -= len(data)
            self._body(data, now)
            if self._length_left == 0:
                self._finish()

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HTTPProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.head_seen = True
        self._response = StreamedResponse(status=int(parts[1]))
        self._is_events = headers.get("content-type", "").startswith("text/event-stream")
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not self._chunked and "content-length" in headers:
            if not headers["content-length"].isdigit():
                raise HTTPProtocolError(f"bad Content-Length: {headers['content-length'][:40]!r}")
            self._length_left = int(headers["content-length"])
        connection = headers.get("connection", "").lower()
        self.keep_alive = parts[0] != "HTTP/1.0" and "close" not in connection
        if not self._chunked and self._length_left is None:
            self.keep_alive = False  # the body ends when the connection does
        if self._length_left == 0:
            self._finish()

    def _feed_chunked(self, data: bytes, now: float) -> None:
        buf = self._buf + data if self._buf else data
        pos = 0
        while pos < len(buf):
            if self._chunk_left > 0:  # inside a chunk's data
                piece = buf[pos:pos + self._chunk_left]
                self._chunk_left -= len(piece)
                pos += len(piece)
                self._body(piece, now)
                if self._chunk_left == 0:
                    self._chunk_left = -2  # its closing CRLF is due
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                break  # a size line or CRLF split across reads
            line = buf[pos:end]
            pos = end + 2
            if self._chunk_left == -2:  # the CRLF after a chunk's data
                if line:
                    raise HTTPProtocolError("chunk data longer than its size")
                self._chunk_left = -1
                continue
            if self._chunk_left == -3:  # trailers after the last chunk, up to a blank line
                if not line:
                    self._finish()
                    return
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise HTTPProtocolError(f"bad chunk size line: {line[:40]!r}") from None
            self._chunk_left = size if size else -3
        self._buf = buf[pos:]

    def _body(self, data: bytes, now: float) -> None:
        if not data:
            return
        if not self._is_events:
            self._body_parts.append(data)
            return
        buf = self._events_buf + data
        # Events end at a blank line; servers here send "\n\n" (SSE also allows "\r\n\r\n").
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *complete, self._events_buf = buf.split(b"\n\n")
        events = self._response.events
        for event in complete:
            payload = _event_data(event)
            if payload is not None:
                events.append((now, payload))

    def _finish(self) -> None:
        response = self._response
        if self._events_buf.strip():
            payload = _event_data(self._events_buf)
            if payload is not None:  # a last event without its blank line
                response.events.append((time.perf_counter(), payload))
        response.body = b"".join(self._body_parts)
        self._done.set_result(response)

    def _fail(self, exc: Exception) -> None:
        self.keep_alive = False
        if not self._done.done():
            self._done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


def _event_data(event: bytes) -> bytes | None:
    """The `data` field of one server-sent event (its data lines joined), None for comments only."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class StreamingClient:
    """Requests to one http://host:port, each connection reused by the next request when idle."""

    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"the load tools speak plain http to a host: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or 80
        self.prefix = url.path.rstrip("/")
        self._idle: list[_ResponseReader] = []

    async def request(self, method: str, path: str, payload: dict | None = None,
                      timeout_s: float = 300.0) -> StreamedResponse:
        """Send one request and wait for the whole response (events timed as they arrived)."""
        body = json.dumps(payload).encode() if payload is not None else b""
        head = (f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Accept: text/event-stream, application/json\r\nContent-Length: {len(body)}\r\n")
        if payload is not None:
            head += "Content-Type: application/json\r\n"
        message = head.encode("latin-1") + b"\r\n" + body
        async with asyncio.timeout(timeout_s):
            conn, reused = await self._connection()
            try:
                response = await self._exchange(conn, message)
            except HTTPProtocolError:
                if not reused or conn.head_seen:
                    raise
                # A kept connection the server closed as we reused it (its idle timeout): the
                # request never reached it, so it goes again on a new connection, as httpx does.
                conn, _ = await self._connection(fresh=True)
                response = await self._exchange(conn, message)
        if conn.keep_alive and not conn.closed:
            self._idle.append(conn)
        else:
            conn.transport.close()
        return response

    @staticmethod
    async def _exchange(conn: _ResponseReader, message: bytes) -> StreamedResponse:
        done = asyncio.get_running_loop().create_future()
        conn.expect(done)
        conn.transport.write(message)
        try:
            return await done
        except BaseException:
            conn.transport.close()  # a response half read cannot serve the next request
            raise

    async def get_json(self, path: str, timeout_s: float = 30.0) -> dict:
        response = await self.request("GET", path, timeout_s=timeout_s)
        if response.status != 200:
            raise HTTPProtocolError(f"GET {path}: HTTP {response.status}: {response.body[:200]!r}")
        return json.loads(response.body)

    async def _connection(self, fresh: bool = False) -> tuple[_ResponseReader, bool]:
        """An idle kept connection (True: reused) or a new one."""
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.closed:
                return conn, True
        _, conn = await asyncio.get_running_loop().create_connection(_ResponseReader, self.host, self.port)
        return conn, False

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
