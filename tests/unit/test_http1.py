"""The renderer's HTTP/1.1 client against servers that write raw bytes: what it accepts, reuses and refuses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from epp_extproc.adapters.http1 import (
    MAX_HEADER_BYTES,
    BadResponse,
    BodyTooLarge,
    ConnectFailed,
    Origin,
    Response,
)
from tests.loops import event_loop_policy  # noqa: F401 - both loops

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class RawServer:
    """Calls `handler(reader, writer, n)` for each request head read (n counts requests on that connection)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.heads: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                await self.handler(reader, writer, n)
                n += 1
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def answer(data: bytes) -> Handler:
    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(data)
        await writer.drain()
    return h


async def post(origin: Origin, body: bytes = b"{}", max_body: int = 1 << 20) -> Response:
    async with asyncio.timeout(5):
        return await origin.post("/render", body, content_type="application/json", max_body=max_body)


async def test_calls_reuse_one_kept_alive_connection_and_send_host_path_and_length() -> None:
    async with RawServer(answer(OK)) as srv:
        hostport = srv.url.removeprefix("http://")
        origin = Origin(srv.url + "/prefix/")
        for _ in range(3):
            r = await post(origin, b'{"a":1}')
            assert (r.status, r.body, r.headers["content-type"]) == (200, b"{}", "application/json")
        await origin.close()
    assert srv.connections == 1
    head = srv.heads[0].decode()
    assert head.startswith("POST /prefix/render HTTP/1.1\r\n")
    assert f"Host: {hostport}\r\n" in head and "Content-Length: 7\r\n" in head


async def test_a_reused_connection_closed_before_any_answer_byte_is_retried_once_on_a_new_one() -> None:
    async def second_request_dropped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:  # the idle-timeout race: the server closes just as the client reuses the connection
            writer.close()
            return
        writer.write(OK)
        await writer.drain()

    async with RawServer(second_request_dropped) as srv:
        origin = Origin(srv.url)
        assert (await post(origin)).status == 200
        assert (await post(origin)).status == 200
        await origin.close()
    assert srv.connections == 2


async def test_a_new_connection_closed_before_any_answer_byte_fails_without_retrying() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.close()

    async with RawServer(drop) as srv:
        origin = Origin(srv.url)
        with pytest.raises(ConnectFailed, match="before the answer"):
            await post(origin)
        await origin.close()
    assert srv.connections == 1


async def test_connection_close_answers_are_not_reused() -> None:
    async with RawServer(answer(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")) as srv:
        origin = Origin(srv.url)
        await post(origin)
        await post(origin)
        await origin.close()
    assert srv.connections == 2


async def test_a_chunked_answer_is_joined() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    async with RawServer(answer(chunked)) as srv:
        origin = Origin(srv.url)
        assert (await post(origin)).body == b"abcde"
        assert (await post(origin)).body == b"abcde"
        await origin.close()
    assert srv.connections == 1


async def test_an_answer_delimited_by_the_end_of_the_connection_is_complete() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n[1,2,3]")
        await writer.drain()
        writer.close()

    async with RawServer(until_close) as srv:
        origin = Origin(srv.url)
        assert (await post(origin)).body == b"[1,2,3]"
        await origin.close()


async def test_a_declared_length_over_the_cap_fails_before_the_body_is_read() -> None:
    async with RawServer(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n")) as srv:
        origin = Origin(srv.url)
        with pytest.raises(BodyTooLarge) as e:
            await post(origin, max_body=1000)
        assert e.value.status == 200
        await origin.close()


async def test_a_chunked_body_growing_over_the_cap_fails_and_keeps_the_status() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(100):
            writer.write(b"400\r\n" + b"x" * 1024 + b"\r\n")
            await writer.drain()

    async with RawServer(endless) as srv:
        origin = Origin(srv.url)
        with pytest.raises(BodyTooLarge) as e:
            await post(origin, max_body=10_000)
        assert e.value.status == 503
        await origin.close()


async def test_headers_over_the_limit_are_refused() -> None:
    async def huge_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(MAX_HEADER_BYTES // 1000 + 2):
            writer.write(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000))
            await writer.drain()
        await asyncio.sleep(1)

    async with RawServer(huge_headers) as srv:
        origin = Origin(srv.url)
        with pytest.raises(BadResponse, match="headers exceed"):
            await post(origin)
        await origin.close()


async def test_too_many_headers_are_refused() -> None:
    many = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"Content-Length: 0\r\n\r\n"
    async with RawServer(answer(many)) as srv:
        origin = Origin(srv.url)
        with pytest.raises(BadResponse, match="more than"):
            await post(origin)
        await origin.close()


async def test_bytes_that_are_not_http_are_a_bad_response() -> None:
    async with RawServer(answer(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")) as srv:
        origin = Origin(srv.url)
        with pytest.raises(BadResponse, match="malformed"):
            await post(origin)
        await origin.close()


async def test_a_connection_lost_mid_body_is_a_failure_not_a_short_body() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"token_ids\":")
        await writer.drain()
        writer.close()

    async with RawServer(cut) as srv:
        origin = Origin(srv.url)
        with pytest.raises(ConnectFailed, match="mid-answer"):
            await post(origin)
        await origin.close()


async def test_a_call_cancelled_mid_answer_closes_its_connection_and_the_next_call_works() -> None:
    async def slow_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if srv.connections == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")  # the body never comes
            await writer.drain()
            await asyncio.sleep(5)
            return
        writer.write(OK)
        await writer.drain()

    async with RawServer(slow_first) as srv:
        origin = Origin(srv.url)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await origin.post("/render", b"{}", content_type="application/json", max_body=100)
        assert (await post(origin)).body == b"{}"
        await origin.close()
    assert srv.connections == 2


async def test_a_refused_connection_is_connect_failed() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    origin = Origin(f"http://127.0.0.1:{port}")
    with pytest.raises(ConnectFailed, match="cannot connect"):
        await post(origin)


def test_only_http_urls_are_origins() -> None:
    with pytest.raises(ValueError):
        Origin("ftp://renderer:21")


async def test_an_https_origin_is_verified_and_a_certificate_it_does_not_trust_is_refused(tmp_path: Path) -> None:
    import ssl

    from epp_extproc.envoy.tls import self_signed

    cert = self_signed(cert_dir=tmp_path)
    key = tmp_path / "tls.key"
    key.write_bytes(cert.key_pem)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(str(cert.cert_file), str(key))

    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(OK)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(h, "127.0.0.1", 0, ssl=server_ctx)
    url = f"https://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    trusting = Origin(url, ssl_context=ssl.create_default_context(cafile=str(cert.cert_file)))
    assert (await post(trusting)).body == b"{}"
    with pytest.raises(ConnectFailed, match="certificate verify failed"):
        await post(Origin(url))  # the system's CAs do not know a self-signed certificate
    await trusting.close()
    srv.close()


async def test_an_answer_nobody_asked_for_closes_the_connection_and_leaves_the_first_intact() -> None:
    extra = b"HTTP/1.1 200 OK\r\nX-Sneaky: 1\r\nContent-Length: 2\r\n\r\n[]"
    async with RawServer(answer(OK + extra)) as srv:
        origin = Origin(srv.url)
        first = await post(origin)
        assert first.body == b"{}" and "x-sneaky" not in first.headers
        second = await post(origin)  # on a new connection: the one that talked out of turn is gone
        assert second.body == b"{}"
        await origin.close()
    assert srv.connections == 2
