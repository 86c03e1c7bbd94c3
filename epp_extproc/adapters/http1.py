"""A small HTTP/1.1 client for one origin (the renderer): asyncio protocols and the llhttp parser.

The renderer is called once for every routed request, so its client sits in the request path. aiohttp's
client spends ~190 µs of CPU per call on this machine (request and response objects, multidict headers, a
stream reader, a timer context); this one writes to kept-alive connections directly and lets httptools (the
C llhttp parser that uvicorn uses) parse the answer, ~55 µs for the same call (`bench/README.md`). It is also
the client under `worker_http.WorkerHttp` (probes, /metrics, /server_info). It does only
what a render call (and a worker GET) needs: a POST with a body or a GET; the status, the headers and a
body capped in size; keep-alive
reuse, with one retry on a fresh connection when a reused idle one turns out closed before any byte of the
answer; a bounded pool; plain TCP or TLS.

Everything a server sends is bounded: the header block (`MAX_HEADER_BYTES`), the number of headers, and the
body (the caller's cap, checked against content-length before reading and against every chunk while
reading). Any answer the parser refuses, or a connection lost mid-answer, is an error, never a partial body.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
IDLE_S = 25.0  # below the usual 30 s keep-alive of servers (uvicorn: 5 s; aiohttp: 75 s): the retry covers it


class HttpError(Exception):
    """The call failed before a complete answer arrived."""


class ConnectFailed(HttpError):
    """No connection, or the connection was lost before the answer was complete. `refused`: nothing listens
    there (the connection was refused), which a health probe reads as "the process is gone"."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class BadResponse(HttpError):
    """The server's bytes are not an HTTP/1.1 answer this client accepts (malformed, or headers too large)."""


class BodyTooLarge(HttpError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Stale(ConnectFailed):
    """A reused idle connection was closed by the server before any byte of the answer: safe to retry."""


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]  # lowercased names; a repeated header keeps its last value
    body: bytes


class _Conn(asyncio.Protocol):
    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Response] | None = None
        self.idle_since = 0.0
        self._reset(0)

    def _reset(self, max_body: int) -> None:
        self.max_body = max_body
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.nbody = 0
        self.header_bytes = 0  # raw bytes read while the headers were incomplete
        self.header_sum = 0  # bytes of the header names and values parsed
        self.headers_done = False
        self.got_bytes = False
        self._name = b""

    # -- the request
    def send(self, data: list[bytes], max_body: int) -> asyncio.Future[Response]:
        assert self.transport is not None and self.waiter is None
        self._reset(max_body)
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.writelines(data)
        return self.waiter

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: HttpError) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_exception(exc)
        self.abort()

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for (a server talking out of turn): not reusable
            self.abort()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            return  # one of our callbacks failed the request already
        except httptools.HttpParserError as e:
            self._fail(BadResponse(f"malformed HTTP answer: {e}"))
            return
        if not self.headers_done and self.waiter is not None:
            self.header_bytes += len(data)  # one read is at most 256 KiB: this bounds what the parser holds
            if self.header_bytes > MAX_HEADER_BYTES:
                self._fail(BadResponse(f"answer headers exceed {MAX_HEADER_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.origin._forget(self)
        w = self.waiter
        if w is None or w.done():
            return
        if self.headers_done and "content-length" not in self.headers and \
                "chunked" not in self.headers.get("transfer-encoding", "").lower():
            self._complete(keep_alive=False)  # an answer delimited by the end of the connection
            return
        self.waiter = None
        w.set_exception(_Stale("connection closed before the answer") if not self.got_bytes
                        else ConnectFailed("connection lost mid-answer"))

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.waiter is None:  # a second answer in the same read, never asked for: not a server to trust
            self.abort()
            raise httptools.HttpParserCallbackError("unsolicited answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS:
            self._fail(BadResponse(f"answer has more than {MAX_HEADERS} headers"))
            raise httptools.HttpParserCallbackError("too many headers")
        # a header block that arrives in one read is parsed whole before data_received can count it
        self.header_sum += len(name) + len(value)
        if self.header_sum > MAX_HEADER_BYTES:
            self._fail(BadResponse(f"answer headers exceed {MAX_HEADER_BYTES} bytes"))
            raise httptools.HttpParserCallbackError("headers too large")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        length = self.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            self._fail(BodyTooLarge(self.status, f"answer of {length} bytes exceeds the {self.max_body}-byte cap"))
            raise httptools.HttpParserCallbackError("body over cap")

    def on_body(self, body: bytes) -> None:
        self.nbody += len(body)
        if self.nbody > self.max_body:
            self._fail(BodyTooLarge(self.status, f"answer exceeds the {self.max_body}-byte cap"))
            raise httptools.HttpParserCallbackError("body over cap")
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self._complete(keep_alive=self.parser.should_keep_alive())

    def _complete(self, keep_alive: bool) -> None:
        w, self.waiter = self.waiter, None
        if w is None or w.done():
            return
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        w.set_result(Response(self.status, self.headers, body))
        self.chunks = []
        if keep_alive:
            self.origin._release(self)
        else:
            self.abort()


class Origin:
    """Kept-alive connections to one `http://` or `https://` origin (TLS verified with the system's CAs)."""

    def __init__(self, base_url: str, *, limit: int = 256, idle_s: float = IDLE_S,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self.ssl = (ssl_context or ssl.create_default_context()) if u.scheme == "https" else None
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = (u.scheme == "https" and self.port == 443) or (u.scheme == "http" and self.port == 80)
        self._host_header = (host if default else f"{host}:{self.port}").encode("idna")
        self.idle_s = idle_s
        self._slots = asyncio.Semaphore(limit)
        self._idle: list[_Conn] = []
        self._open: set[_Conn] = set()
        self._closed = False

    async def post(self, path: str, body: bytes, *, content_type: str, max_body: int) -> Response:
        """One POST; bound it with `asyncio.timeout` around the call (a cancelled call closes its connection)."""
        return await self.request(b"POST", path, body, content_type=content_type, max_body=max_body)

    async def get(self, path: str, *, max_body: int) -> Response:
        return await self.request(b"GET", path, None, content_type=None, max_body=max_body)

    async def request(self, method: bytes, path: str, body: bytes | None, *, content_type: str | None,
                      max_body: int) -> Response:
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method, (self.prefix + path).encode(), self._host_header)
        if content_type is not None:
            head += b"Content-Type: %s\r\n" % content_type.encode()
        if body is not None:
            head += b"Content-Length: %d\r\n" % len(body)
        head += b"User-Agent: epp-extproc\r\n\r\n"
        data = [head, body] if body else [head]
        async with self._slots:
            for _ in range(2):
                conn = self._take_idle()
                reused = conn is not None
                if conn is None:
                    conn = await self._connect()
                fut = conn.send(data, max_body)
                try:
                    return await fut
                except _Stale:
                    if reused:
                        continue  # the server closed it while idle: once more, on a new connection
                    raise ConnectFailed("connection closed before the answer") from None
                except BaseException:
                    if not fut.done():  # cancelled or timed out mid-answer: the connection is unusable
                        fut.cancel()
                        conn.waiter = None
                        conn.abort()
                    raise
            raise ConnectFailed("connection closed before the answer")  # pragma: no cover (loop returns)

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self.ssl,
                                                   server_hostname=self.host if self.ssl else None)
        except (OSError, ssl.SSLError) as e:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {e}",
                                refused=isinstance(e, ConnectionRefusedError)) from None
        self._open.add(conn)
        return conn

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None and not conn.transport.is_closing() and now - conn.idle_since < self.idle_s:
                return conn
            conn.abort()
        return None

    def _release(self, conn: _Conn) -> None:
        if self._closed:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
        self._open.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
