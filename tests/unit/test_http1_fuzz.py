"""Whatever bytes a renderer or worker answers with, `adapters/http1.py` gives a clean `HttpError` or a bounded
`Response`: never another exception type, never a body over the caller's cap, never a hang.

One loopback server answers each request with the bytes an example chose, then closes the connection.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp_extproc.adapters.http1 import MAX_HEADER_BYTES, MAX_HEADERS, HttpError, Origin, Response

MAX_BODY = 4096


class _Answerer(asyncio.Protocol):
    """Sends the current example's bytes on the first request bytes, then closes."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.sent = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.sent:
            self.sent = True
            self.transport.write(self.server.answer)  # type: ignore[attr-defined]
            self.transport.close()  # type: ignore[attr-defined]


class _Server:
    def __init__(self) -> None:
        self.answer = b""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        srv = asyncio.run_coroutine_threadsafe(
            self.loop.create_server(lambda: _Answerer(self), "127.0.0.1", 0), self.loop).result(5)
        self.srv = srv
        self.port = srv.sockets[0].getsockname()[1]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.srv.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


def _ask(server: _Server, answer: bytes) -> Response | HttpError:
    """One GET answered with `answer`; any exception other than HttpError propagates (the test fails)."""
    server.answer = answer

    async def go() -> Response | HttpError:
        origin = Origin(f"http://127.0.0.1:{server.port}", limit=1)
        try:
            async with asyncio.timeout(5):
                return await origin.get("/x", max_body=MAX_BODY)
        except HttpError as e:
            return e
        finally:
            await origin.close()

    return asyncio.run(go())


def _check(outcome: Response | HttpError) -> None:
    if isinstance(outcome, Response):
        assert len(outcome.body) <= MAX_BODY
        assert len(outcome.headers) <= MAX_HEADERS
        assert 0 <= outcome.status <= 999


# ------------------------------------------------------------------ strategies
_token = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789"), min_size=1, max_size=20)
_value = st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_length = st.one_of(st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()),
                    st.sampled_from([b"", b" 5", b"5 ", b"0x10", b"5, 5", b"+5", b"1e3", b"\xff"]))


@st.composite
def _chunked(draw: st.DrawFn) -> bytes:
    out = b""
    for data in draw(st.lists(st.binary(max_size=300), max_size=6)):
        size = draw(st.one_of(st.just(f"{len(data):x}".encode()), st.integers(-5, 2**70).map(
            lambda n: f"{n:x}".encode() if n >= 0 else str(n).encode()), st.sampled_from([b"zz", b"", b"1;ext=1"])))
        out += size + b"\r\n" + data + b"\r\n"
    if draw(st.booleans()):
        out += b"0\r\n" + b"".join(draw(st.lists(_token.map(lambda t: t.encode() + b": x\r\n"), max_size=3))) + b"\r\n"
    return out


@st.composite
def _responses(draw: st.DrawFn) -> bytes:
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1 ", b"HTTX/1.1", b""]))
    status = draw(st.one_of(st.integers(-1000, 100000).map(lambda n: str(n).encode()),
                            st.sampled_from([b"200", b"101", b"100", b"204", b"304", b"abc", b""])))
    head = version + b" " + status + b" " + draw(st.sampled_from([b"OK", b"", b"\xff\xfe"])) + b"\r\n"
    headers = [(t.encode(), v) for t, v in draw(st.lists(st.tuples(_token, _value), max_size=8))]
    body_kind = draw(st.sampled_from(["length", "chunked", "close", "both"]))
    body = draw(st.binary(max_size=2 * MAX_BODY))
    if body_kind in ("length", "both"):
        headers.append((b"Content-Length", draw(st.one_of(st.just(str(len(body)).encode()), _length))))
    if body_kind in ("chunked", "both"):
        headers.append((b"Transfer-Encoding", b"chunked"))
        body = draw(_chunked())
    if draw(st.booleans()):
        headers.append((b"Connection", draw(st.sampled_from([b"close", b"keep-alive", b"upgrade"]))))
    raw = head + b"".join(n + b": " + v + b"\r\n" for n, v in headers) + b"\r\n" + body
    cut = draw(st.integers(0, len(raw)))
    return raw[:cut] if draw(st.booleans()) else raw  # truncated at a random byte, or whole


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(_responses()))
    for _ in range(draw(st.integers(1, 8))):
        if not raw:
            break
        i = draw(st.integers(0, len(raw) - 1))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        if op == "flip":
            raw[i] ^= draw(st.integers(1, 255))
        elif op == "insert":
            raw[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[i]
    return bytes(raw)


_settings = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@_settings
@given(answer=st.binary(max_size=2048))
def test_random_bytes_give_a_clean_error_or_a_bounded_answer(server: _Server, answer: bytes) -> None:
    _check(_ask(server, answer))


@_settings
@given(answer=_responses())
def test_malformed_or_truncated_responses_give_a_clean_error_or_a_bounded_answer(server: _Server,
                                                                                 answer: bytes) -> None:
    _check(_ask(server, answer))


@_settings
@given(answer=_mutated())
def test_mutated_responses_give_a_clean_error_or_a_bounded_answer(server: _Server, answer: bytes) -> None:
    _check(_ask(server, answer))


def test_a_header_flood_is_refused(server: _Server) -> None:
    many = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(MAX_HEADERS + 50)) + \
        b"Content-Length: 0\r\n\r\n"
    assert isinstance(_ask(server, many), HttpError)


def test_a_header_block_over_the_cap_is_refused(server: _Server) -> None:
    big = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 10) + b"\r\nContent-Length: 0\r\n\r\n"
    assert isinstance(_ask(server, big), HttpError)


def test_a_huge_content_length_is_refused_before_reading(server: _Server) -> None:
    huge = b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\nabc"
    assert isinstance(_ask(server, huge), HttpError)


def test_a_body_delimited_by_close_is_capped(server: _Server) -> None:
    endless = b"HTTP/1.1 200 OK\r\n\r\n" + b"z" * (MAX_BODY * 4)
    assert isinstance(_ask(server, endless), HttpError)


def test_chunks_beyond_the_cap_are_refused(server: _Server) -> None:
    chunks = b"".join(b"%x\r\n%s\r\n" % (1000, b"q" * 1000) for _ in range(10)) + b"0\r\n\r\n"
    assert isinstance(_ask(server, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks), HttpError)


def test_a_well_formed_answer_still_comes_through(server: _Server) -> None:
    """Negative control: the fuzz tests must not pass merely because everything errors."""
    r = _ask(server, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello")
    assert isinstance(r, Response) and (r.status, r.body, r.headers["x-a"]) == (200, b"hello", "b")
