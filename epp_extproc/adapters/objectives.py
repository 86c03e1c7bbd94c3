"""Where InferenceObjective priorities come from: a file, or the CRD when discovery is Kubernetes.

Both sources replace the whole `ObjectiveTable` (core/flow_objectives.py) on every successful read and keep the
previous table on a failed one, so a bad edit or an API outage never drops every request to priority 0.

The CRD is `InferenceObjective` (`v1alpha2`, plural `inferenceobjectives`, namespaced), read from both API groups
that serve it: llm-d's `llm-d.ai` and GAIE's deprecated `inference.networking.x-k8s.io` (merged, `llm-d.ai` winning
a name in both: adapters/crd_poll.py says why and cites the llm-d source). `metadata.name` is what the
`x-gateway-inference-objective` header names, `spec.priority` the band (unset = 0), `spec.poolRef.name` the
pool it applies to. Objectives are few and change rarely, so a periodic list is enough (no watch to keep
alive); the picker's ServiceAccount needs `list` on that resource in both groups.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml

from epp_extproc.adapters.crd_poll import INFERENCE_API_GROUPS, CrdListPoller
from epp_extproc.core.flow_objectives import ObjectiveTable, parse_objectives
from epp_extproc.file_watch import FileWatch

log = logging.getLogger(__name__)

OBJECTIVE_GROUPS = INFERENCE_API_GROUPS  # (group, version), llm-d.ai first: it wins a name in both
OBJECTIVE_PLURAL = "inferenceobjectives"


def read_objectives_file(path: str) -> dict[str, int]:
    with open(path, encoding="utf-8") as f:
        try:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]  # JSON is YAML; `---` separated too
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: {e}") from None
    out: dict[str, int] = {}
    for doc in docs:
        out.update(parse_objectives(doc))
    return out


class ObjectivesFile:
    """Polls the file's (mtime, size, inode) and reloads on change (`file_watch.FileWatch`: read and parsed in
    a worker thread while running; `load_once` reads in the caller's thread)."""

    def __init__(self, table: ObjectiveTable, path: str, interval_s: float = 2.0) -> None:
        self.table = table
        self.path = path
        self.interval_s = interval_s
        self._watch: FileWatch[dict[str, int]] = FileWatch(
            [path], lambda: read_objectives_file(path), table.replace, on_error=self._refused,
            interval_s=interval_s, stamp=None)  # a file missing from the start is not news

    def _refused(self, e: Exception) -> None:
        if isinstance(e, FileNotFoundError):
            log.error("objectives file %s is missing; keeping %d objectives", self.path,
                      len(self.table.snapshot()))
        else:
            log.error("cannot load objectives file (keeping the previous ones): %s", e)

    def load_once(self) -> None:
        self._watch.check_sync()

    async def run(self) -> None:
        await self._watch.run()


def objectives_for_pool(items: list[dict[str, Any]], pool_name: str) -> dict[str, int]:
    """name -> priority of the InferenceObjectives whose poolRef names this pool; bad entries are skipped."""
    out: dict[str, int] = {}
    for it in items:
        spec = it.get("spec") or {}
        ref = spec.get("poolRef") or {}
        if ref.get("name") != pool_name or ref.get("kind", "InferencePool") != "InferencePool":
            continue
        name = (it.get("metadata") or {}).get("name")
        prio = spec.get("priority")
        if not isinstance(name, str):
            continue
        if prio is not None and type(prio) is not int:
            log.warning("InferenceObjective %s: priority %r is not an integer; ignored", name, prio)
            continue
        out[name] = prio or 0
    return out


class ObjectiveCrdPoller(CrdListPoller):
    """Lists the namespace's InferenceObjectives (both API groups) every `interval_s` and keeps those of our
    pool."""

    def __init__(self, table: ObjectiveTable, pool_name: str, namespace: str, *, kubeconfig: str | None = None,
                 interval_s: float = 10.0, api_client: Any = None) -> None:
        self.table = table
        self.pool_name = pool_name
        super().__init__("InferenceObjective", OBJECTIVE_GROUPS, OBJECTIVE_PLURAL, namespace,
                         apply=lambda items: table.replace(objectives_for_pool(items, pool_name)),
                         in_service=lambda: f"{len(table.snapshot())} known", kubeconfig=kubeconfig,
                         interval_s=interval_s, api_client=api_client)
