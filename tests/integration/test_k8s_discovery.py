"""InferencePool discovery against a fake apiserver that speaks the real list/watch JSON (tests/fake_k8s.py).

Waits are for conditions (bounded by a generous cap so a bug fails instead of hanging), never for time.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from epp_extproc.adapters import discovery_k8s as dk
from epp_extproc.adapters.discovery_k8s import (
    KV_STORAGE_EVENTS_ANNOTATION,
    InferencePoolDiscovery,
    default_namespace,
    pod_endpoints,
    pod_is_serving,
    selector_string,
)
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.logs import Throttled
from kvindex.backoff import backoff_delay
from tests.fake_k8s import PODS, POOLS, FakeKube, make_pod, make_pool
from tests.waiting import until_async

pytestmark = pytest.mark.timeout(20)


@dataclass
class Running:
    kube: FakeKube
    registry: EndpointRegistry
    discovery: InferencePoolDiscovery
    task: asyncio.Task[None]
    delays: list[float] = field(default_factory=list)
    changes: list[tuple[list[Endpoint], list[Endpoint]]] = field(default_factory=list)

    def names(self) -> list[str]:
        return sorted(e.name for e in self.registry.all())

    async def wait_names(self, *names: str) -> None:
        want = sorted(names)
        await until_async(lambda: self.registry.synced and self.names() == want, f"endpoints {want}")


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as k:
        yield k


@pytest.fixture
async def start(kube: FakeKube) -> AsyncIterator[Callable[..., Awaitable[Running]]]:
    running: list[Running] = []

    async def _start(**kw: Any) -> Running:
        registry = EndpointRegistry()
        delays: list[float] = []

        async def record_sleep(d: float) -> None:  # backoff without waiting: tests assert the delays
            delays.append(d)
            await asyncio.sleep(0)

        kw.setdefault("sleep", record_sleep)
        kw.setdefault("rng", random.Random(7))
        disc = InferencePoolDiscovery(registry, "llm-pool", "default", api_client_factory=kube.api_client,
                                      watch_timeout_s=60, backoff_initial_s=0.1, backoff_max_s=1.0, **kw)
        r = Running(kube, registry, disc, asyncio.create_task(disc.run()), delays)
        registry.subscribe(lambda added, removed: r.changes.append((added, removed)))
        running.append(r)
        return r

    yield _start
    for r in running:
        r.task.cancel()
        try:
            await r.task
        except asyncio.CancelledError:
            pass
        await r.discovery.close()


def seed(kube: FakeKube, *pods: dict[str, Any], pool: dict[str, Any] | None = None) -> None:
    kube.put(POOLS, pool or make_pool())
    for p in pods:
        kube.put(PODS, p)


# ---------------------------------------------------------------------------------------------- sync


async def test_initial_sync_publishes_ready_pods_with_addresses_and_kv_endpoints(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"), make_pod("w1", "10.0.0.2"))
    r = await start()
    await r.wait_names("w0", "w1")
    ep = r.registry.get("10.0.0.1:8000")
    assert ep is not None and ep.name == "w0"
    assert ep.kv_events == "tcp://10.0.0.1:5557"
    assert ep.replay is None
    assert ("app", "llm") in ep.labels


async def test_replay_endpoint_is_set_when_a_replay_port_is_configured(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start(kv_event_port=6000, replay_port=6001)
    await r.wait_names("w0")
    ep = r.registry.get("10.0.0.1:8000")
    assert ep is not None and (ep.kv_events, ep.replay) == ("tcp://10.0.0.1:6000", "tcp://10.0.0.1:6001")


async def test_ipv6_pod_addresses_are_bracketed(kube, start):
    seed(kube, make_pod("w0", "fd00::5"))
    r = await start()
    await r.wait_names("w0")
    ep = r.registry.all()[0]
    assert (ep.address, ep.kv_events) == ("[fd00::5]:8000", "tcp://[fd00::5]:5557")


async def test_pods_outside_the_selector_are_not_endpoints(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"), make_pod("other", "10.0.0.9", labels={"app": "web"}))
    r = await start()
    await r.wait_names("w0")
    assert kube.lists(PODS)[0].query["labelSelector"] == "app=llm"


async def test_readiness_stays_false_until_the_pods_are_listed(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    release = kube.hold_lists(PODS)
    r = await start()
    await until_async(lambda: len(kube.lists(PODS)) == 1, "the pod list request")
    assert r.registry.synced is False
    release.set()
    await r.wait_names("w0")


async def test_a_missing_pool_syncs_to_no_endpoints(kube, start):
    r = await start()
    await until_async(lambda: r.registry.synced, "first sync")
    assert r.names() == []
    assert kube.lists(PODS) == []


async def test_two_target_ports_make_two_endpoints_per_pod(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"), pool=make_pool(ports=(8000, 8001)))
    r = await start()
    await r.wait_names("w0:8000", "w0:8001")
    assert sorted(e.address for e in r.registry.all()) == ["10.0.0.1:8000", "10.0.0.1:8001"]


async def test_pod_without_ip_is_ignored(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"), make_pod("pending", None))
    r = await start()
    await r.wait_names("w0")


async def test_not_ready_pod_at_start_is_ignored(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"), make_pod("w1", "10.0.0.2", ready=False))
    r = await start()
    await r.wait_names("w0")


# ---------------------------------------------------------------------------------------------- changes


async def test_new_ready_pod_is_added(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    kube.put(PODS, make_pod("w1", "10.0.0.2"))
    await r.wait_names("w0", "w1")


async def test_pod_becoming_not_ready_is_removed(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"), make_pod("w1", "10.0.0.2"))
    r = await start()
    await r.wait_names("w0", "w1")
    kube.put(PODS, make_pod("w1", "10.0.0.2", ready=False))
    await r.wait_names("w0")


async def test_pod_becoming_ready_is_added(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1", ready=False))
    r = await start()
    await until_async(lambda: r.registry.synced, "first sync")
    kube.put(PODS, make_pod("w0", "10.0.0.1"))
    await r.wait_names("w0")


async def test_terminating_pod_is_removed(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"), make_pod("w1", "10.0.0.2"))
    r = await start()
    await r.wait_names("w0", "w1")
    kube.put(PODS, make_pod("w1", "10.0.0.2", terminating=True))
    await r.wait_names("w0")


async def test_deleted_pod_is_removed(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"), make_pod("w1", "10.0.0.2"))
    r = await start()
    await r.wait_names("w0", "w1")
    kube.delete(PODS, "w0")
    await r.wait_names("w1")
    assert [e.name for e in r.changes[-1][1]] == ["w0"]


async def test_relabelled_pod_leaves_the_pool(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"), make_pod("w1", "10.0.0.2"))
    r = await start()
    await r.wait_names("w0", "w1")
    kube.put(PODS, make_pod("w1", "10.0.0.2", labels={"app": "drained"}))
    await r.wait_names("w0")


async def test_pod_ip_change_replaces_its_endpoint(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    kube.put(PODS, make_pod("w0", "10.0.0.7"))
    await until_async(lambda: "10.0.0.7:8000" in r.registry and len(r.registry) == 1, "new address")


def annotated(pod: dict[str, Any], **annotations: str) -> dict[str, Any]:
    pod["metadata"]["annotations"] = dict(annotations)
    return pod


async def test_the_storage_events_annotation_names_the_pods_llm_d_storage_stream(kube, start):
    # issue 44: llm-d's file-system connector publishes on its own PUB socket; the annotation is the only way
    # Kubernetes discovery can name it (the endpoints file's `kv_storage_events`, --endpoints' `storage=`)
    seed(kube, annotated(make_pod("w0", "10.0.0.1"), **{KV_STORAGE_EVENTS_ANNOTATION: "5559"}),
         make_pod("w1", "10.0.0.2"))
    r = await start()
    await r.wait_names("w0", "w1")
    w0, w1 = r.registry.get("10.0.0.1:8000"), r.registry.get("10.0.0.2:8000")
    assert w0 is not None and w0.kv_storage_events == "tcp://10.0.0.1:5559"
    assert w0.kv_events == "tcp://10.0.0.1:5557"  # the GPU stream is unchanged beside it
    assert w1 is not None and w1.kv_storage_events is None


async def test_annotating_a_running_pod_adds_its_storage_stream(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    kube.patch(PODS, "w0", lambda p: annotated(p, **{KV_STORAGE_EVENTS_ANNOTATION: "tcp://*:5560"}))
    await until_async(lambda: (ep := r.registry.get("10.0.0.1:8000")) is not None
                      and ep.kv_storage_events == "tcp://10.0.0.1:5560", "the storage stream")
    assert r.changes[-1][1][0].kv_storage_events is None  # replaced, so KV routing re-subscribes the worker


@pytest.mark.parametrize(("value", "ip", "want"), [
    ("5559", "10.0.0.5", "tcp://10.0.0.5:5559"),
    (" 5559\n", "10.0.0.5", "tcp://10.0.0.5:5559"),  # a YAML block scalar's newline
    ("5559", "fd00::5", "tcp://[fd00::5]:5559"),
    ("tcp://10.0.0.9:5559", "10.0.0.5", "tcp://10.0.0.9:5559"),
    ("tcp://[fd00::9]:5559", "fd00::5", "tcp://[fd00::9]:5559"),
    ("tcp://*:5559", "10.0.0.5", "tcp://10.0.0.5:5559"),  # the connector's own bind address, copied
    ("tcp://0.0.0.0:5559", "10.0.0.5", "tcp://10.0.0.5:5559"),
    ("tcp://[::]:5559", "fd00::5", "tcp://[fd00::5]:5559"),
])
def test_the_storage_events_annotation_is_a_port_or_a_tcp_endpoint(value, ip, want):
    [ep] = pod_endpoints(annotated(make_pod("w0", ip), **{KV_STORAGE_EVENTS_ANNOTATION: value}), (8000,), 5557,
                         None)
    assert ep.kv_storage_events == want


@pytest.mark.parametrize("bad", ["", "abc", "0", "65536", "+5559", "٥٥٥٩", "tcp://", "tcp://10.0.0.9",
                                 "tcp://worker-0.svc:5559", "tcp://10.0.0.9:0", "tcp://*:x", "ipc:///tmp/kv",
                                 "udp://10.0.0.9:5559", "tcp://224.0.0.1:5559", "x" * 5000])
def test_a_bad_storage_events_annotation_is_ignored_with_one_warning_naming_the_pod(bad, monkeypatch, caplog):
    monkeypatch.setattr(dk, "_throttled", Throttled(dk.log))
    pod = annotated(make_pod("w-bad", "10.0.0.5"), **{KV_STORAGE_EVENTS_ANNOTATION: bad})
    with caplog.at_level("WARNING", logger=dk.log.name):
        for _ in range(3):  # every status update of the pod recomputes its endpoints
            [ep] = pod_endpoints(pod, (8000,), 5557, None)
            assert ep.kv_storage_events is None and ep.address == "10.0.0.5:8000"  # still routed to
    warnings = [r.getMessage() for r in caplog.records if KV_STORAGE_EVENTS_ANNOTATION in r.getMessage()]
    assert len(warnings) == 1 and "w-bad" in warnings[0]


def test_a_storage_events_annotation_that_is_not_a_string_is_ignored(monkeypatch):
    monkeypatch.setattr(dk, "_throttled", Throttled(dk.log))
    pod = make_pod("w0", "10.0.0.5")
    pod["metadata"]["annotations"] = {KV_STORAGE_EVENTS_ANNOTATION: 5559}  # the API sends strings; a fake may not
    [ep] = pod_endpoints(pod, (8000,), 5557, None)
    assert ep.kv_storage_events is None


# ---------------------------------------------------------------------------------------------- the pool


async def test_pool_selector_edit_switches_to_the_newly_selected_pods(kube, start):
    seed(kube, make_pod("a0", "10.0.0.1", labels={"app": "a"}), make_pod("b0", "10.0.0.2", labels={"app": "b"}),
         pool=make_pool(match_labels={"app": "a"}))
    r = await start()
    await r.wait_names("a0")
    kube.put(POOLS, make_pool(match_labels={"app": "b"}))
    await r.wait_names("b0")
    assert kube.lists(PODS)[-1].query["labelSelector"] == "app=b"


async def test_after_a_selector_edit_events_for_the_old_selection_are_ignored(kube, start):
    seed(kube, make_pod("a0", "10.0.0.1", labels={"app": "a"}), make_pod("b0", "10.0.0.2", labels={"app": "b"}),
         pool=make_pool(match_labels={"app": "a"}))
    r = await start()
    await r.wait_names("a0")
    kube.put(POOLS, make_pool(match_labels={"app": "b"}))
    await r.wait_names("b0")
    kube.put(PODS, make_pod("a1", "10.0.0.3", labels={"app": "a"}))
    kube.put(PODS, make_pod("b1", "10.0.0.4", labels={"app": "b"}))
    await r.wait_names("b0", "b1")


async def test_pool_target_port_edit_readdresses_the_endpoints(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    kube.put(POOLS, make_pool(ports=(9000,)))
    await until_async(lambda: [e.address for e in r.registry.all()] == ["10.0.0.1:9000"], "port 9000")


async def test_a_pod_event_recomputes_only_that_pods_endpoints(kube, start, monkeypatch):
    """A publish per pod event must not re-derive every pod's endpoints (O(pods) IP parsing per event on the
    loop: 8 ms per event at 1,000 pods before); the set published is still the whole pool."""
    seed(kube, *(make_pod(f"w{i:02d}", f"10.0.0.{i + 1}") for i in range(40)))
    r = await start()
    await until_async(lambda: r.registry.synced and len(r.registry) == 40, "40 endpoints")
    calls: list[str] = []
    real = dk.pod_endpoints
    monkeypatch.setattr(dk, "pod_endpoints", lambda pod, *a, **kw: calls.append(pod["metadata"]["name"])
                        or real(pod, *a, **kw))
    kube.put(PODS, make_pod("w40", "10.0.0.99"))
    await until_async(lambda: len(r.registry) == 41, "the new pod published")
    assert calls == ["w40"]


async def test_pool_deletion_empties_the_endpoint_set(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    kube.delete(POOLS, "llm-pool")
    await until_async(lambda: len(r.registry) == 0, "no endpoints")
    assert r.registry.synced is True


async def test_pool_recreated_after_deletion_brings_the_pods_back(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    kube.delete(POOLS, "llm-pool")
    await until_async(lambda: len(r.registry) == 0, "no endpoints")
    kube.put(POOLS, make_pool())
    await r.wait_names("w0")


async def test_other_pools_in_the_namespace_are_ignored(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    kube.put(POOLS, make_pool(name="someone-elses", match_labels={"app": "x"}))
    kube.put(PODS, make_pod("w1", "10.0.0.2"))  # an event after the foreign pool's, to know it was seen
    await r.wait_names("w0", "w1")
    assert kube.lists(POOLS)[0].query["fieldSelector"] == "metadata.name=llm-pool"


# ---------------------------------------------------------------------------------------------- watch protocol


async def test_watch_resumes_from_the_list_resource_version_with_bookmarks_allowed(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    list_rv = str(kube.rv)
    r = await start()
    await r.wait_names("w0")
    await until_async(lambda: kube.watches(PODS), "pod watch")
    q = kube.watches(PODS)[0].query
    assert (q["resourceVersion"], q["allowWatchBookmarks"].lower()) == (list_rv, "true")


async def test_expired_watch_is_reopened_from_the_last_seen_version_without_relisting(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    kube.put(PODS, make_pod("w1", "10.0.0.2"))
    await r.wait_names("w0", "w1")
    last_rv = str(kube.rv)
    kube.expire_watches()
    await until_async(lambda: len(kube.watches(PODS)) == 2, "second pod watch")
    assert kube.watches(PODS)[1].query["resourceVersion"] == last_rv
    assert len(kube.lists(PODS)) == 1


async def test_bookmark_advances_the_resume_version(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    await until_async(lambda: kube.open_watches(PODS) == 1, "open pod watch")
    rv = kube.bookmark()
    kube.put(POOLS, make_pool())  # pool event after the bookmark: once seen, the bookmark was consumed
    await until_async(lambda: len(kube.watches(POOLS)) == 1 and r.discovery._pool is not None
                      and r.discovery._pool["metadata"]["resourceVersion"] == str(kube.rv), "pool event")
    kube.expire_watches()
    await until_async(lambda: len(kube.watches(PODS)) == 2, "second pod watch")
    assert kube.watches(PODS)[1].query["resourceVersion"] == str(rv)
    assert r.names() == ["w0"]


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_gone_relists_without_losing_or_duplicating_endpoints(kube, start, gone_as_http):
    kube.gone_as_http = gone_as_http
    seed(kube, make_pod("w0", "10.0.0.1"), make_pod("w1", "10.0.0.2"))
    r = await start()
    await r.wait_names("w0", "w1")
    await until_async(lambda: kube.open_watches(PODS) == 1, "open pod watch")
    kube.deliver = False  # the watch stalls: these changes never reach it
    kube.delete(PODS, "w0")
    kube.put(PODS, make_pod("w2", "10.0.0.3"))
    kube.put(PODS, make_pod("w1", "10.0.0.2"))  # unchanged content, new resourceVersion
    kube.compact()
    kube.deliver = True
    kube.expire_watches()
    await r.wait_names("w1", "w2")
    assert len(kube.lists(PODS)) == 2
    assert len(r.registry) == 2


async def test_api_errors_back_off_exponentially_then_recover(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    kube.fail_next(3, 500, PODS)
    r = await start()
    await r.wait_names("w0")
    assert len(r.delays) == 3
    for attempt, d in enumerate(r.delays):
        nominal = 0.1 * 2**attempt
        assert nominal / 2 <= d <= nominal


async def test_forbidden_pool_access_is_retried_not_fatal(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    kube.fail_next(2, 403, POOLS)
    r = await start()
    await r.wait_names("w0")
    assert len(r.delays) == 2
    assert not r.task.done()


async def test_watch_error_after_sync_keeps_the_published_set_and_relists(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    kube.fail_next(1, 500, PODS)
    kube.expire_watches()  # the re-watch hits the injected 500
    await until_async(lambda: len(r.delays) == 1, "one backoff")
    assert r.names() == ["w0"]
    kube.put(PODS, make_pod("w1", "10.0.0.2"))
    await r.wait_names("w0", "w1")
    assert len(kube.lists(PODS)) == 2


async def test_backoff_resets_once_the_watch_works_again(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    kube.fail_next(2, 500, PODS)
    r = await start()
    await r.wait_names("w0")
    await until_async(lambda: kube.open_watches(PODS) == 1, "open pod watch")
    kube.fail_next(1, 500, PODS)
    kube.expire_watches()  # the window ended normally, so the next failure starts from the first delay
    await until_async(lambda: len(r.delays) == 3, "third backoff")
    assert r.delays[2] <= 0.1


async def test_failing_watches_back_off_exponentially_although_lists_succeed(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    kube.fail_next(3, 500, PODS, watches_only=True)
    r = await start()
    await r.wait_names("w0")
    await until_async(lambda: kube.open_watches(PODS) == 1, "open pod watch")
    assert len(r.delays) == 3
    for attempt, d in enumerate(r.delays):
        nominal = 0.1 * 2**attempt
        assert nominal / 2 <= d <= nominal


async def test_close_after_cancel_releases_the_client(kube, start):
    seed(kube, make_pod("w0", "10.0.0.1"))
    r = await start()
    await r.wait_names("w0")
    r.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await r.task
    await r.discovery.close()
    assert r.discovery._api is None and r.discovery._pod_task is None


async def test_kubeconfig_is_used_when_given(kube, tmp_path):
    seed(kube, make_pod("w0", "10.0.0.1"))
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
    registry = EndpointRegistry()
    disc = InferencePoolDiscovery(registry, "llm-pool", "default", kubeconfig=str(cfg))
    task = asyncio.create_task(disc.run())
    try:
        await until_async(lambda: registry.synced and len(registry) == 1, "sync through the kubeconfig")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---------------------------------------------------------------------------------------------- pure helpers


def test_backoff_is_capped():
    rng = random.Random(1)
    assert all(backoff_delay(40, 0.5, 30.0, rng.random) <= 30.0 for _ in range(100))


def test_backoff_jitter_varies_between_draws():
    rng = random.Random(1)
    assert len({backoff_delay(3, 0.5, 30.0, rng.random) for _ in range(10)}) > 1


def test_selector_string_is_sorted_key_value_pairs():
    assert selector_string({"role": "worker", "app": "llm"}) == "app=llm,role=worker"


def test_pod_with_no_ready_condition_is_not_serving():
    pod = make_pod("w0")
    pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
    assert pod_is_serving(pod) is False


def test_namespace_defaults_to_the_service_account_namespace(tmp_path):
    f = tmp_path / "namespace"
    f.write_text("inference\n")
    assert default_namespace(str(f)) == "inference"


def test_namespace_defaults_to_default_outside_a_cluster(tmp_path):
    assert default_namespace(str(tmp_path / "absent")) == "default"
