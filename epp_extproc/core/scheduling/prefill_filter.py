"""`prefill-filter` (llm-d's name): the prefill-only workers of a disaggregated pool, healthy ones first
(the registry's `routable()`: all of them when none is healthy, as Envoy's panic mode)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from epp_extproc.core.contract import Role
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.scheduling.table import SchedulingRequest

if TYPE_CHECKING:
    from epp_extproc.core.scheduling.deps import SchedulingDeps


class PrefillFilter:
    name = "prefill-filter"

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> PrefillFilter:
        return cls(deps.registry)

    def __init__(self, registry: EndpointRegistry) -> None:
        self._registry = registry

    def filter(self, req: SchedulingRequest, addresses: Sequence[str] | None) -> Sequence[str]:
        prefill = [ep.address for ep in self._registry.routable() if ep.role is Role.PREFILL]
        if addresses is None:
            return prefill
        keep = set(addresses)
        return [a for a in prefill if a in keep]
