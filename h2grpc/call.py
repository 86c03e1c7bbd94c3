"""One gRPC call on one HTTP/2 stream: its received messages (the 5-byte gRPC framing), its outbound flow
control, the servicer's handler task, and the servicer context (the part of grpc.aio.ServicerContext that
README.md's contract names)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import mmap
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from h2grpc.codec import (
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    HEADERS,
    RESPONSE_HEADERS,
    U32,
    WINDOW_UPDATE,
    ConnectionError_,
    frame,
    head,
    trailers,
)

if TYPE_CHECKING:
    from h2grpc.connection import Connection


# A message at least this big that arrives in several frames is assembled in its own anonymous mapping: the
# kernel commits its pages as frames fill them (resident memory follows the bytes received, not the size the
# prefix announces, which costs nothing to send) and returns them all when the message completes or its call
# ends, whatever the allocator did before. A smaller one gets a bytearray of its announced size from the heap
# (whose pages are usually resident already: a fresh mapping's page faults cost +40-50% of the transport's
# CPU for 0.3-2 MB messages), counted whole against the budget from its prefix on.
MAPPED_MIN = 1 << 20


class Aborted(Exception):
    """`context.abort`: ends the call with its status (grpcio's AbortError, an Exception too)."""


class Call:
    """One gRPC call: a stream's received messages, its outbound flow control, and the servicer's context."""

    __slots__ = ("sid", "conn", "method", "handler", "headers", "msgs", "unread", "partial", "ended", "waiter",
                 "task", "headers_sent", "closed", "reset", "send_window", "pending", "drained", "credit",
                 "status", "code_set", "details", "deadline", "timer", "recv_window", "head", "buf", "view", "filled",
                 "mapped", "opened_at")

    def __init__(self, conn: Connection, sid: int, method: str, handler: Any,
                 headers: list[tuple[str, str]]) -> None:
        self.sid = sid
        self.conn = conn
        self.method = method
        self.handler = handler
        self.headers = headers
        self.msgs: collections.deque[bytes] = collections.deque()
        self.unread = 0  # bytes of complete messages not yet taken by the handler
        # the unfinished message: its prefix while split across frames, then a buffer of the announced size
        # (bytearray or mmap) and a view of it that frames are copied into, each byte once
        self.partial = 0  # what it adds to the server's count of bytes in unfinished messages; 0: none
        self.head = b""
        self.buf: bytearray | mmap.mmap | None = None
        self.view: memoryview | None = None
        self.filled = 0
        self.mapped = False
        self.ended = False  # the client half-closed
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.headers_sent = False
        self.closed = False  # trailers sent (or reset): nothing more goes out
        self.reset = False
        self.send_window = conn.peer_initial_window - conn.window_shift  # its window is this + the shift
        self.pending = bytearray()  # framed output waiting for window
        self.drained: asyncio.Future[None] | None = None
        self.credit = 0  # stream window not yet given back (held while `unread` is over a window)
        self.recv_window = conn.stream_window  # what the peer may still send on this stream
        self.status: grpc.StatusCode | None = None  # set: the call is ending (trailers follow pending data)
        self.code_set: grpc.StatusCode | None = None  # the servicer's context.set_code()
        self.details: str | None = None
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.opened_at = conn.loop.time()

    # --- inbound -------------------------------------------------------------------------------------
    def on_data(self, data: bytes | memoryview, end: bool, flow_len: int) -> None:
        """`data` may be a view of the connection's read buffer: whatever is kept is copied out of it."""
        self.recv_window -= flow_len
        if self.recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, f"stream {self.sid} sent past its window")
        if self.closed:
            return
        if not self.partial and len(data) >= 5 and data[0] == 0 \
                and int.from_bytes(data[1:5], "big") == len(data) - 5 \
                and len(data) - 5 <= self.conn.server.max_receive_message_length:
            m = data[5:]  # the usual case: one whole message in one frame, copied once
            self.msgs.append(m if type(m) is bytes else bytes(m))
            self.unread += len(data)
        else:
            self._reassemble(data)
            if self.closed:
                return
        if end:
            self.ended = True
        self.credit += flow_len
        if self.credit >= self.conn.credit_step:
            self.give_credit()
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _reassemble(self, data: bytes | memoryview) -> None:
        """Messages split across frames (or several in one). Each byte is copied once, from the frame into the
        message's buffer, allocated once from its prefix; a complete message leaves it as bytes (one copy,
        what the deserializer takes) and the buffer is freed at once."""
        if self.status is not None:  # the call is ending (trailers wait for window): nothing reads the rest
            return
        view = self.view
        if view is not None:
            filled = self.filled
            end = filled + len(data)
            if end < len(view):  # the common case: a frame inside a large message
                view[filled:end] = data
                self.filled = end
                if self.mapped:
                    self._hold()
                return
        src = memoryview(data)
        i, n = 0, len(src)
        limit = self.conn.server.max_receive_message_length
        while i < n:
            view = self.view
            if view is None:  # between messages, or inside a prefix split across frames
                take = min(5 - len(self.head), n - i)
                head = self.head + bytes(src[i:i + take])
                i += take
                if len(head) < 5:
                    self.head = head
                    break
                self.head = b""
                if head[0] & 1:  # compressed: we advertise no grpc-accept-encoding, so not ours to read
                    self.finish_now(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not accepted")
                    return
                size = int.from_bytes(head[1:5], "big")
                if size > limit:
                    self.finish_now(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"Received message larger than max ({size} vs. {limit})")
                    return
                if n - i >= size:  # the whole message is in this frame
                    self.msgs.append(bytes(src[i:i + size]))
                    self.unread += 5 + size
                    i += size
                    continue
                if not self._allocate(size):
                    return
                view = self.view
                assert view is not None
            take = min(len(view) - self.filled, n - i)
            view[self.filled:self.filled + take] = src[i:i + take]
            self.filled += take
            i += take
            if self.filled == len(view):
                self.msgs.append(bytes(view))
                self.unread += 5 + len(view)
                self._free()
        self._hold()

    def _allocate(self, size: int) -> bool:
        """The buffer of a message of `size` bytes; False (and the call ended) when the budget or the system
        refuses it. A bytearray is counted whole from here on (and not allocated past the budget); a mapping,
        by the bytes its frames fill."""
        mapped = size >= MAPPED_MIN
        server = self.conn.server
        if not mapped and 5 + size - self.partial > server.partial_room():
            self.finish_now(grpc.StatusCode.RESOURCE_EXHAUSTED, "messages still arriving hold over "
                            f"{server.max_partial_bytes} bytes in this server")
            return False
        try:
            buf: bytearray | mmap.mmap = mmap.mmap(-1, size) if mapped else bytearray(size)
        except (OSError, MemoryError, ValueError):
            self.finish_now(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no memory for a message of {size} bytes")
            return False
        self.buf, self.view, self.filled, self.mapped = buf, memoryview(buf), 0, mapped
        return True

    def _hold(self) -> None:
        """Count what the unfinished message now holds against the server's budget; the call that passes it
        ends (its buffer is freed with it)."""
        view = self.view
        if view is None:
            held = len(self.head)
        elif self.mapped:
            held = 5 + self.filled
        else:
            held = 5 + len(view)
        grown = held - self.partial
        if grown:
            server = self.conn.server
            server.partial_bytes += grown
            self.partial = held
            if grown > 0 and server.partial_room() < 0:
                self.finish_now(grpc.StatusCode.RESOURCE_EXHAUSTED, "messages still arriving hold over "
                                f"{server.max_partial_bytes} bytes in this server")

    def _free(self) -> None:
        """Give the unfinished message's buffer back now (a mapping: to the kernel, at once)."""
        buf, view = self.buf, self.view
        self.buf = self.view = None
        self.filled = 0
        self.mapped = False
        if view is not None:
            view.release()
        if isinstance(buf, mmap.mmap):
            buf.close()

    def drop_partial(self) -> None:
        """The call ended: what the client was still sending is dropped, its memory and its count with it."""
        if self.buf is not None:
            self._free()
        self.head = b""
        if self.partial:
            self.conn.server.partial_bytes -= self.partial
            self.partial = 0

    def on_end(self) -> None:
        self.ended = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _messages(self, deserialize: Callable[[bytes], Any]) -> AsyncIterator[Any]:
        msgs = self.msgs
        while True:
            while msgs:
                self.unread -= 5 + len(msgs[0])
                if self.credit >= self.conn.credit_step:
                    self.give_credit()
                # no local keeps the message: this frame stays suspended while the handler waits for the next
                # one, and a name bound here would hold each call's last message (a whole body) until then
                yield deserialize(msgs.popleft())
            if self.ended:
                if self.partial:
                    raise Aborted(grpc.StatusCode.INTERNAL, "stream ended inside a message")
                return
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def give_credit(self) -> None:
        """Refill the stream window, unless a window's worth of messages already waits for the handler."""
        if self.unread <= self.conn.stream_window and not self.ended and not self.closed:
            self.conn.write(frame(WINDOW_UPDATE, 0, self.sid, U32.pack(self.credit)))
            self.recv_window += self.credit
            self.credit = 0

    async def _one(self, deserialize: Callable[[bytes], Any]) -> Any:
        got = None
        async for m in self._messages(deserialize):
            if got is not None:
                raise Aborted(grpc.StatusCode.UNIMPLEMENTED, "more than one request message on a unary call")
            got = m
        if got is None:
            raise Aborted(grpc.StatusCode.UNIMPLEMENTED, "no request message on a unary call")
        return got

    # --- outbound ------------------------------------------------------------------------------------
    def _send_message(self, msg: Any) -> bool:
        """Frame and send one message; False when part of it waits for window or the socket (await drain)."""
        if self.closed:
            raise asyncio.CancelledError()  # the peer reset the stream: the handler is being cancelled
        data = self.handler.response_serializer(msg)
        limit = self.conn.server.max_send_message_length
        if len(data) > limit:
            raise Aborted(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({len(data)} vs. "
                                                               f"{limit})")
        prefix = b"\x00" + len(data).to_bytes(4, "big")
        conn = self.conn
        first = b""
        if not self.headers_sent:
            self.headers_sent = True
            first = frame(HEADERS, END_HEADERS, self.sid, RESPONSE_HEADERS)
        n = 5 + len(data)
        if not self.pending and n <= conn.peer_max_frame and n <= self.send_window + conn.window_shift \
                and n <= conn.send_window:
            self.send_window -= n
            conn.send_window -= n
            conn.write(b"".join((first, head(n, DATA, 0, self.sid), prefix, data)))  # the message copied once
            return not conn.paused
        if first:
            conn.write(first)
        self.pending += prefix
        self.pending += data
        self.flush()
        return not self.pending and not conn.paused

    def flush(self) -> None:
        """Send what the windows now allow of `pending`; wake a writer waiting for it."""
        conn = self.conn
        p = self.pending
        out = []
        while p:
            n = min(len(p), conn.peer_max_frame, self.send_window + conn.window_shift, conn.send_window)
            if n <= 0:
                break
            out.append(head(n, DATA, 0, self.sid) + bytes(p[:n]))
            del p[:n]
            self.send_window -= n
            conn.send_window -= n
        if out:
            conn.write(b"".join(out))
        if p:
            conn.waiting[self.sid] = self
            return
        conn.waiting.pop(self.sid, None)
        if self.status is not None and not self.closed:
            self._sendtrailers()
        self.wake_writer()

    def wake_writer(self) -> None:
        d = self.drained
        if d is not None and not d.done() and not self.pending and not self.conn.paused:
            d.set_result(None)

    async def _drain(self) -> None:
        while (self.pending or self.conn.paused) and not self.closed:
            self.drained = self.conn.loop.create_future()
            try:
                await self.drained
            finally:
                self.drained = None
        if self.closed and self.reset:
            raise asyncio.CancelledError()

    def finish(self, code: grpc.StatusCode, details: str | None) -> None:
        """End the call: trailers, after any pending data. A client still sending is not reset (grpcio's
        client then reports INTERNAL instead of our status; Envoy resets the stream itself when it reads the
        trailers): what it sends afterwards is dropped, counted only on the connection's window."""
        if self.closed or self.status is not None:
            return
        self.status, self.details = code, details
        self.drop_partial()  # nothing reads the rest of a message now, even while trailers wait for window
        if not self.pending:
            self._sendtrailers()

    def _sendtrailers(self) -> None:
        assert self.status is not None
        block = trailers(self.status, self.details)
        if not self.headers_sent:  # trailers-only
            self.headers_sent = True
            block = RESPONSE_HEADERS + block
        self.closed = True
        self.conn.write(frame(HEADERS, END_HEADERS | END_STREAM, self.sid, block))
        self.conn.release(self)

    def finish_now(self, code: grpc.StatusCode, details: str) -> None:
        """A fault in what the client sent (or its deadline): drop what waits to go out, end the call with
        `code` and cancel its handler."""
        self.pending.clear()
        self.finish(code, details)
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def on_reset(self) -> None:
        self.reset = True
        self.closed = True
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        d = self.drained
        if d is not None and not d.done():
            d.set_result(None)
        self.conn.release(self)

    # --- the handler ---------------------------------------------------------------------------------
    async def run(self) -> None:
        h = self.handler
        arg: Any = None
        result: Any = None
        try:
            deserialize = h.request_deserializer
            if h.request_streaming:
                arg = self._messages(deserialize)
            else:
                arg = await self._one(deserialize)
            if h.response_streaming:
                result = (h.stream_stream if h.request_streaming else h.unary_stream)(arg, self)
                if hasattr(result, "__aiter__"):
                    async for r in result:
                        if not self._send_message(r):
                            await self._drain()
                else:
                    await result
            else:
                r = await (h.stream_unary if h.request_streaming else h.unary_unary)(arg, self)
                if r is not None and self.code_set is None:
                    if not self._send_message(r):
                        await self._drain()
            self.finish(self.code_set or grpc.StatusCode.OK, self.details)
        except Aborted as e:
            code, details = e.args
            self.finish(code, details)
        except asyncio.CancelledError:
            if not self.closed:  # cancelled by our own shutdown or a deadline, not by the peer
                self.finish(self.code_set or grpc.StatusCode.CANCELLED, self.details or "call cancelled")
        except Exception as e:  # noqa: BLE001 - the servicer's bug becomes the call's status, as in grpcio
            if self.code_set is None:
                self.conn.log.exception("gRPC handler %s failed", self.method)
                self.finish(grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}")
            else:  # e.g. the generated base class: set_code(UNIMPLEMENTED), then raise
                self.finish(self.code_set, self.details)
        finally:
            if self.timer is not None:
                self.timer.cancel()
            # generators left suspended would be finalized later by the loop, one task each: close them now
            # (the servicer's first, so its `finally` runs while the call is still this task's)
            for gen in (result, arg):
                if hasattr(gen, "aclose"):
                    with contextlib.suppress(BaseException):
                        await gen.aclose()
            # the call leaves the connection with its trailers (or the peer's reset), not here: trailers
            # may still wait behind data the peer's window does not take yet

    def expire(self) -> None:
        """The client's grpc-timeout passed: DEADLINE_EXCEEDED replaces whatever was still to be sent."""
        self.status, self.details = None, None  # even trailers already waiting behind unsent data
        if not self.closed:
            self.finish_now(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    # --- grpc.aio.ServicerContext, the parts servicers use -------------------------------------------
    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        if code is grpc.StatusCode.OK:
            raise ValueError("abort with OK")
        raise Aborted(code, details)

    async def write(self, message: Any) -> None:
        if not self._send_message(message):
            await self._drain()

    async def read(self) -> Any:
        raise NotImplementedError("read() is not supported by this server; iterate the requests")

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code_set = code

    def set_details(self, details: str) -> None:
        self.details = details

    def code(self) -> grpc.StatusCode | None:
        return self.code_set

    def cancelled(self) -> bool:
        return self.reset

    def done(self) -> bool:
        return self.closed

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        # a list comprehension over the decoder's own (name, value) tuples: ~0.6 us for Envoy's ten fields,
        # where a generator into tuple() that rebuilt each pair took ~1.1 us (read once per traced stream)
        return tuple([h for h in self.headers if h[0][:1] != ":"])

    def metadata_value(self, key: str) -> str | None:
        """The first value `invocation_metadata()` holds for `key` (a lower-case name), or None: one field found
        without building that tuple. Not grpc.aio's: a servicer that reads one field on every call (the picker:
        Envoy's `traceparent`) asks for it where the context has it, ~2k instructions for Envoy's ten fields
        against ~9k for the tuple and a scan of it."""
        if key[:1] == ":":
            return None  # a pseudo-header is no metadata
        for k, v in self.headers:
            if k == key:
                return v
        return None

    def peer(self) -> str:
        return self.conn.peer_name

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - self.conn.loop.time())
