"""`decode-filter` (llm-d's name): the workers that may be a request's destination, decode or aggregated.

A prefill-only worker is never a destination: it is named in x-prefiller-host-port (pd_profile_handler.py).
On the whole pool it answers the registry's cached tuple, kept until the pool or a probe verdict changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.scheduling.table import SchedulingRequest

if TYPE_CHECKING:
    from epp_extproc.core.scheduling.deps import SchedulingDeps


class DecodeFilter:
    name = "decode-filter"

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> DecodeFilter:
        return cls(deps.registry)

    def __init__(self, registry: EndpointRegistry) -> None:
        self._registry = registry

    def filter(self, req: SchedulingRequest, addresses: Sequence[str] | None) -> Sequence[str]:
        destinations = self._registry.destinations()
        if addresses is None:
            return destinations
        keep = set(destinations)
        return [a for a in addresses if a in keep]
