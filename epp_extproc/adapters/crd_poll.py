"""Listing one namespaced custom resource on a period, for tables the picker keeps from Kubernetes
(InferenceObjectives, InferenceModelRewrites): an API that is down, RBAC that is missing or a CRD not installed
keeps what is in service and says so once, not at every poll.

**Two API groups.** llm-d moved both kinds from GAIE's `inference.networking.x-k8s.io` to `llm-d.ai`
(llm-d/llm-d-router#1169, commit 0fb6a7c51e777f7a3c142e99fe823ae7b7151439, first released in v0.9.0; read at
v0.10.0, commit 71f4f0999f95b96c49a9d0c4afbd18dfdb943c26, `config/crd/bases/llm-d.ai_inferenceobjectives.yaml`
and `llm-d.ai_inferencemodelrewrites.yaml`). Both groups serve version `v1alpha2` with the same kinds, plurals
(`inferenceobjectives`, `inferencemodelrewrites`, namespaced) and fields; the one schema difference is that
llm-d's InferenceObjective declares `spec.priority` as `format: int32`. Clusters are mid-migration: a cluster may
carry the old CRD, the new one, or both. So the poller lists every group in `INFERENCE_API_GROUPS` and merges:

- objects from either group are honoured, so a half-migrated namespace keeps all its objectives and rewrites;
- the same `metadata.name` in both groups: the `llm-d.ai` object wins (it is the newer API, the migrated copy)
  whatever its poolRef, and the shadowed names are logged once per change, not at every poll. llm-d's own EPP
  (`pkg/epp/server/controller_config.go` at that commit) is stricter: when both CRDs are installed it reads
  only `llm-d.ai` and ignores every legacy object; merging keeps objects not yet copied over in service;
- a group whose CRD is not installed (a 404 before that group ever answered) is skipped after one info log and
  asked again at each poll, so a CRD installed later is picked up without a restart. A group that answered
  before and then fails (a 404 included) keeps its last objects, as one group always did: an outage must not
  drop every request to priority 0. Deleting a CRD whose objects still exist therefore takes effect at the
  next restart; delete the objects first (the list then answers empty) and the change is seen at the next poll;
- objects from the deprecated group are logged once (info), as llm-d's EPP logs a DEPRECATION for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

LLMD_GROUP = "llm-d.ai"
GAIE_X_GROUP = "inference.networking.x-k8s.io"  # deprecated by llm-d; still read
INFERENCE_API_VERSION = "v1alpha2"
# (group, version) in precedence order: an object found in an earlier group shadows one of the same name later.
INFERENCE_API_GROUPS: tuple[tuple[str, str], ...] = ((LLMD_GROUP, INFERENCE_API_VERSION),
                                                     (GAIE_X_GROUP, INFERENCE_API_VERSION))
DEPRECATED_GROUPS = frozenset({GAIE_X_GROUP})

_LISTED, _ABSENT, _FAILING = "listed", "absent", "failing"


def merge_by_name(listed: Sequence[tuple[str, list[dict[str, Any]]]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The objects of every group, the first group's object winning a name found in several (the groups come in
    precedence order), and the names that were shadowed. Objects without a name pass through untouched: the
    consumer's own validation reports them."""
    seen: set[str] = set()
    shadowed: set[str] = set()
    out: list[dict[str, Any]] = []
    for _group, items in listed:
        names = set()
        for it in items:
            name = (it.get("metadata") or {}).get("name") if isinstance(it, dict) else None
            if isinstance(name, str) and name in seen:
                shadowed.add(name)
                continue
            if isinstance(name, str):
                names.add(name)
            out.append(it)
        seen |= names
    return out, sorted(shadowed)


class CrdListPoller:
    """Lists `plural` in `namespace` in each of `groups` every `interval_s` and hands the merged items to
    `apply` (which keeps its pool's and says how many it keeps for the warning)."""

    def __init__(self, kind: str, groups: Sequence[tuple[str, str]], plural: str, namespace: str, *,
                 apply: Callable[[list[dict[str, Any]]], None], in_service: Callable[[], str],
                 kubeconfig: str | None = None, interval_s: float = 10.0, api_client: Any = None) -> None:
        if not groups:
            raise ValueError(f"{kind}: at least one API group to list")
        self.kind = kind
        self.groups = tuple(groups)
        self.plural = plural
        self.namespace = namespace
        self.kubeconfig = kubeconfig
        self.interval_s = interval_s
        self._apply = apply
        self._in_service = in_service
        self._api = api_client
        self._items: dict[str, list[dict[str, Any]]] = {}  # group -> its last list, once it has answered
        self._state: dict[str, str] = {}
        self._shadowed: list[str] = []
        self._deprecation_logged = False

    async def poll_once(self) -> bool:
        """One list per group, then one `apply` of the merge if any group answered. True when no group failed
        (a group whose CRD is not installed has not failed)."""
        from kubernetes_asyncio import client as k8s_client

        if self._api is None:
            from epp_extproc.adapters.discovery_k8s import api_client

            self._api = await api_client(self.kubeconfig)
        api = k8s_client.CustomObjectsApi(self._api)
        answered = failed = False
        for group, version in self.groups:
            try:
                doc = await api.list_namespaced_custom_object(group, version, self.namespace, self.plural)
            except Exception as e:  # API down, RBAC missing, CRD not installed: keep what is in service
                self._note_failure(group, version, e)
                failed |= self._state[group] == _FAILING
                continue
            if self._state.get(group) == _ABSENT:
                log.info("%s: %s/%s is served now; reading its %ss", self.kind, group, version, self.kind)
            self._state[group] = _LISTED
            self._items[group] = list(doc.get("items") or [])
            answered = True
        if answered:
            self._apply(self._merged())
        return not failed

    def _note_failure(self, group: str, version: str, e: Exception) -> None:
        """A 404 from a group that never answered is a CRD not installed (info, once); anything else, and a 404
        from a group that did answer, is a failure that keeps that group's last objects (warning, once)."""
        before = self._state.get(group)
        if getattr(e, "status", None) == 404 and group not in self._items:
            if before != _ABSENT:
                log.info("%s: no %s/%s CRD is installed (404); skipping that group, asking again every %gs",
                         self.kind, group, version, self.interval_s)
            self._state[group] = _ABSENT
            return
        if before != _FAILING:
            log.warning("cannot list %ss (%s/%s) in %s (keeping %s): %s", self.kind, group, version,
                        self.namespace, self._in_service(), e)
        self._state[group] = _FAILING

    def _merged(self) -> list[dict[str, Any]]:
        items, shadowed = merge_by_name([(g, self._items[g]) for g, _ in self.groups if g in self._items])
        if shadowed != self._shadowed:  # once per change, not every poll
            if shadowed:
                log.warning("%ss named %s exist in more than one API group; using the %s one (the first of %s)",
                            self.kind, ", ".join(shadowed), self.groups[0][0], [g for g, _ in self.groups])
            self._shadowed = shadowed
        if not self._deprecation_logged:
            old = sorted(g for g in DEPRECATED_GROUPS if self._items.get(g))
            if old:
                log.info("%ss are read from the deprecated API group %s; llm-d serves them under %s now",
                         self.kind, ", ".join(old), LLMD_GROUP)
                self._deprecation_logged = True
        return items

    async def run(self) -> None:
        try:
            while True:
                await self.poll_once()
                await asyncio.sleep(self.interval_s)
        finally:
            if self._api is not None:
                await self._api.close()
