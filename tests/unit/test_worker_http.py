"""`WorkerHttp`, the one way the picker reaches a worker: what it reuses, what it reports, what it drops."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from epp_extproc.adapters.worker_http import BodyTooLarge, ConnectFailed, TimedOut, WorkerHttp


class Worker:
    """Answers every GET with `answer` (or never, when `hang`); counts connections."""

    def __init__(self, answer: bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", hang: bool = False) -> None:
        self.answer = answer
        self.hang = hang
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                if self.hang:
                    await asyncio.sleep(3600)
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = Worker()
    w.server = await asyncio.start_server(w._conn, "127.0.0.1", 0)
    yield w
    w.server.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_reads_of_one_worker_share_a_kept_alive_connection(worker: Worker) -> None:
    http = WorkerHttp()
    for _ in range(3):
        r = await http.get(worker.address, "/metrics")
        assert (r.status, r.body) == (200, b"ok")
    assert worker.connections == 1
    await http.close()


async def test_a_fresh_read_opens_and_closes_its_own_connection(worker: Worker) -> None:
    http = WorkerHttp()
    for _ in range(2):
        assert (await http.get(worker.address, "/health", fresh=True)).status == 200
    assert worker.connections == 2
    await http.close()


async def test_nothing_listening_is_a_refused_connect() -> None:
    with pytest.raises(ConnectFailed) as e:
        await WorkerHttp().get(f"127.0.0.1:{_closed_port()}", "/health", fresh=True)
    assert e.value.refused


async def test_a_worker_that_does_not_answer_times_out(worker: Worker) -> None:
    worker.hang = True
    with pytest.raises(TimedOut):
        await WorkerHttp(timeout_s=0.2).get(worker.address, "/metrics")


async def test_an_answer_over_the_cap_is_refused(worker: Worker) -> None:
    worker.answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    with pytest.raises(BodyTooLarge):
        await WorkerHttp(max_body=10).get(worker.address, "/metrics")


async def test_an_address_that_is_not_host_port_is_a_connect_failure() -> None:
    with pytest.raises(ConnectFailed):
        await WorkerHttp().get("host:notaport", "/metrics")


async def test_retain_drops_the_connections_of_workers_no_longer_known(worker: Worker) -> None:
    http = WorkerHttp()
    await http.get(worker.address, "/metrics")
    await http.retain([])
    await http.get(worker.address, "/metrics")
    assert worker.connections == 2  # the first connection was dropped with its worker
    await http.close()
