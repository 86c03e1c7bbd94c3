"""The P/D sidecar's allowlist follows an InferencePool (``--inference-pool``): a sidecar served over real HTTP,
its pool watched on the fake API server (tests/fake_k8s.py, real list/watch JSON), vLLM-shaped prefill workers
listening on the pods' own loopback addresses (127.0.0.x, one per pod, the pool's target port) so an allowed
pod is one the prefill leg really reaches.

Waits are for conditions (bounded, see tests/waiting.py), never for time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from epp_extproc.pd_sidecar.server import Sidecar, SidecarConfig
from tests.fake_k8s import PODS, POOLS, FakeKube, make_pod, make_pool
from tests.integration.pd_fakes import VllmDecode, VllmPrefill
from tests.netutil import free_port
from tests.waiting import until_async

pytestmark = pytest.mark.timeout(30)

HEADER = "x-prefiller-host-port"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
POOL = "llm-pool"
SELECTOR = {"app": "llm-worker"}


def prefill_pod(name: str, ip: str, *, ready: bool = True, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return make_pod(name, ip, ready=ready, labels={**SELECTOR, "llm-d.ai/role": "prefill"} if labels is None
                    else labels)


class PrefillAt(VllmPrefill):
    """A prefill worker on one pod's address (127.0.0.x) and the pool's port."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.host, self.port = host, port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._entry)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()


@dataclass
class Pd:
    kube: FakeKube
    sidecar: Sidecar
    url: str
    port: int  # the pool's target port: every prefill worker listens on it
    http: aiohttp.ClientSession
    prefills: dict[str, PrefillAt] = field(default_factory=dict)

    async def prefill_at(self, ip: str) -> PrefillAt:
        p = self.prefills.get(ip)
        if p is None:
            p = self.prefills[ip] = PrefillAt(ip, self.port)
            await p.start()
        return p

    async def ask(self, target: str) -> int:
        """One chat request naming `target` as its prefill worker; the status the client sees."""
        async with self.http.post(f"{self.url}/v1/chat/completions", json=BODY, headers={HEADER: target}) as r:
            await r.read()
            return r.status

    def allowed(self, target: str) -> bool:
        return target in self.sidecar.allowlist.current

    def metric(self, name: str, **labels: str) -> float:
        return self.sidecar.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as k:
        yield k


@pytest.fixture
async def start(kube: FakeKube) -> AsyncIterator[Callable[..., Awaitable[Pd]]]:
    """Seeds nothing: a test puts its pool and pods, then starts the sidecar (static list and cap optional)."""
    decode = VllmDecode()
    await decode.start()
    port = free_port()
    made: list[tuple[web.AppRunner, Pd]] = []

    async def _start(static: frozenset[str] = frozenset(), cap: int = 4096, wait_sync: bool = True) -> Pd:
        cfg = SidecarConfig(decode_url=f"http://{decode.address}", engine="vllm", allowed_prefillers=static,
                            inference_pool=f"default/{POOL}", max_allowed_prefillers=cap)
        sidecar = Sidecar(cfg, api_client_factory=kube.api_client, backoff_initial_s=0.05, backoff_max_s=0.2)
        runner = web.AppRunner(sidecar.app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        pd = Pd(kube, sidecar, f"http://127.0.0.1:{runner.addresses[0][1]}", port, aiohttp.ClientSession())
        made.append((runner, pd))
        if wait_sync:
            await until_async(lambda: sidecar.allowlist.synced, "the allowlist's first sync")
        return pd

    yield _start
    for runner, pd in made:
        await pd.http.close()
        await runner.cleanup()  # stops the pool watch (on_cleanup)
        for p in pd.prefills.values():
            await p.stop()
    await decode.stop()


def seed(kube: FakeKube, port: int, *pods: dict[str, Any]) -> None:
    kube.put(POOLS, make_pool(POOL, SELECTOR, ports=(port,)))
    for p in pods:
        kube.put(PODS, p)


# ---------------------------------------------------------------------------------------------- joining and leaving


async def test_a_prefill_pod_joining_the_pool_becomes_allowed(kube, start):
    pd = await start()
    seed(kube, pd.port)
    worker = await pd.prefill_at("127.0.0.2")
    assert await pd.ask(worker.address) == 403  # not in the pool yet
    kube.put(PODS, prefill_pod("prefill-a", "127.0.0.2"))
    await until_async(lambda: pd.allowed(worker.address), "the joining pod allowed")
    assert await pd.ask(worker.address) == 200
    assert len(worker.seen) == 1  # the prefill leg went to the pod
    assert pd.metric("pd_sidecar_requests_total", route="disaggregated", reason="ok") == 1


async def test_a_prefill_pod_leaving_the_pool_is_refused_again(kube, start):
    pd = await start(wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-a", "127.0.0.2"))
    worker = await pd.prefill_at("127.0.0.2")
    await until_async(lambda: pd.allowed(worker.address), "the pod allowed")
    assert await pd.ask(worker.address) == 200
    kube.delete(PODS, "prefill-a")
    await until_async(lambda: not pd.allowed(worker.address), "the deleted pod refused")
    assert await pd.ask(worker.address) == 403
    assert len(worker.seen) == 1  # nothing reached it after it left


async def test_a_prefill_pod_that_stops_being_ready_is_refused(kube, start):
    pd = await start(wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-a", "127.0.0.2"))
    target = f"127.0.0.2:{pd.port}"
    await until_async(lambda: pd.allowed(target), "the ready pod allowed")
    kube.put(PODS, prefill_pod("prefill-a", "127.0.0.2", ready=False))
    await until_async(lambda: not pd.allowed(target), "the unready pod refused")
    assert await pd.ask(target) == 403


async def test_a_prefill_pod_whose_ip_changes_is_allowed_at_the_new_address_only(kube, start):
    pd = await start(wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-a", "127.0.0.2"))
    old, new = f"127.0.0.2:{pd.port}", f"127.0.0.3:{pd.port}"
    await until_async(lambda: pd.allowed(old), "the first address allowed")
    kube.put(PODS, prefill_pod("prefill-a", "127.0.0.3"))
    await until_async(lambda: pd.allowed(new), "the new address allowed")
    assert not pd.allowed(old)
    assert await pd.ask(old) == 403


async def test_a_prefill_pod_replaced_during_traffic_is_allowed_within_seconds(kube, start):
    """A rollout under load: the old prefill pod goes, a new one (new name, new IP) comes; requests keep naming
    whichever pod the picker would name. The new pod is served within seconds of joining, the old refused."""
    pd = await start(wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-old", "127.0.0.2"))
    old, new = await pd.prefill_at("127.0.0.2"), await pd.prefill_at("127.0.0.3")
    await until_async(lambda: pd.allowed(old.address), "the old pod allowed")
    statuses: dict[str, list[int]] = {old.address: [], new.address: []}
    stop = asyncio.Event()

    async def traffic(target: str) -> None:
        while not stop.is_set():
            statuses[target].append(await pd.ask(target))

    tasks = [asyncio.create_task(traffic(old.address)), asyncio.create_task(traffic(new.address))]
    try:
        await until_async(lambda: statuses[old.address].count(200) >= 3, "traffic on the old pod")
        kube.put(PODS, prefill_pod("prefill-new", "127.0.0.3"))
        joined = time.monotonic()
        await until_async(lambda: 200 in statuses[new.address], "the new pod served")
        served_after = time.monotonic() - joined
        kube.delete(PODS, "prefill-old")
        n = len(statuses[old.address])
        await until_async(lambda: statuses[old.address][n:].count(403) >= 3, "the old pod refused")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert served_after < 5.0
    first_refusal = statuses[old.address].index(403, n)
    assert set(statuses[old.address][first_refusal:]) == {403}  # once refused, refused for good
    assert len(new.seen) >= 1


# ---------------------------------------------------------------------------------------------- what stays refused


async def test_a_pod_outside_the_selector_is_refused(kube, start):
    outsider = prefill_pod("web", "127.0.0.4", labels={"app": "web", "llm-d.ai/role": "prefill"})
    pd = await start(wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-a", "127.0.0.2"), outsider)
    worker = await pd.prefill_at("127.0.0.4")
    await until_async(lambda: pd.allowed(f"127.0.0.2:{pd.port}"), "the pool's pod allowed")
    assert await pd.ask(worker.address) == 403
    assert worker.seen == []


async def test_a_decode_pod_of_the_pool_is_not_a_prefill_target(kube, start):
    """The picker names only prefill pods; a decode pod's target port is its own sidecar (a loop)."""
    decode_pod = make_pod("decode-a", "127.0.0.5", labels={**SELECTOR, "llm-d.ai/role": "decode"})
    pd = await start(wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-a", "127.0.0.2"), decode_pod)
    await until_async(lambda: pd.allowed(f"127.0.0.2:{pd.port}"), "the prefill pod allowed")
    assert await pd.ask(f"127.0.0.5:{pd.port}") == 403


async def test_an_address_not_in_the_pool_is_refused_with_403(kube, start):
    pd = await start(wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-a", "127.0.0.2"))
    await until_async(lambda: pd.allowed(f"127.0.0.2:{pd.port}"), "the pool's pod allowed")
    for target in (f"127.0.0.9:{pd.port}", f"127.0.0.2:{pd.port + 1}", "169.254.169.254:80"):
        async with pd.http.post(f"{pd.url}/v1/chat/completions", json=BODY, headers={HEADER: target}) as r:
            assert r.status == 403, target
            assert (await r.json())["error"]["code"] == "not_allowed"
    assert pd.metric("pd_sidecar_requests_total", route="refused", reason="not_allowed") == 3


async def test_a_deleted_pool_refuses_its_pods(kube, start):
    pd = await start(wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-a", "127.0.0.2"))
    await until_async(lambda: pd.allowed(f"127.0.0.2:{pd.port}"), "the pool's pod allowed")
    kube.delete(POOLS, POOL)
    await until_async(lambda: not pd.sidecar.allowlist.current, "the allowlist emptied")
    assert await pd.ask(f"127.0.0.2:{pd.port}") == 403


async def test_entries_past_the_cap_are_refused_and_counted(kube, start):
    pd = await start(cap=2, wait_sync=False)
    seed(kube, pd.port, *(prefill_pod(f"prefill-{c}", f"127.0.0.{i}") for i, c in enumerate("abc", 2)))
    await until_async(lambda: pd.metric("pd_sidecar_allowlist_over_cap") == 1, "one entry over the cap")
    # kept by pod name: prefill-a and prefill-b; prefill-c is refused
    assert pd.sidecar.allowlist.current == {f"127.0.0.2:{pd.port}", f"127.0.0.3:{pd.port}"}
    assert await pd.ask(f"127.0.0.4:{pd.port}") == 403


# ---------------------------------------------------------------------------------------------- static + pool, failures


async def test_the_static_list_still_works_and_unites_with_the_pool(kube, start):
    pd = await start(static=frozenset({"127.0.0.1:1"}), wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-a", "127.0.0.2"))
    await until_async(lambda: pd.allowed(f"127.0.0.2:{pd.port}"), "the pool's pod allowed")
    assert pd.sidecar.allowlist.current == {"127.0.0.1:1", f"127.0.0.2:{pd.port}"}
    kube.delete(PODS, "prefill-a")
    await until_async(lambda: pd.sidecar.allowlist.current == {"127.0.0.1:1"}, "only the static entry left")
    # the static entry is allowed: nothing listens there, so the prefill leg fails and the decode worker
    # prefills locally (200), where a refused one is a 403
    assert await pd.ask("127.0.0.1:1") == 200
    assert pd.metric("pd_sidecar_allowed_prefillers", source="static") == 1


async def test_a_watch_error_keeps_the_last_list(kube, start):
    pd = await start(wait_sync=False)
    seed(kube, pd.port, prefill_pod("prefill-a", "127.0.0.2"))
    worker = await pd.prefill_at("127.0.0.2")
    await until_async(lambda: pd.allowed(worker.address), "the pool's pod allowed")
    before = pd.sidecar.allowlist.current
    kube.fail_next(4, 500, PODS)  # the re-watch and the re-lists after it fail
    kube.fail_next(4, 500, POOLS)
    kube.expire_watches()
    await until_async(lambda: pd.metric("pd_sidecar_allowlist_watch_errors_total", resource="pod") >= 4
                      and pd.metric("pd_sidecar_allowlist_watch_errors_total", resource="inferencepool") >= 4,
                      "the failures counted")
    assert pd.sidecar.allowlist.current == before
    assert await pd.ask(worker.address) == 200  # served from the last known list while the API failed
    # and once the API answers again, changes are followed again
    kube.put(PODS, prefill_pod("prefill-b", "127.0.0.3"))
    await until_async(lambda: pd.allowed(f"127.0.0.3:{pd.port}"), "the watch recovered")


async def test_health_is_unready_until_the_pool_is_listed(kube, start):
    seed(kube, 8000, prefill_pod("prefill-a", "127.0.0.2"))
    release = kube.hold_lists(PODS)
    pd = await start(wait_sync=False)
    await until_async(lambda: len(kube.lists(PODS)) == 1, "the pod list request")
    async with pd.http.get(f"{pd.url}/health") as r:
        assert r.status == 503
    release.set()
    await until_async(lambda: pd.sidecar.allowlist.synced, "the first sync")
    async with pd.http.get(f"{pd.url}/health") as r:
        assert r.status == 200
