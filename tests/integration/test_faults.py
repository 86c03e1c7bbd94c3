"""Faults on a real gateway: real Envoy, the picker, a mock renderer and two mock TensorRT-LLM worker processes.

Each test injects one fault and checks the same four things: the requests that can succeed do, the ones that
cannot get a clear status, the picker's in-flight gauges return to zero, and the KV index agrees with each
worker's own view of its cache (`GET /mock/cache`). Tests run in order on one stack and leave it healthy.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest

from epp_extproc.config import RenderPolicy
from tests.gateway_client import Reply, request
from tests.stack import GatewayStack, MockProc
from tests.waiting import until

SYSTEMS = [f"System prompt {k} for the fault tests: answer briefly and cite sources. " * 10 for k in range(4)]
RENDER_TIMEOUT_MS = 500
PROBE_MS = 100


def user(text: str, system: int | None = None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEMS[system]}] if system is not None else []
    return [*msgs, {"role": "user", "content": text}]


def endpoint(stack: GatewayStack, mock: MockProc) -> dict[str, Any]:
    eps = stack.picker_get("/debug/endpoints")["endpoints"]
    return next(e for e in eps if e["address"] == mock.address)


def settle(stack: GatewayStack) -> None:
    """The post-fault invariants: nothing booked, no stream open, gauges at zero, index == caches."""
    stack.wait_idle()
    assert stack.app is not None
    assert stack.app.load.total_inflight() == 0
    assert stack.picker_metric("epp_inflight_requests") == 0
    assert stack.picker_metric("epp_endpoint_inflight_requests") == 0
    stack.wait_index_matches()


def send_many(stack: GatewayStack, n: int, tag: str, concurrency: int = 4) -> list[Reply]:
    def one(i: int) -> Reply:
        return stack.chat(user(f"{tag} request {i}", system=i % len(SYSTEMS)))

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


def served_by(replies: list[Reply]) -> Counter[tuple[int, str]]:
    return Counter((r.status, r.headers.get("x-trtllm-mock-worker", "-")) for r in replies)


def open_raw(stack: GatewayStack, body: dict[str, Any]) -> socket.socket:
    """Send one request on a raw socket and leave it open (the caller disconnects when it wants)."""
    raw = json.dumps(body).encode()
    port = int(stack.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


def inference_counts(stack: GatewayStack) -> list[int]:
    return [m.get("/mock/stats")["inference_requests"] for m in stack.mocks]


@pytest.fixture(scope="module")
def stack():  # noqa: ANN201
    # heartbeats every second: a drop that a heartbeat consumed shows as a gap at the next one, not 5 s later
    s = GatewayStack(workers=2, worker_args=["--decode-ms-per-token", "2", "--heartbeat-interval", "1"],
                     picker={"prediction_ttl_s": 0.0, "endpoint_probe_interval_ms": PROBE_MS,
                             "tokenization_timeout_ms": RENDER_TIMEOUT_MS}).start()
    yield s
    s.stop()


def test_baseline_traffic_succeeds_and_the_index_matches_both_caches(stack: GatewayStack) -> None:
    replies = send_many(stack, 12, "baseline")
    assert [r.status for r in replies] == [200] * 12
    settle(stack)
    assert all(stack.app.kv.index.blocks_indexed(m.address) > 0 for m in stack.mocks)  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------ renderer
def test_renderer_killed_under_traffic_every_request_still_succeeds(stack: GatewayStack) -> None:
    unavailable = stack.picker_metric("epp_render_requests_total", 'outcome="unavailable"')
    results: list[Reply] = []
    t = threading.Thread(target=lambda: results.extend(send_many(stack, 16, "renderer-kill", concurrency=2)))
    t.start()
    time.sleep(0.05)
    stack.renderer.stop(signal.SIGKILL)
    t.join()
    after = send_many(stack, 4, "renderer-dead")
    assert [r.status for r in results + after] == [200] * 20
    assert stack.picker_metric("epp_render_requests_total", 'outcome="unavailable"') >= unavailable + 4
    settle(stack)


def wait_renderer_circuit_closed(stack: GatewayStack, timeout_s: float = 20.0) -> None:
    """Send requests until one probes the renderer's circuit closed (it opened while the renderer was dead)."""
    deadline = time.monotonic() + timeout_s
    while stack.picker_metric("epp_render_circuit_state") != 0:
        assert time.monotonic() < deadline, "the renderer circuit did not close"
        assert stack.chat(user("probing the renderer circuit")).status == 200  # routed by load meanwhile
        time.sleep(0.2)


def test_restarted_renderer_brings_kv_routing_back(stack: GatewayStack) -> None:
    stack.renderer.stop(signal.SIGKILL)  # dead already after the test above; killed here when run on its own
    stack.renderer.start()
    # the dead renderer opened the circuit: KV routing returns once the next probe after the open time succeeds
    wait_renderer_circuit_closed(stack)
    ok = stack.picker_metric("epp_render_requests_total", 'outcome="ok"')
    fresh = [{"role": "system", "content": "A prefix nobody has sent before the renderer restart. " * 10},
             {"role": "user", "content": "q"}]
    first = stack.chat(fresh).headers["x-trtllm-mock-worker"]
    settle(stack)  # its blocks are indexed
    workers = {stack.chat(fresh).headers["x-trtllm-mock-worker"] for _ in range(3)}
    assert stack.picker_metric("epp_render_requests_total", 'outcome="ok"') == ok + 4
    assert workers == {first}  # routed by the index again
    settle(stack)


def test_stalled_renderer_times_out_and_the_request_is_routed_by_load(stack: GatewayStack) -> None:
    timeouts = stack.picker_metric("epp_render_requests_total", 'outcome="timeout"')
    assert stack.renderer.proc is not None
    stack.renderer.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        r = stack.chat(user("the renderer is frozen"))
        took = time.monotonic() - started
    finally:
        stack.renderer.proc.send_signal(signal.SIGCONT)
    assert r.status == 200
    assert took >= RENDER_TIMEOUT_MS / 1000
    assert stack.picker_metric("epp_render_requests_total", 'outcome="timeout"') == timeouts + 1
    settle(stack)


def test_stalled_renderer_with_fail_policy_is_504_naming_the_tokenizer(stack: GatewayStack) -> None:
    assert stack.app is not None and stack.renderer.proc is not None
    planner = stack.app.director.planner  # the render plan holds its own section of the settings
    kept = planner.settings
    planner.settings = replace(kept, render_failure_policy=RenderPolicy.FAIL)
    before = inference_counts(stack)
    stack.renderer.proc.send_signal(signal.SIGSTOP)
    try:
        r = stack.chat(user("the renderer is frozen and the policy is fail"))
    finally:
        stack.renderer.proc.send_signal(signal.SIGCONT)
        planner.settings = kept
    assert r.status == 504
    assert r.error_message().startswith("tokenizer: no answer from")
    assert inference_counts(stack) == before
    settle(stack)


# ------------------------------------------------------------------------------------------ workers
def test_killed_worker_is_out_of_rotation_and_its_index_entries_dropped(stack: GatewayStack) -> None:
    assert stack.app is not None and stack.app.kv is not None
    victim, survivor = stack.mocks
    assert stack.app.kv.index.blocks_indexed(victim.address) > 0
    victim.stop(signal.SIGKILL)
    until(lambda: not endpoint(stack, victim)["healthy"], "the picker notices the dead worker")
    assert stack.app.kv.index.blocks_indexed(victim.address) == 0
    picks = stack.picker_metric("epp_picks_total", f'endpoint="{victim.address}"')
    # including prefixes only the dead worker had cached
    replies = send_many(stack, 12, "worker-0 is dead")
    assert served_by(replies) == Counter({(200, survivor.name): 12})
    assert stack.picker_metric("epp_picks_total", f'endpoint="{victim.address}"') == picks
    stack.wait_idle()
    assert stack.index_mismatches(survivor) == []


def test_restarted_worker_is_back_in_rotation_with_an_index_matching_its_new_cache(stack: GatewayStack) -> None:
    victim = stack.mocks[0]
    if victim.alive():  # run on its own (not after the kill test above): kill it here
        victim.stop(signal.SIGKILL)
        until(lambda: not endpoint(stack, victim)["healthy"], "the picker notices the dead worker")
    victim.start()
    until(lambda: endpoint(stack, victim)["healthy"], "the restarted worker is probed healthy")
    # concurrent long-ish requests: the least-loaded rule spreads them over both workers
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: stack.chat(user(f"rotation {i} " * 30), max_tokens=100), range(4)))
    assert {r.status for r in replies} == {200}
    assert {r.headers["x-trtllm-mock-worker"] for r in replies} == {m.name for m in stack.mocks}
    settle(stack)


# ------------------------------------------------------------------------------------------ KV events
def kv_stats(stack: GatewayStack, mock: MockProc) -> dict[str, Any]:
    return stack.kv_snapshot()["workers"][mock.address]


def wait_in_sync(stack: GatewayStack) -> None:
    """Until each subscriber has applied the last batch its worker published (so a drop is a mid-stream gap)."""
    def synced(m: MockProc) -> bool:
        return kv_stats(stack, m)["last_seq"] == m.get("/mock/stats")["kv_events"]["next_seq"] - 1
    until(lambda: all(synced(m) for m in stack.mocks), "subscribers in sync (a heartbeat at least)")


def test_dropped_kv_batch_is_detected_as_a_gap_and_healed_by_replay(stack: GatewayStack) -> None:
    wait_in_sync(stack)
    before = {m.address: kv_stats(stack, m) for m in stack.mocks}
    for m in stack.mocks:
        m.post("/mock/faults/drop-next-batch")
    # distinct new prefixes: each worker's next BlockStored batch is the one that is dropped
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: stack.chat(user(f"dropped batch {i} " * 40), max_tokens=100),
                                range(4)))
    assert {r.status for r in replies} == {200}
    # each worker's drop is taken by its next batch: a request's, or else its next heartbeat
    until(lambda: all(m.get("/mock/stats")["kv_events"]["batches_dropped"] > 0 for m in stack.mocks),
          "both workers dropped a batch")
    dropped = stack.mocks

    def recovered(m: MockProc) -> bool:
        # a gap and the replay that fills it; on a worker whose restart (an earlier test's) the picker was still
        # warming up from, with no history applied yet, the warm-up's replay fills it instead, with no gap
        return kv_stats(stack, m)["replays"] > before[m.address]["replays"]

    until(lambda: all(recovered(m) for m in dropped),
          lambda: "the subscribers see the drops and replay them: "
                  + "; ".join(f"{m.address}: before {before[m.address]} now {kv_stats(stack, m)} "
                              f"mock {m.get('/mock/stats')['kv_events']}" for m in dropped),
          timeout=15.0)
    assert sum(kv_stats(stack, m)["gaps"] - before[m.address]["gaps"] for m in dropped) >= 1
    for m in dropped:
        assert kv_stats(stack, m)["replay_lost"] == before[m.address]["replay_lost"]
    settle(stack)  # the dropped batches' blocks are in the index: replay healed them


def test_restarted_publisher_clears_the_worker_and_the_index_follows(stack: GatewayStack) -> None:
    m = stack.mocks[1]
    restarts = kv_stats(stack, m)["restarts"]
    m.post("/mock/faults/restart-publisher")  # seq back to 0, replay buffer and cache emptied silently
    until(lambda: kv_stats(stack, m)["restarts"] > restarts, "the subscriber sees seq go back")
    assert stack.app is not None and stack.app.kv is not None
    assert stack.app.kv.index.blocks_indexed(m.address) == 0
    replies = send_many(stack, 8, "after publisher restart")
    assert {r.status for r in replies} == {200}
    settle(stack)


# ------------------------------------------------------------------------------------------ picker, Envoy
def classify(fn: Callable[[], Reply]) -> str:
    try:
        return str(fn().status)
    except OSError as e:
        return type(e).__name__


def traffic_during(stack: GatewayStack, fault: Callable[[], None], after: int = 10,
                   limit: int = 2000) -> tuple[list[str], list[str]]:
    """Two client threads send requests before, during and after `fault` (run once some traffic went
    through), until `after` requests started after the fault returned have completed; at most `limit`,
    paced at one request per 10 ms per thread at most.
    Returns (outcomes of requests started before the fault returned, outcomes of those started after)."""
    during: list[str] = []
    later: list[str] = []
    lock = threading.Lock()
    fault_done = threading.Event()
    counter = iter(range(limit))

    def client() -> None:
        for i in counter:
            started_after = fault_done.is_set()
            o = classify(lambda i=i: stack.chat(user(f"under fault {i}", system=i % 4)))
            with lock:
                (later if started_after else during).append(o)
                if len(later) >= after:
                    return
            time.sleep(0.01)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    until(lambda: len(during) >= 5, "some traffic before the fault")
    fault()
    fault_done.set()
    for t in threads:
        t.join(60)
    assert len(later) >= after, (during, later)
    return during, later


def test_picker_restart_under_traffic_fails_only_requests_caught_in_it_and_rebuilds_the_index(
        stack: GatewayStack) -> None:
    old = stack.app
    assert old is not None
    during, later = traffic_during(stack, lambda: stack.restart_picker(down_s=0.3))
    # Envoy's failure_mode_allow=false: a request whose ext_proc stream broke is a clear 500, never routed
    assert set(during) <= {"200", "500"}, Counter(during)
    assert set(later) == {"200"}, Counter(later)
    assert old.load.total_inflight() == 0 and old.picker.open_requests == 0
    new = stack.app
    assert new is not old and new is not None and new.kv is not None
    # the new picker started empty; matching caches built before it started means it rebuilt them...
    settle(stack)
    # ...through replay (its warm-up on each worker's first message)
    snap = stack.kv_snapshot()["workers"]
    assert all(snap[m.address]["replays"] >= 1 for m in stack.mocks), snap


def test_envoy_restart_under_traffic_frees_every_picker_stream(stack: GatewayStack) -> None:
    during, later = traffic_during(stack, lambda: stack.restart_envoy(down_s=0.3))
    # requests sent while Envoy is down cannot connect (or lose their connection); nothing else may fail
    assert set(during) <= {"200", "ConnectionRefusedError", "RemoteDisconnected", "ConnectionResetError"}, \
        Counter(during)
    assert set(later) == {"200"}, Counter(later)
    settle(stack)


# ------------------------------------------------------------------------------------------ clients
def test_client_disconnect_mid_pick_frees_the_stream_and_reaches_no_worker(stack: GatewayStack) -> None:
    assert stack.app is not None and stack.renderer.proc is not None
    before = inference_counts(stack)
    stack.renderer.proc.send_signal(signal.SIGSTOP)  # the pick waits on the render call
    try:
        sock = open_raw(stack, {"model": "mock-model", "messages": user("goodbye mid-pick"), "max_tokens": 4})
        until(lambda: stack.app.picker.open_requests == 1, "the picker is deciding")  # type: ignore[union-attr]
        sock.close()
        until(lambda: stack.app.picker.open_requests == 0, "the stream is gone",  # type: ignore[union-attr]
              timeout=RENDER_TIMEOUT_MS / 1000 * 4)
    finally:
        stack.renderer.proc.send_signal(signal.SIGCONT)
    assert inference_counts(stack) == before
    settle(stack)


def test_client_disconnect_mid_stream_frees_the_booking_and_the_worker_slot(stack: GatewayStack) -> None:
    assert stack.app is not None
    body = {"model": "mock-model", "messages": user("a long streamed answer"), "max_tokens": 2000,
            "stream": True}
    sock = open_raw(stack, body)
    first = sock.recv(4096)
    assert first.startswith(b"HTTP/1.1 200")
    until(lambda: stack.app.load.total_inflight() == 1, "the streaming request is booked")  # type: ignore
    sock.close()
    until(lambda: stack.app.load.total_inflight() == 0, "the booking is freed")  # type: ignore
    until(lambda: sum(m.get("/mock/stats")["running"] for m in stack.mocks) == 0,
          "the worker stopped decoding for the departed client")
    settle(stack)


# ------------------------------------------------------------------------------------------ overload
def test_inflight_cap_answers_503_overloaded_then_recovers(stack: GatewayStack) -> None:
    assert stack.app is not None
    stack.app.picker.gate.limit = 2
    try:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda i: stack.chat(user(f"overload {i}"), max_tokens=150), range(8)))
    finally:
        stack.app.picker.gate.limit = 1024
    statuses = Counter(r.status for r in replies)
    assert set(statuses) == {200, 503} and statuses[200] >= 2, statuses
    assert {r.error_message() for r in replies if r.status == 503} == {"endpoint picker overloaded"}
    stack.wait_idle()
    assert send_many(stack, 4, "after overload")[0].status == 200
    settle(stack)



# ------------------------------------------------------------------------------------------ no replay
@pytest.fixture(scope="module")
def lone() -> Any:
    """One worker whose replay endpoint the picker is not told: a gap can only be answered by a clear."""
    s = GatewayStack(workers=1, replay=False, picker={"prediction_ttl_s": 0.0}).start()
    yield s
    s.stop()


def test_dropped_kv_batch_without_replay_clears_the_worker_and_indexes_only_what_it_holds(
        lone: GatewayStack) -> None:
    m = lone.mocks[0]
    assert lone.chat(user("before the drop " * 30)).status == 200
    settle(lone)
    wait_in_sync(lone)
    before = kv_stats(lone, m)
    m.post("/mock/faults/drop-next-batch")
    lost = [{"role": "user", "content": "the batch of this prompt is lost " * 30}]
    assert lone.chat(lost).status == 200
    fresh = [{"role": "user", "content": "a new prefix after the gap " * 30}]
    assert lone.chat(fresh).status == 200
    until(lambda: kv_stats(lone, m)["gaps"] == before["gaps"] + 1, "the gap is seen")
    lone.wait_idle()
    st = kv_stats(lone, m)
    assert st["clears"] == before["clears"] + 1 and st["replays"] == before["replays"] == 0
    assert lone.app is not None and lone.app.kv is not None
    held = {b["engine_hash"] for b in m.get("/mock/cache")["blocks"]}
    until(lambda: lone.app.kv.index.blocks_indexed(m.address) > 0,  # type: ignore[union-attr]
          "the batch after the gap is applied")
    assert lone.app.kv.index.engine_hashes(m.address) < held  # a strict subset: never a block it lacks
    # the prefix that arrived after the gap is indexed in full, so routing by it works again
    score = request(f"http://127.0.0.1:{lone.app.admin_port}", path="/debug/score",
                    body=json.dumps({"model": "mock-model", "messages": fresh}).encode()).json()
    assert score["workers"][0]["overlap_blocks"] == (score["prompt_tokens"] - 1) // 32 > 0


# ------------------------------------------------------------------------------------------ the prober
def test_registry_routes_over_every_endpoint_when_none_is_healthy() -> None:
    from epp_extproc.core.endpoints import Endpoint, EndpointRegistry

    reg = EndpointRegistry()
    reg.replace([Endpoint("a", "127.0.0.1:1"), Endpoint("b", "127.0.0.1:2")])
    reg.set_healthy("127.0.0.1:1", False)
    assert [e.name for e in reg.routable()] == ["b"]
    reg.set_healthy("127.0.0.1:2", False)
    assert [e.name for e in reg.routable()] == ["a", "b"]  # panic mode, never an empty pool


async def test_prober_takes_an_unanswering_endpoint_out_after_two_failed_probes_not_one() -> None:
    import asyncio

    from epp_extproc.adapters.endpoint_probe import EndpointProber
    from epp_extproc.core.endpoints import Endpoint, EndpointRegistry

    silent = socket.socket()  # listens (connections complete in the kernel) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    reg = EndpointRegistry()
    reg.replace([Endpoint("slow", address)])
    lost: list[str] = []
    prober = EndpointProber(reg, interval_s=0.1, timeout_s=0.1, on_lost=lost.append)
    # the health after each verdict, recorded as it is given: two probes can fail a few ms apart, faster
    # than any polling loop can look between them
    seen: list[tuple[int, bool]] = []
    judge = prober._verdict

    def recording(addr: str, ok: bool, refused: bool, why: str) -> None:
        judge(addr, ok, refused, why)
        seen.append((prober._failures.get(addr, 0), reg.healthy(addr)))

    prober._verdict = recording  # type: ignore[method-assign]
    task = asyncio.create_task(prober.run())
    try:
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        assert seen[:2] == [(1, True), (2, False)]
        assert lost == []  # not refused: its cache may be intact, so the KV index keeps it
    finally:
        task.cancel()
        silent.close()
