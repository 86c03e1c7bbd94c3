"""Flow control between propose and commit: the proposal waits for admission, is re-scored against the load
of the moment it is let through, commit books it, and a rejected or cancelled proposal books nothing."""

from __future__ import annotations

import asyncio
import json

import pytest

from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.flow_objectives import FlowKey
from epp_extproc.core.flow_queue import FlowController
from epp_extproc.core.request import RequestContext
from tests.scheduling_fakes import ADDRS, decide, make


class Room:
    def __init__(self, n: int) -> None:
        self.n = n

    def headroom(self, addresses: list[str]) -> int:
        return self.n


def chat() -> RequestContext:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    return RequestContext("POST", "/v1/chat/completions", {}, body, None)


def gated(room: Room, ttl_s: float = 5.0):  # noqa: ANN201
    fc = FlowController(room, lambda: list(ADDRS), ttl_s=ttl_s)  # type: ignore[arg-type]
    pipe, _, _ = make(admission=lambda ctx: fc.admit(FlowKey(0, "f"), ctx.subset))
    return pipe, fc


async def test_admitted_at_once_the_proposal_is_committed_unchanged() -> None:
    pipe, fc = gated(Room(1))
    d = await decide(pipe, chat())
    assert d.address in ADDRS and pipe.load.total_inflight() == 1 and fc.pending == 0


async def test_a_proposal_that_waited_is_rescored_against_the_load_of_that_moment() -> None:
    room = Room(0)
    pipe, fc = gated(room)
    p = await pipe.propose(chat())
    waiting = asyncio.create_task(pipe.admit(p, chat()))
    await asyncio.sleep(0.01)
    for _ in range(3):  # meanwhile its worker filled up (another gateway, or earlier requests)
        pipe.load.book(p.address, 10.0)
    room.n = 1
    fc.dispatch()
    q, ticket = await asyncio.wait_for(waiting, 1)
    assert q.address != p.address and q.started > p.started
    pipe.commit(q)
    ticket.release()  # type: ignore[union-attr]
    assert fc.pending == 0


async def test_ttl_expiry_books_nothing_and_is_a_429_fact() -> None:
    pipe, fc = gated(Room(0), ttl_s=0.05)
    with pytest.raises(PickError) as e:
        await decide(pipe, chat())
    assert e.value.problem is Problem.FLOW_TTL_EXPIRED
    assert pipe.load.total_inflight() == 0 and fc.size == 0 and fc.pending == 0


async def test_cancelled_while_queued_books_nothing() -> None:
    pipe, fc = gated(Room(0))
    task = asyncio.create_task(decide(pipe, chat()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pipe.load.total_inflight() == 0 and fc.size == 0 and fc.pending == 0
