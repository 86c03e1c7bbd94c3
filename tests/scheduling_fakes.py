"""One way for tests to build the decision from plain parts: the app's own assembly (core/assemble.py), with
the collaborators a test hands in (fakes or real ones). `Decider` keeps them together so a test reads one
object: the Director's steps, the debug view, and the parts a test checks afterwards (load, metrics, kv)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from epp_extproc.config import Config
from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.assemble import Assembled, assemble
from epp_extproc.core.contract import Credit, PromptIdentity
from epp_extproc.core.decision import Decision
from epp_extproc.core.director import Admission, Director
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.flow_queue import Ticket
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import EndpointLoad, LoadTracker
from epp_extproc.core.picker import Picker
from epp_extproc.core.proposal import Proposal
from epp_extproc.core.render import Rendered, RenderError
from epp_extproc.core.request import RequestContext
from epp_extproc.core.scheduling.block_cost_scorer import BlockCostScorer
from epp_extproc.core.scheduling.bounded_load_picker import BoundedLoadPicker
from epp_extproc.core.scheduling.eviction_scorer import EvictionFigures, EvictionScorer
from epp_extproc.core.scheduling.min_cost_picker import MinCostPicker
from epp_extproc.core.scheduling.softmax_picker import SoftmaxPicker
from epp_extproc.core.scheduling.subset_filter import SubsetFilter
from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest
from epp_extproc.core.time_cost import TimeCost
from epp_extproc.metrics import PickerMetrics


def build_decider(config: Config, registry: EndpointRegistry, load: LoadTracker, metrics: PickerMetrics, *,
                  renderer: Any = None, kv: Any = None, sessions: Any = None, rewriter: Any = None,
                  churn: Any = None, usage: Callable[[str], float | None] | None = None,
                  saturated: Callable[[str], bool] | None = None,
                  sheddable: Callable[[RequestContext], bool] | None = None, admission: Any = None,
                  fingerprint_of: Any = None, spec: Any = None, tracing: Any = None) -> Decider:
    return Decider(assemble(config, registry, load, metrics, spec=spec, renderer=renderer, kv=kv,
                            sessions=sessions, rewriter=rewriter, churn=churn, usage=usage, saturated=saturated,
                            sheddable=sheddable, admission=admission, fingerprint_of=fingerprint_of,
                            tracing=tracing),
                   config, metrics)


class Decider:
    """The assembled decision as a test drives it (what `Picker` takes, too: it reads only the Director's
    steps, `registry` and `sessions`)."""

    def __init__(self, assembled: Assembled, config: Config, metrics: PickerMetrics) -> None:
        self.assembled = assembled
        self.director: Director = assembled.director
        self.config = config
        self.metrics = metrics

    @property
    def renderer(self) -> Any:
        return self.director.planner.renderer

    @renderer.setter
    def renderer(self, value: Any) -> None:  # a test swaps the renderer's answers (same protocol)
        self.director.planner.renderer = value

    @property
    def registry(self) -> EndpointRegistry:
        return self.director.registry

    @property
    def load(self) -> LoadTracker:
        return self.director.load

    @property
    def kv(self) -> Any:
        return self.director.kv

    @property
    def sessions(self) -> Any:
        return self.director.sessions

    @property
    def sheddable(self) -> Any:
        return self.director.sheddable

    @sheddable.setter
    def sheddable(self, value: Any) -> None:
        self.director.sheddable = value

    @property
    def rewriter(self) -> Any:
        return self.director.rewriter

    @rewriter.setter
    def rewriter(self, value: Any) -> None:
        self.director.rewriter = value

    @property
    def time_cost(self) -> TimeCost | None:
        return self.assembled.time_model

    async def propose(self, ctx: RequestContext, **kw: Any) -> Proposal:
        return await self.director.propose(ctx, **kw)

    async def admit(self, p: Proposal, ctx: RequestContext) -> tuple[Proposal, Ticket | None]:
        return await self.director.admit(p, ctx)

    def commit(self, p: Proposal) -> Decision:
        return self.director.commit(p)

    def explain(self, p: Proposal) -> dict[str, Any]:
        return self.assembled.debug.explain(p)


# ---------------------------------------------------------------- the cost rules on hand-made rows
# Tests of the arithmetic (the block cost, the pickers, the eviction and time rules) write a few workers as
# rows, run the plugins over the table they make, and read back each row's cost.


@dataclass
class CostParams:
    overlap_credit: float = 1.0
    prefill_load_scale: float = 1.0
    temperature: float = 0.0


@dataclass
class Row:
    """One worker as a test writes it; `cost` is filled in by `choose`."""

    address: str
    load: EndpointLoad = field(default_factory=EndpointLoad)
    prompt_blocks: float = 0.0
    overlap_blocks: int = 0
    overlap_discount: float = 0.0  # what the eviction rule takes off the credited overlap (`apply_eviction`)
    eviction_penalty: float = 0.0  # and what it adds for the prefixes this prompt would flush
    eviction: EvictionFigures | None = None
    cost: float = 0.0


def loads_for(addresses: Sequence[str], loads: Mapping[str, EndpointLoad]) -> list[Row]:
    return [Row(a, loads.get(a, EndpointLoad())) for a in addresses]


def table_of(rows: Sequence[Row]) -> CandidateTable:
    t = CandidateTable([r.address for r in rows], [r.load for r in rows])
    for i, r in enumerate(rows):
        t.prompt_blocks[i] = r.prompt_blocks
        t.overlap[i] = r.overlap_blocks
        t.credited[i] = r.overlap_blocks - r.overlap_discount
    return t


def request(ctx: RequestContext | None = None) -> SchedulingRequest:
    return SchedulingRequest(ctx or RequestContext("POST", "/v1/chat/completions"))


def _scored_request(rows: Sequence[Row]) -> SchedulingRequest:
    """The request the rows were priced for: one with a known prompt when any row has prompt blocks (the
    prefill weight applies only then), else one routed by load (no prompt)."""
    if any(r.prompt_blocks > 0 for r in rows):
        return SchedulingRequest(RequestContext("POST", "/v1/chat/completions"), prompt=())  # type: ignore[arg-type]
    return request()


def _run(rows: Sequence[Row], params: CostParams, picker: Any) -> Row:
    t = table_of(rows)
    req = _scored_request(rows)
    costs = BlockCostScorer(params.overlap_credit, params.prefill_load_scale).score(req, t)
    t.cost[:] = [c + r.eviction_penalty for c, r in zip(costs, rows, strict=True)]
    i = picker.pick(req, t, range(len(rows)))
    for r, c in zip(rows, t.cost, strict=True):
        r.cost = c
    return rows[i]


def choose(rows: Sequence[Row], params: CostParams, rng: random.Random | None = None) -> Row:
    """The block cost's argmin (or softmax at the params' temperature); fills each row's cost."""
    picker = SoftmaxPicker(params.temperature, rng) if params.temperature > 0 else MinCostPicker(rng)
    return _run(rows, params, picker)


def choose_bounded(rows: Sequence[Row], params: CostParams, bound: float, rng: random.Random | None = None,
                   rule: str = "weighed") -> Row:
    return _run(rows, params, BoundedLoadPicker(bound, params.temperature, rng, rule))


def choose_with(rows: Sequence[Row], params: CostParams, picker: Any) -> Row:
    """The block cost priced, then `picker` picks (a picker a test configured itself)."""
    return _run(rows, params, picker)


def apply_eviction(scorer: EvictionScorer, rows: Sequence[Row]) -> None:
    """The eviction scorer over rows with a known prompt: each row's discount, penalty and figures."""
    t = table_of([Row(r.address, r.load, r.prompt_blocks, r.overlap_blocks) for r in rows])
    req = SchedulingRequest(RequestContext("POST", "/v1/chat/completions"), prompt=())  # type: ignore[arg-type]
    scorer.prepare(req, t)
    penalties = scorer.score(req, t)
    for r, f, pen in zip(rows, t.notes[scorer.note], penalties, strict=True):
        r.overlap_discount, r.eviction_penalty, r.eviction = f.discount, pen, f


def compute_cost(row: Row, params: CostParams) -> float:
    return BlockCostScorer(params.overlap_credit, params.prefill_load_scale).score(_scored_request([row]),
                                                                                  table_of([row]))[0]


def eligible(addresses: Sequence[str], subset: Sequence[str] | None) -> list[str]:
    return list(SubsetFilter().filter(request(RequestContext(subset=list(subset) if subset is not None else None)),
                                      addresses))


# ---------------------------------------------------------------- two workers, a renderer and an index, faked
# The decision most unit tests drive: two aggregated workers, a renderer answering 100 ids, an index in which
# the first worker holds 2 blocks of every prompt.

ADDRS = ["127.0.0.1:9", "127.0.0.1:10"]


class FakeRenderer:
    def __init__(self, protocol: str = "trtllm-render") -> None:
        self.protocol = protocol
        self.fail: RenderError | None = None
        self.calls: list[bool] = []
        self.bodies: list[bytes] = []

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        self.calls.append(count)
        self.bodies.append(body)
        if self.fail is not None:
            raise self.fail
        return Rendered(list(range(100)))


class FakeKv:
    def __init__(self) -> None:
        self.predicted: list[str] = []
        self.models: list[object] = []
        self.fail_overlap = False

    def prompt(self, tokens: Sequence[int], identity: PromptIdentity) -> list[int]:
        self.models.append(identity.model)
        return list(tokens)

    def block_size(self, address: str) -> int:
        return 32

    def base_model_for(self, model: object) -> str | None:
        return "base-model" if model == "tenant-lora" else None

    def overlap(self, prompt: Any, workers: Sequence[str]) -> dict[str, int]:
        if self.fail_overlap:
            raise RuntimeError("index exploded")
        return {ADDRS[0]: 2}

    def held(self, address: str) -> int:
        return 0

    def credit(self, prompt: Any, workers: Sequence[str]) -> dict[str, Credit]:
        return {w: Credit(n, 0) for w, n in self.overlap(prompt, workers).items()}

    def predict(self, address: str, prompt: Any, booking: str | None = None) -> None:
        self.predicted.append(address)


def make(admission: Admission | None = None, **cfg: Any) -> tuple[Decider, FakeRenderer, FakeKv]:
    reg = EndpointRegistry()
    reg.replace([Endpoint(f"w{i}", a) for i, a in enumerate(ADDRS)])
    metrics = PickerMetrics()
    r, kv = FakeRenderer(), FakeKv()
    config = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1", **cfg)
    return build_decider(config, reg, LoadTracker(metrics.endpoint_inflight), metrics, renderer=r, kv=kv,
                    admission=admission), r, kv


async def decide(pipe: Decider, ctx: RequestContext) -> Decision:
    """The whole decision as the edge's exchange runs it (`Picker.decide`: propose -> admit -> commit)."""
    picker = Picker(pipe, gate=InflightGate(64), bodies=BodyBudget(1 << 20, 1 << 24),
                    lean=LeanSignals(pipe.load, pipe.metrics))
    return await picker.decide(ctx)


def chat(body: bytes, headers: dict[str, list[str]] | None = None) -> RequestContext:
    return RequestContext("POST", "/v1/chat/completions", headers or {}, body)


class TokensRenderer:
    """A TensorRT-LLM renderer that answers the ids a test set in `tokens`, whatever the body."""

    protocol = "trtllm-render"

    def __init__(self) -> None:
        self.tokens: list[int] = []

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        return Rendered(list(self.tokens))

