"""The checks only a gateway shows (`--envoy`): a request through a real Envoy in front of the picker under
test reaches exactly the endpoint it chose with its body unchanged, the client sees the picker's 503 and 429,
and a client-sent destination never chooses.

Each row is the direct check of the same rule (same name, level and protocol text, from `checks.CHECKS`),
run again end to end and marked "via Envoy"; the verdict is read from what the client got back and what the
stand-in workers received (`gateway.ConformanceGateway`), never from the picker's messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import aiohttp

from epp_extproc.conformance.checks import CHECKS, OUTSIDE, Check, Verdict, failed, passed, skipped
from epp_extproc.conformance.gateway import HOLD_HEADER, ID_HEADER, SERVED_BY_HEADER, ConformanceGateway
from epp_extproc.conformance.protocol import BUFFERED, FULL_DUPLEX, chat_body
from epp_extproc.gaie import DEST_HEADER, SUBSET_KEY

__all__ = ["ENVOY_CHECKS", "EnvoyProbe", "Reply"]

HOLD_WAIT_S = 2.0  # how long a held request may take to reach its worker
BODY_SALT_REPEAT = 40  # ~50 KB bodies: Envoy streams them to the picker in several chunks


@dataclass(frozen=True)
class Reply:
    request_id: str
    status: int
    served_by: str | None  # the worker's address on its answer
    body: bytes
    sent_sha256: str
    sent_length: int


@dataclass
class EnvoyProbe:
    gateway: ConformanceGateway
    session: aiohttp.ClientSession
    model: str = "conformance"
    shed_headers: tuple[tuple[str, str], ...] = ()
    hold: int = 0
    timeout_s: float = 10.0
    _held: list[asyncio.Task[Reply]] = field(default_factory=list)
    held_ids: list[str] = field(default_factory=list)

    async def request(self, mode: str = FULL_DUPLEX, *, headers: tuple[tuple[str, str], ...] = (),
                      url: str | None = None, rid: str | None = None) -> Reply:
        rid = rid or uuid.uuid4().hex
        body = chat_body(self.model, salt=rid * BODY_SALT_REPEAT)
        hs = {"content-type": "application/json", ID_HEADER: rid, **dict(headers)}
        async with self.session.post(f"{url or self.gateway.urls[mode]}/v1/chat/completions", data=body,
                                     headers=hs, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
            got = await r.read()
            return Reply(rid, r.status, r.headers.get(SERVED_BY_HEADER), got, hashlib.sha256(body).hexdigest(),
                         len(body))

    def hold_one(self) -> asyncio.Task[Reply]:
        """A request the worker answers only on `release()`: in flight to the picker, as a long generation."""
        rid = uuid.uuid4().hex
        self.held_ids.append(rid)
        task = asyncio.ensure_future(self.request(FULL_DUPLEX, headers=((HOLD_HEADER, "1"),), rid=rid))
        self._held.append(task)
        return task

    async def wait_held(self, n: int) -> None:
        """Until `n` held requests reached their workers (or HOLD_WAIT_S: a picker that queues them holds them
        all the same; or one of them was answered already, e.g. refused)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HOLD_WAIT_S
        while loop.time() < deadline:
            if sum(bool(self.gateway.received(rid)) for rid in self.held_ids) >= n or any(t.done() for t in self._held):
                return
            await asyncio.sleep(0.02)

    async def release(self) -> None:
        self.gateway.release_held()
        held, self._held, self.held_ids = self._held, [], []
        await asyncio.gather(*held, return_exceptions=True)


def _routed(p: EnvoyProbe, reply: Reply, expect: set[str] | None = None) -> Verdict:
    """The request reached exactly one pool worker, the one named first in the destination it was routed
    with, with the bytes the client sent, and the client got that worker's answer."""
    seen = p.gateway.received(reply.request_id)
    if reply.status != 200:
        return failed(f"client got HTTP {reply.status} {reply.body[:120]!r}; workers saw {len(seen)} request(s)")
    if len(seen) != 1:
        return failed(f"the request reached {len(seen)} workers ({[r.worker for r in seen]})")
    (r,) = seen
    if r.worker not in p.gateway.workers:
        return failed(f"the request reached {r.worker}, which is not in the pool")
    first = (r.destination or "").split(",")[0].strip()
    if first != r.worker:
        return failed(f"worker {r.worker} got it with {DEST_HEADER}: {r.destination!r}")
    if (r.sha256, r.length) != (reply.sent_sha256, reply.sent_length):
        return failed(f"body changed on the way: sent {reply.sent_length} bytes, {r.worker} received {r.length} "
                      f"(sha256 {r.sha256[:12]} vs {reply.sent_sha256[:12]})")
    if reply.served_by != r.worker or json.loads(reply.body).get("sha256") != r.sha256:
        return failed(f"the client's answer came from {reply.served_by}, the request went to {r.worker}")
    if expect is not None and r.worker not in expect:
        return failed(f"routed to {r.worker}, not within {sorted(expect)}")
    return passed(f"reached {r.worker} (its destination header), {r.length} bytes unchanged, answered 200")


async def streamed_routed(p: EnvoyProbe) -> Verdict:
    return _routed(p, await p.request(FULL_DUPLEX))


async def buffered_routed(p: EnvoyProbe) -> Verdict:
    return _routed(p, await p.request(BUFFERED))


async def served_endpoint_answered(p: EnvoyProbe) -> Verdict:
    """The response phase goes through the picker too (its stream carries the served endpoint): a picker
    that fails it turns the answer into Envoy's 500 (failure_mode_allow false)."""
    verdicts = [_routed(p, await p.request(FULL_DUPLEX)) for _ in range(2)]
    bad = [v for v in verdicts if v.status != "pass"]
    return bad[0] if bad else passed("both answers came back whole through the picker's response phase")


async def client_destination_ignored(p: EnvoyProbe) -> Verdict:
    assert p.gateway.decoy is not None
    decoy = p.gateway.decoy.address
    reply = await p.request(FULL_DUPLEX, headers=((DEST_HEADER, decoy),))
    if any(r.worker == decoy for r in p.gateway.received(reply.request_id)):
        return failed(f"the client's {DEST_HEADER}: {decoy} (a server outside the pool) received the request")
    if reply.status != 200:
        return passed(f"not routed to the client's choice (HTTP {reply.status})")
    v = _routed(p, reply)
    return passed(f"the client's {decoy} was not honoured; {v.why}") if v.status == "pass" else v


async def _expect_status(p: EnvoyProbe, status: int, reply: Reply) -> Verdict:
    seen = p.gateway.received(reply.request_id)
    if reply.status == status and not seen:
        return passed(f"client got HTTP {status}; no worker received the request")
    where = f"; it reached {[r.worker for r in seen]}" if seen else ""
    return failed(f"client got HTTP {reply.status}, not {status}{where}")


async def subset_disjoint_503(p: EnvoyProbe) -> Verdict:
    return await _expect_status(p, 503, await p.request(FULL_DUPLEX, headers=((SUBSET_KEY, OUTSIDE),)))


async def subset_respected(p: EnvoyProbe) -> Verdict:
    for target in list(p.gateway.workers)[:2]:
        for _ in range(2):
            reply = await p.request(FULL_DUPLEX, headers=((SUBSET_KEY, f"{target},{OUTSIDE}"),))
            v = _routed(p, reply, {target})
            if v.status != "pass":
                return failed(f"hint {target},{OUTSIDE}: {v.why}")
    return passed(f"every hinted request reached the one pool endpoint of its hint {list(p.gateway.workers)[:2]}")


async def no_endpoints_503(p: EnvoyProbe) -> Verdict:
    url = p.gateway.urls.get("empty")
    if url is None:
        return skipped("needs --no-endpoints-target")
    return await _expect_status(p, 503, await p.request(FULL_DUPLEX, url=url))


async def shedding_429(p: EnvoyProbe) -> Verdict:
    if not p.shed_headers:
        return skipped("needs --shed-header and --hold N")
    idle = await p.request(FULL_DUPLEX, headers=p.shed_headers)
    if p.hold and idle.status != 200:
        return failed(f"a sheddable request got HTTP {idle.status} with nothing held: not shedding, refusing")
    try:
        for _ in range(p.hold):
            p.hold_one()
        await p.wait_held(p.hold)
        reply = await p.request(FULL_DUPLEX, headers=p.shed_headers)
    finally:
        await p.release()
    return await _expect_status(p, 429, reply)


_BY_NAME = {c.name: c for c in CHECKS}


def _via(name: str, run: Callable[[EnvoyProbe], Awaitable[Verdict]]) -> Check:
    return replace(_BY_NAME[name], run=run, via="Envoy")  # type: ignore[arg-type]


ENVOY_CHECKS: tuple[Check, ...] = (
    _via("streamed-destination", streamed_routed),
    _via("buffered-destination", buffered_routed),
    _via("client-destination-ignored", client_destination_ignored),
    _via("subset-disjoint-503", subset_disjoint_503),
    _via("subset-respected", subset_respected),
    _via("served-endpoint-accepted", served_endpoint_answered),
    _via("no-endpoints-503", no_endpoints_503),
    _via("shedding-429", shedding_429),
)
