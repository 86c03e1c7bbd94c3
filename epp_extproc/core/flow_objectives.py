"""Which queue a request joins under flow control: its InferenceObjective's priority (the band) and its
fairness id (the flow inside the band), read from the request headers GAIE and llm-d define; and the
objective table the file or CRD loaders (adapters/objectives.py) replace wholesale.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
FAIRNESS_HEADERS = ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")
DEFAULT_FLOW = "default-flow"  # GAIE's flow key when no fairness id is sent
MAX_ID_CHARS = 128  # a client-chosen id longer than this is cut: ids are map keys and metric-free, but bounded


@dataclass(frozen=True, slots=True)
class FlowKey:
    """Which queue a request joins: its band (priority) and its flow inside the band (fairness id)."""

    priority: int
    fairness_id: str
    objective: str | None = None


class ObjectiveTable:
    """InferenceObjective name -> priority, replaced wholesale by whichever source feeds it (file or CRD).

    An unknown or absent objective means priority 0, like GAIE (an unset `spec.priority` is 0 too).
    """

    def __init__(self, priorities: Mapping[str, int] | None = None) -> None:
        self._priorities: dict[str, int] = dict(priorities or {})

    def replace(self, priorities: Mapping[str, int]) -> None:
        if priorities != self._priorities:
            log.info("inference objectives: %s", dict(sorted(priorities.items())))
        self._priorities = dict(priorities)

    def priority(self, objective: str | None) -> int:
        return self._priorities.get(objective, 0) if objective else 0

    def snapshot(self) -> dict[str, int]:
        return dict(self._priorities)

    def flow_key(self, headers: Mapping[str, list[str]]) -> FlowKey:
        objective = _last_header(headers, OBJECTIVE_HEADERS)
        fairness = _last_header(headers, FAIRNESS_HEADERS) or DEFAULT_FLOW
        return FlowKey(self.priority(objective), fairness[:MAX_ID_CHARS], objective)


def _last_header(headers: Mapping[str, list[str]], names: Sequence[str]) -> str | None:
    for name in names:
        values = headers.get(name)
        if values:
            v = values[-1].strip()
            if v:
                return v[:MAX_ID_CHARS]
    return None


def parse_objectives(doc: object) -> dict[str, int]:
    """Objectives from a file: `{name: priority}`, a list of `{name, priority}`, or InferenceObjective
    manifests (`metadata.name`, `spec.priority`; a YAML list or a `kind: List`). Raises ValueError."""
    if isinstance(doc, dict) and "items" in doc:
        doc = doc["items"]
    if isinstance(doc, dict) and "metadata" not in doc:
        out = {}
        for k, v in doc.items():
            if not isinstance(k, str) or type(v) is not int:
                raise ValueError(f"objective {k!r}: priority must be an integer, got {v!r}")
            out[k] = v
        return out
    items = doc if isinstance(doc, list) else [doc]
    out = {}
    for it in items:
        if not isinstance(it, dict):
            raise ValueError(f"objective entry must be a mapping, got {it!r}")
        name = it.get("name") or (it.get("metadata") or {}).get("name")
        prio = it.get("priority", (it.get("spec") or {}).get("priority", 0))
        if not isinstance(name, str) or not name:
            raise ValueError(f"objective entry without a name: {it!r}")
        if prio is None:
            prio = 0
        if type(prio) is not int:
            raise ValueError(f"objective {name!r}: priority must be an integer, got {prio!r}")
        out[name] = prio
    return out
