"""What plugins may be built with: the picker's shared parts, handed to each plugin's `create`. A plugin takes
what it needs from here and nothing else (no plugin reads the whole configuration)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from epp_extproc.core.contract import KvLookup
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.request import RequestContext
from epp_extproc.core.scheduling.eviction_scorer import ChurnView
from epp_extproc.core.time_cost import TimeCost
from epp_extproc.metrics import PickerMetrics


@dataclass
class SchedulingDeps:
    registry: EndpointRegistry
    load: LoadTracker
    metrics: PickerMetrics
    kv: KvLookup | None = None
    default_block_size: int = 32
    churn: ChurnView | None = None  # the in-process index's removals (eviction); None with ingest apart
    usage: Callable[[str], float | None] | None = None  # a worker's fresh KV usage gauge, if scraped
    saturated: Callable[[str], bool] | None = None
    sheddable: Callable[[RequestContext], bool] | None = None
    _time: TimeCost | None = field(default=None, repr=False)

    def block_size(self, address: str) -> float:
        return float(self.kv.block_size(address) if self.kv is not None else self.default_block_size)

    @property
    def time(self) -> TimeCost | None:
        return self._time

    def time_model(self) -> TimeCost:
        """The one per-worker time model of this picker (created on first use, fed by its bookings)."""
        if self._time is None:
            error = self.metrics.ttft_prediction_error
            tc = self._time = TimeCost(
                on_error=lambda a, seen, predicted: error.labels(a).observe((seen - predicted) * 1000.0))
            # the booking's first-chunk signal stops the stopwatch, whichever way it came (response chunk or
            # lean mode's observer stream)
            self.load.add_listener(lambda ch: tc.on_booking(ch.kind, ch.id, ch.address))
        return self._time
