"""One way for tests to build the decision from plain parts (the fakes' counterpart of app.PickerApp's wiring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from epp_extproc.config import Config
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.pipeline import Pipeline
from epp_extproc.core.request import RequestContext
from epp_extproc.metrics import PickerMetrics


def build_decider(config: Config, registry: EndpointRegistry, load: LoadTracker, metrics: PickerMetrics, *,
                  renderer: Any = None, kv: Any = None, sessions: Any = None, rewriter: Any = None,
                  eviction: Any = None, saturated: Callable[[str], bool] | None = None,
                  sheddable: Callable[[RequestContext], bool] | None = None, admission: Any = None,
                  fingerprint_of: Any = None) -> Pipeline:
    return Pipeline(config, registry, load, metrics, renderer=renderer, kv=kv, sessions=sessions,
                    rewriter=rewriter, eviction=eviction, saturated=saturated, sheddable=sheddable,
                    admission=admission, fingerprint_of=fingerprint_of)
