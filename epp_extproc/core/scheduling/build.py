"""From a SchedulingSpec (one EndpointPickerConfig file, or today's flags compiled to one: config_file.py) to
the profile handler the Director runs, and the commit hooks its plugins bring.

Every profile also gets the gateway's subset filter (the protocol obliges it) and, for the destination's
profile, session affinity's pin when the picker seals session tokens. A plugin that cannot be built here
(e.g. the eviction scorer without an in-process index) is one `ConfigFileError` naming the entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp_extproc.core.director import CommitHook, ProfileHandler
from epp_extproc.core.scheduling.config_file import ConfigFileError, PluginSpec, ProfileSpec, SchedulingSpec
from epp_extproc.core.scheduling.deps import SchedulingDeps
from epp_extproc.core.scheduling.pd_profile_handler import PdProfileHandler
from epp_extproc.core.scheduling.predicted_time_scorer import PredictedTimeScorer
from epp_extproc.core.scheduling.profile import Pin, Profile, TableSource
from epp_extproc.core.scheduling.registry import PLUGINS
from epp_extproc.core.scheduling.session_pin import SessionPin
from epp_extproc.core.scheduling.single_profile_handler import SingleProfileHandler
from epp_extproc.core.scheduling.subset_filter import SubsetFilter
from epp_extproc.core.scheduling.time_observation_hook import TimeObservationHook
from epp_extproc.core.session import SessionTokens


@dataclass(frozen=True, slots=True)
class Built:
    handler: ProfileHandler
    hooks: tuple[CommitHook, ...]
    cost_model: str
    source: TableSource  # fills every profile's table (loads, the index's overlaps): what a lookup costs  # `/debug/score`'s label: "time" when the destination is priced in seconds, else "blocks"


def _plugin(spec: PluginSpec, deps: SchedulingDeps) -> object:
    kind = PLUGINS.get(spec.type)
    if kind is None:
        raise ConfigFileError(f"plugins[{spec.name}]: type {spec.type!r} has no implementation here")
    try:
        return kind.create(spec.parameters, deps)
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigFileError(f"plugins[{spec.name}] ({spec.type}): {e}") from None


def _profile(spec: ProfileSpec, deps: SchedulingDeps, source: TableSource, pins: Sequence[Pin] = ()) -> Profile:
    filters = [_plugin(f, deps) for f in spec.filters]
    filters.append(SubsetFilter())
    scorers = [(_plugin(s, deps), w) for s, w in spec.scorers]
    return Profile(spec.name, filters, scorers, _plugin(spec.picker, deps), source, pins)  # type: ignore[arg-type]


def build(spec: SchedulingSpec, deps: SchedulingDeps, *, sessions: SessionTokens | None = None) -> Built:
    source = TableSource(deps.load.loads, deps.kv)
    pins: list[Pin] = [SessionPin(sessions, deps.saturated)] if sessions is not None else []
    handler_type = spec.handler.type
    if handler_type == "single-profile-handler":
        (primary_spec,) = spec.profiles.values()
        primary = _profile(primary_spec, deps, source, pins)
        handler: ProfileHandler = SingleProfileHandler(primary)
    elif handler_type == "pd-profile-handler":
        primary = _profile(spec.profiles["decode"], deps, source, pins)
        prefill = _profile(spec.profiles["prefill"], deps, source)
        kv = deps.kv
        handler = PdProfileHandler(primary, prefill, deps.registry,
                                   threshold=int(spec.handler.parameters["threshold"]),
                                   block_size=kv.block_size if kv is not None else None,
                                   default_block_size=deps.default_block_size)
    else:
        raise ConfigFileError(f"plugins[{spec.handler.name}]: profile handler type {handler_type!r} has no "
                              "implementation here")
    hooks: list[CommitHook] = []
    timed = [s for s, _ in primary.scorers if isinstance(s, PredictedTimeScorer)]
    if timed:
        hooks.append(TimeObservationHook(timed[0], deps.metrics))
    hooks.extend(s for s, _ in primary.scorers if callable(getattr(s, "committed", None)))  # e.g. tiered-credit
    return Built(handler, tuple(hooks), "time" if timed else "blocks", source)
