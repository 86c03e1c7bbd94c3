"""Golden decisions: a fixed script of requests and pool changes, decided under each shipped flag combination.

Recorded before the scheduler was rebuilt as plugins (issue 41) and replayed after it: every decision must be
the same and `/debug/score` the same except for fields moved on purpose (`MOVED` in the test). Each decision's
random draws are seeded (`random.seed(step)`), so `--router-temperature` replays too.

`python -m tests.golden_scheduling --record` rewrites tests/fixtures/golden/decisions.json; only do that for a
change of behaviour that is meant, and say so in the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import orjson

from epp_extproc.config import Config
from epp_extproc.core.contract import Credit, MediaItem, PromptIdentity, Role
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.errors import PickError
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.model_rewrite import ModelRewriter, RewriteRules, RewriteTable, Rule, Target
from epp_extproc.core.render import Rendered, RenderError
from epp_extproc.core.request import RequestContext
from epp_extproc.core.session import SESSION_HEADER, SessionTokens
from epp_extproc.core.time_cost import Slo
from epp_extproc.metrics import PickerMetrics
from tests.scheduling_fakes import build_decider

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "decisions.json"
BLOCK = 32
ADDRS = [f"10.0.0.{i}:8000" for i in range(1, 5)]
SESSION_KEY = bytes(range(32))


def tokens_of(text: str) -> list[int]:
    """A deterministic 'tokenizer': one token per byte of the prompt's text, so prompts that share a prefix
    share leading tokens (and so blocks)."""
    return list(text.encode())


def prompt_text(values: dict[str, Any]) -> str:
    msgs = values.get("messages")
    if isinstance(msgs, list):
        out = []
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                out.append(c)
            elif isinstance(c, list):
                out.extend(p.get("text", "<media>") for p in c if isinstance(p, dict))
        return "|".join(out)
    return str(values.get("prompt", ""))


class ScriptRenderer:
    """A renderer whose ids follow the body's text; vLLM flavour answers media spans for image parts."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.fail_next = False

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        if self.fail_next:
            self.fail_next = False
            from epp_extproc.core.render import RenderFailure
            raise RenderError(RenderFailure.TIMEOUT, "scripted")
        values = orjson.loads(body)
        ids = tokens_of(prompt_text(values))
        media = None
        if self.protocol == "vllm-render" and b"image_url" in body:
            media = (("image", MediaItem("img-digest", 4, 64)),)
            ids = ids + [0] * 64
        return Rendered(ids, media=media)


class Prompt(tuple):  # type: ignore[type-arg]
    """The prompt's chained block keys: block i's key is the tuple of every token up to its end."""

    def hashes(self, block_size: int, dialect: str | None = None) -> list[int]:
        return list(range(len(self)))


class ScriptKv:
    """A KV lookup with the index's semantics on plain sets: confirmed blocks (the workers' events) and
    predicted ones (this picker's commits); overlap = leading blocks a worker holds."""

    def __init__(self, confirmed: bool = True) -> None:
        self.confirmed: dict[str, set[tuple[Any, ...]]] = {a: set() for a in ADDRS}
        self.predicted: dict[str, set[tuple[Any, ...]]] = {a: set() for a in ADDRS}
        self.events = confirmed  # False: prediction-only (no KV events)
        self.predictions: list[tuple[str, str | None]] = []

    def prompt(self, tokens: Sequence[int], identity: PromptIdentity) -> Prompt:
        seed = (identity.salt, identity.model, tuple(m.identifier for m in identity.media))
        keys = [(seed, tuple(tokens[: (i + 1) * BLOCK])) for i in range(len(tokens) // BLOCK)]
        return Prompt(keys)

    def base_model_for(self, model: object) -> str | None:
        return "base" if model == "tenant-lora" else None

    def block_size(self, worker: str) -> int:
        return BLOCK

    def _lead(self, prompt: Prompt, held: Callable[[Any], bool]) -> int:
        n = 0
        for k in prompt:
            if not held(k):
                break
            n += 1
        return n

    def overlap(self, prompt: Prompt, workers: Sequence[str]) -> dict[str, int]:
        out = {}
        for w in workers:
            c, p = self.confirmed.get(w, set()), self.predicted.get(w, set())
            n = self._lead(prompt, lambda k, c=c, p=p: k in c or k in p)
            if n:
                out[w] = n
        return out

    def credit(self, prompt: Prompt, workers: Sequence[str]) -> dict[str, Credit]:
        total = self.overlap(prompt, workers)
        out = {}
        for w, n in total.items():
            c = self.confirmed.get(w, set())
            conf = self._lead(prompt, c.__contains__)
            out[w] = Credit(conf, n - conf)
        return out

    def held(self, worker: str) -> int:
        return 0

    def predict(self, worker: str, prompt: Prompt, booking: str | None = None) -> None:
        self.predictions.append((worker, booking))
        self.predicted.setdefault(worker, set()).update(prompt)

    def confirm_all(self) -> None:
        """The workers' events arrive: every predicted block is now stored (when events are on)."""
        if not self.events:
            return
        for w, ks in self.predicted.items():
            self.confirmed.setdefault(w, set()).update(ks)
            ks.clear()


class ScriptChurn:
    """Eviction pressure: worker 1 is full and churning, the others have room."""

    def capacity(self, worker: str) -> int | None:
        return 20 if worker == ADDRS[0] else 400

    def held(self, worker: str) -> int:
        return 20 if worker == ADDRS[0] else 10

    def removal_rate(self, worker: str) -> float:
        return 50.0 if worker == ADDRS[0] else 0.0


SYSTEM = "You are a helpful assistant. Answer briefly and cite sources when you can. " * 2


def chat(user: str, *, system: str = SYSTEM, model: str = "m", headers: dict[str, list[str]] | None = None,
         image: bool = False) -> RequestContext:
    content: Any = user
    if image:
        content = [{"type": "text", "text": user},
                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    body = orjson.dumps({"model": model, "messages": [{"role": "system", "content": system},
                                                      {"role": "user", "content": content}]})
    return RequestContext("POST", "/v1/chat/completions", headers or {}, body)


def script(n: int = 24) -> list[RequestContext]:
    """Four conversations, each re-sent with a longer history, interleaved, plus unique one-offs."""
    rng = random.Random(7)
    out = []
    history = {g: f"conversation {g}: " + "lorem ipsum dolor sit amet " * (2 + g) for g in range(4)}
    for i in range(n):
        g = rng.randrange(5)
        if g == 4:
            out.append(chat(f"a unique question {i} " * rng.randrange(1, 6)))
            continue
        history[g] += f" turn {i} " + "consectetur adipiscing " * rng.randrange(1, 4)
        out.append(chat(history[g]))
    return out


@dataclass
class Scenario:
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    protocol: str = "trtllm-render"
    events: bool = True
    roles: tuple[Role, ...] = (Role.BOTH,) * 4
    sessions: bool = False
    eviction: bool = False
    rewrite: bool = False
    media: bool = False
    saturated: frozenset[str] = frozenset()
    slo: bool = False


SCENARIOS = [
    Scenario("defaults"),
    Scenario("load_only", protocol="none"),
    Scenario("prediction_only", events=False),
    Scenario("temperature", {"router_temperature": 0.5}),
    Scenario("rule_longest", {"affinity_rule": "longest"}),
    Scenario("bound_0", {"affinity_load_bound": 0.0}),
    Scenario("bound_0_temperature", {"affinity_load_bound": 0.0, "router_temperature": 0.7}),
    Scenario("time_cost", {"cost_model": "time"}, slo=True),
    Scenario("eviction_aware", {"eviction_aware": True, "affinity_load_bound": 0.0}, eviction=True),
    Scenario("eviction_aware_bound", {"eviction_aware": True}, eviction=True),
    Scenario("prediction_lifetime_queue", {"prediction_lifetime": "queue"}),
    Scenario("pd", roles=(Role.DECODE, Role.DECODE, Role.PREFILL, Role.PREFILL)),
    Scenario("pd_vllm", protocol="vllm-render", roles=(Role.DECODE, Role.DECODE, Role.PREFILL, Role.BOTH)),
    Scenario("session_affinity", sessions=True, saturated=frozenset({ADDRS[3]})),
    Scenario("model_rewrite", rewrite=True),
    Scenario("media_trtllm", media=True),
    Scenario("media_vllm", protocol="vllm-render", media=True),
    Scenario("vllm_salt", protocol="vllm-render"),
]


def requests_for(s: Scenario) -> list[RequestContext]:
    reqs = script()
    if s.media:
        reqs = [chat(f"describe picture {i % 3}", image=True) if i % 2 else r for i, r in enumerate(reqs)]
    if s.rewrite:
        reqs = [chat("lora " + str(i % 5), model="tenant" if i % 2 else "m") for i, _ in enumerate(reqs)]
    if s.protocol == "vllm-render" and not s.media:
        reqs = [chat(f"salted {i % 4}", headers={"x-tenant-id": [f"t{i % 2}"]}) if i % 3 == 0 else r
                for i, r in enumerate(reqs)]
    if s.slo:  # odd steps ask for a TTFT objective; every fourth of those may be shed
        reqs = [RequestContext(r.method, r.path, {"x-test-sheddable": ["1"]} if i % 4 == 1 else r.headers, r.body,
                               slo=Slo(ttft_ms=40.0 if i % 4 == 1 else 400.0)) if i % 2 else r
                for i, r in enumerate(reqs)]
    return reqs


def _subset(i: int) -> list[str] | None:
    return [ADDRS[0], ADDRS[1], ADDRS[2]] if i % 7 == 5 else None


async def _run(s: Scenario) -> list[dict[str, Any]]:
    reg = EndpointRegistry()
    reg.replace([Endpoint(f"w{i}", a, role=role) for i, (a, role) in enumerate(zip(ADDRS, s.roles, strict=True))])
    metrics = PickerMetrics()
    load = LoadTracker(metrics.endpoint_inflight)
    kv = ScriptKv(confirmed=s.events) if s.protocol != "none" else None
    renderer = ScriptRenderer(s.protocol) if s.protocol != "none" else None
    cfg = Config(**({"tokenizer_protocol": s.protocol, "tokenizer_service_url": "http://127.0.0.1:1"}
                    if s.protocol != "none" else {}), **s.config)
    sessions = SessionTokens([SESSION_KEY], 3600) if s.sessions else None
    rewriter = None
    if s.rewrite:
        table = RewriteTable(RewriteRules([Rule("split", frozenset({"tenant"}),
                                                (Target("tenant", 1), Target("tenant-lora", 1)))]))
        rewriter = ModelRewriter(table, random.Random(3))
    decider = build_decider(cfg, reg, load, metrics, renderer=renderer, kv=kv, sessions=sessions,
                            rewriter=rewriter, churn=ScriptChurn() if s.eviction else None,
                            usage=lambda a: 0.95 if a == ADDRS[0] else 0.2, saturated=s.saturated.__contains__,
                            sheddable=lambda ctx: "x-test-sheddable" in ctx.headers)
    bookings: list[Any] = []
    out: list[dict[str, Any]] = []
    last_worker: str | None = None
    for i, ctx in enumerate(requests_for(s)):
        if s.sessions and last_worker is not None and i % 3:
            ctx = RequestContext(ctx.method, ctx.path, {SESSION_HEADER: [sessions.seal(last_worker)]},  # type: ignore[union-attr]
                                 ctx.body)
        ctx = RequestContext(ctx.method, ctx.path, ctx.headers, ctx.body, _subset(i), ctx.slo)
        if renderer is not None and i == 11:
            renderer.fail_next = True  # one render failure: routed by load
        random.seed(1000 + i)
        try:
            proposal = await decider.propose(ctx, count=False)
        except PickError as e:
            out.append({"step": i, "error": e.problem.value, "message": str(e)})
            continue
        random.seed(2000 + i)
        explained = json.loads(orjson.dumps(decider.explain(proposal), default=str))
        decision = decider.commit(proposal)
        last_worker = decision.address
        bookings.append(decision.booking)
        out.append({"step": i, "address": decision.address, "prefill": decision.prefill,
                    "predicted_cached_tokens": decision.predicted_cached_tokens,
                    "body_sha": None if decision.body is None else _digest(decision.body),
                    "score": explained})
        if i % 2 == 1 and bookings:
            bookings[0].prefill_done()
        if i % 3 == 2 and bookings:
            bookings.pop(0).free()
        if kv is not None and i % 4 == 3:
            kv.confirm_all()
    return out


def _digest(body: bytes) -> str:
    import hashlib
    return hashlib.sha256(body).hexdigest()[:16]


class StepClock:
    """The time cost's stopwatch on a scripted clock: each reading is 13 ms after the last, so what it
    learns from first chunks is the same on every run and machine."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        self.now += 0.013
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


# modules whose `time` the time cost reads (moved with the code, if it moves)
CLOCKED = ("epp_extproc.core.time_cost",)


async def run(s: Scenario) -> list[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        clock = StepClock()
        for module in CLOCKED:
            stack.enter_context(mock.patch(f"{module}.time", clock))
        return await _run(s)


async def run_all() -> dict[str, list[dict[str, Any]]]:
    return {s.name: await run(s) for s in SCENARIOS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    doc = asyncio.run(run_all())
    text = json.dumps(doc, indent=1, sort_keys=True)
    if args.record:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text + "\n")
        print(f"recorded {sum(len(v) for v in doc.values())} decisions in {len(doc)} scenarios -> {GOLDEN}")
    else:
        print(text)


if __name__ == "__main__":
    main()
