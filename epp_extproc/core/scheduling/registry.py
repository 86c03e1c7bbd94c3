"""Plugin types by name: one line per plugin. A new plugin is its own file plus one line here (and, for a config
file to name it with parameters, its entry in config_file.py's type table)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from epp_extproc.core.scheduling.block_cost_scorer import BlockCostScorer
from epp_extproc.core.scheduling.bounded_load_picker import BoundedLoadPicker
from epp_extproc.core.scheduling.decode_filter import DecodeFilter
from epp_extproc.core.scheduling.deps import SchedulingDeps
from epp_extproc.core.scheduling.eviction_scorer import EvictionScorer
from epp_extproc.core.scheduling.min_cost_picker import MinCostPicker
from epp_extproc.core.scheduling.predicted_time_scorer import PredictedTimeScorer
from epp_extproc.core.scheduling.prefill_filter import PrefillFilter
from epp_extproc.core.scheduling.random_picker import RandomPicker
from epp_extproc.core.scheduling.softmax_picker import SoftmaxPicker
from epp_extproc.core.scheduling.tiered_credit_scorer import TieredCreditScorer


class PluginType(Protocol):
    def create(self, params: Mapping[str, Any], deps: SchedulingDeps) -> Any: ...


PLUGINS: dict[str, PluginType] = {
    "decode-filter": DecodeFilter,
    "prefill-filter": PrefillFilter,
    "kv-block-cost-scorer": BlockCostScorer,
    "eviction-scorer": EvictionScorer,
    "predicted-time-scorer": PredictedTimeScorer,
    "min-cost-picker": MinCostPicker,
    "softmax-picker": SoftmaxPicker,
    "bounded-load-picker": BoundedLoadPicker,
    "random-picker": RandomPicker,
    "tiered-credit": TieredCreditScorer,
}
