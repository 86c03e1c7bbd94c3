"""`NatsLink.subscribe_direct` on a real nats-server: messages reach the handler from the client's read loop, in
order, without nats-py's per-subscription queue and task (the plane's ingest CPU, issue 47); a handler that
raises is logged and counted and does not stop the reading; the direct path survives a server restart."""

from __future__ import annotations

import asyncio

from epp_extproc.kvplane.link import NatsLink
from tests.natsutil import nats_server  # noqa: F401  (fixture)
from tests.waiting import until_async


async def test_direct_messages_come_in_order_from_the_read_loop_and_a_raising_handler_does_not_stop_it(
        nats_server):  # noqa: F811
    got: list[tuple[str, bytes, bool]] = []
    downs: list[int] = []

    async def up() -> None:
        pass

    link = NatsLink([nats_server.url], "t", on_up=up, on_down=lambda: downs.append(1))
    link.start()
    try:
        await until_async(lambda: link.connected, "connected")
        nc = link.nc
        assert nc is not None

        def handler(subject: str, data: bytes) -> None:
            if data == b"boom":
                raise ValueError("a handler bug")
            got.append((subject, data, asyncio.current_task() is nc._reading_task))

        sub = await link.subscribe_direct("t.ev.*", handler)
        pub = NatsLink([nats_server.url], "p", on_up=up, on_down=lambda: None)
        pub.start()
        await until_async(lambda: pub.connected, "publisher connected")
        assert pub.nc is not None
        await pub.nc.publish("t.ev.a", b"boom")
        for i in range(50):
            await pub.nc.publish(f"t.ev.{'ab'[i % 2]}", str(i).encode())
        await pub.nc.flush()
        await until_async(lambda: len(got) == 50, lambda: f"{len(got)} of 50")
        assert [d for _, d, _ in got] == [str(i).encode() for i in range(50)]
        assert got[1][0] == "t.ev.b" and all(in_read_loop for _, _, in_read_loop in got)
        assert nc.direct_errors == 1 and sub._pending_queue.qsize() == 0

        # a server restart: the client re-subscribes the same sid, the handler keeps getting them
        await nats_server.stop()
        await until_async(lambda: downs, "down noticed")
        await nats_server.start()
        await until_async(lambda: link.connected and pub.connected, "both back")
        await pub.nc.publish("t.ev.a", b"after")
        await pub.nc.flush()
        await until_async(lambda: got[-1][1] == b"after", "the message after the restart")
        await pub.close()
    finally:
        await link.close()
