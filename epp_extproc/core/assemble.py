"""One picker's decision, assembled from the configuration and its shared parts: the render plan, the
scheduler (from the config file, or today's flags compiled to the same spec), the body stage, the commit hooks
and the Director that runs them. The app and the tests build it the same way, so a test decides as the app
does. Each component is handed its own section of the configuration, never the whole `Config`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

from epp_extproc.config import Config
from epp_extproc.core.contract import KvLookup
from epp_extproc.core.debug_view import DebugView
from epp_extproc.core.director import Admission, CommitHook, Director, DirectorSettings
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.engine import engine_for
from epp_extproc.core.forward import Forwarder, ForwardSettings
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.model_rewrite import ModelRewriter
from epp_extproc.core.passthrough import FingerprintId
from epp_extproc.core.plan import Planner, PlanSettings
from epp_extproc.core.recent_decisions import RecentDecisions
from epp_extproc.core.render import Renderer
from epp_extproc.core.request import RequestContext
from epp_extproc.core.scheduling.build import build
from epp_extproc.core.scheduling.config_file import PluginSpec, SchedulingSpec, spec_from_config
from epp_extproc.core.scheduling.decision_metrics_hook import DecisionMetricsHook
from epp_extproc.core.scheduling.deps import SchedulingDeps
from epp_extproc.core.scheduling.eviction_scorer import ChurnView
from epp_extproc.core.scheduling.kv_prediction_hook import KvPredictionHook
from epp_extproc.core.scheduling.profile import TableSource
from epp_extproc.core.session import SessionTokens
from epp_extproc.core.time_cost import TimeCost
from epp_extproc.metrics import PickerMetrics

if TYPE_CHECKING:
    from epp_extproc.tracing.spans import Tracing

log = logging.getLogger(__name__)
S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Assembled:
    director: Director
    debug: DebugView
    spec: SchedulingSpec
    deps: SchedulingDeps
    source: TableSource  # the table fill every profile shares (a bench times the lookup there)
    decisions: RecentDecisions  # the last decisions while the debug page watches (a commit hook)

    @property
    def time_model(self) -> TimeCost | None:
        """The per-worker time model, when a profile prices in time (a removed worker's is forgotten)."""
        return self.deps.time


def describe(spec: SchedulingSpec) -> dict[str, object]:
    """What `/debug/score` says decided: the handler and, per profile, its plugins in order (the subset filter
    every profile adds is named too)."""
    def named(p: PluginSpec) -> str:  # the file's name for the entry, and our type when they differ
        return p.name if p.name == p.type else f"{p.name} ({p.type})"

    return {"handler": named(spec.handler),
            "profiles": {name: {"filters": [named(f) for f in p.filters] + ["subset-filter"],
                                "scorers": [[named(s), w] for s, w in p.scorers], "picker": named(p.picker)}
                         for name, p in spec.profiles.items()}}


def settings_from(cls: type[S], *sections: object) -> S:
    """A component's settings (`PlanSettings`, ...) from the sections that hold its fields: each field is the
    option of the same name, taken from the first section that has it, so no field is copied by hand and a
    field no section holds fails here, at start-up."""
    values = {}
    held = [{f.name for f in fields(s)} for s in sections]  # type: ignore[arg-type]
    for f in fields(cls):  # type: ignore[arg-type]
        holder = next((s for s, names in zip(sections, held, strict=True) if f.name in names), None)
        if holder is None:
            raise TypeError(f"{cls.__name__}.{f.name} is in none of the sections it was built from")
        values[f.name] = getattr(holder, f.name)
    return cls(**values)


def assemble(config: Config, registry: EndpointRegistry, load: LoadTracker, metrics: PickerMetrics, *,
             spec: SchedulingSpec | None = None, renderer: Renderer | None = None, kv: KvLookup | None = None,
             fingerprint_of: Callable[[str], FingerprintId | None] | None = None,
             admission: Admission | None = None, rewriter: ModelRewriter | None = None,
             sessions: SessionTokens | None = None, saturated: Callable[[str], bool] | None = None,
             sheddable: Callable[[RequestContext], bool] | None = None, churn: ChurnView | None = None,
             usage: Callable[[str], float | None] | None = None, tracing: Tracing | None = None) -> Assembled:
    """`spec` None: today's flags (`spec_from_config`). Raises ValueError naming the entry a plugin cannot be
    built for (the CLI reports it at start-up). `tracing` (None: off) wraps the render call, the KV lookup,
    the scheduler and the flow-control wait in spans and adds its commit hook; the Director does not know."""
    sections = config.sections
    block_size = sections.kv.kv_cache_block_size
    spec = spec if spec is not None else spec_from_config(sections.scheduling)
    engine = engine_for(renderer.protocol if renderer is not None else None)
    scoring_kv = kv
    if tracing is not None:
        renderer = tracing.renderer(renderer) if renderer is not None else None
        scoring_kv = tracing.kv(kv) if kv is not None else None
        admission = tracing.admission(admission) if admission is not None else None
    deps = SchedulingDeps(registry, load, metrics, kv=scoring_kv, default_block_size=block_size,
                          churn=churn, usage=usage, saturated=saturated, sheddable=sheddable)
    built = build(spec, deps, sessions=sessions)
    planner = Planner(settings_from(PlanSettings, sections.renderer), renderer, engine, kv)
    forwarder = Forwarder(settings_from(ForwardSettings, sections.renderer, sections.serving), engine, fingerprint_of)
    hooks: list[CommitHook] = []
    if kv is not None:
        hooks.append(KvPredictionHook(kv, engine))
    hooks.extend(built.hooks)
    hooks.append(DecisionMetricsHook(metrics))
    decisions = RecentDecisions()  # one attribute test per request unless the debug page is open
    hooks.append(decisions)
    scheduler = built.handler
    if tracing is not None:
        hooks.append(tracing.hook())
        scheduler = tracing.scheduler(built.handler, kv)
    director = Director(settings_from(DirectorSettings, sections.serving, sections.kv), registry, load,
                        planner=planner, scheduler=scheduler, forwarder=forwarder, rewriter=rewriter,
                        admission=admission, hooks=hooks, kv=kv, sessions=sessions, sheddable=sheddable)
    threshold = int(spec.handler.parameters.get("threshold", sections.scheduling.pd_min_uncached_tokens))
    debug = DebugView(registry, kv, forwarder, cost_model=built.cost_model, pd_threshold=threshold,
                      default_block_size=block_size, scheduling=describe(spec))
    return Assembled(director, debug, spec, deps, built.source, decisions)
