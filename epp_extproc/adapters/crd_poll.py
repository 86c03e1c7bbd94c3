"""Listing one namespaced custom resource on a period, for tables the picker keeps from Kubernetes
(InferenceObjectives, InferenceModelRewrites): an API that is down, RBAC that is missing or a CRD not installed
keeps what is in service and says so once, not at every poll."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class CrdListPoller:
    """Lists `plural` in `namespace` every `interval_s` and hands the items to `apply` (which keeps its pool's
    and says how many it keeps for the warning)."""

    def __init__(self, kind: str, group: str, version: str, plural: str, namespace: str, *,
                 apply: Callable[[list[dict[str, Any]]], None], in_service: Callable[[], str],
                 kubeconfig: str | None = None, interval_s: float = 10.0, api_client: Any = None) -> None:
        self.kind = kind
        self.resource = (group, version, plural)
        self.namespace = namespace
        self.kubeconfig = kubeconfig
        self.interval_s = interval_s
        self._apply = apply
        self._in_service = in_service
        self._api = api_client
        self._failing = False

    async def poll_once(self) -> bool:
        from kubernetes_asyncio import client as k8s_client

        if self._api is None:
            from epp_extproc.adapters.discovery_k8s import api_client

            self._api = await api_client(self.kubeconfig)
        group, version, plural = self.resource
        try:
            doc = await k8s_client.CustomObjectsApi(self._api).list_namespaced_custom_object(
                group, version, self.namespace, plural)
        except Exception as e:  # API down, RBAC missing, CRD not installed: keep what is in service
            if not self._failing:
                log.warning("cannot list %ss in %s (keeping %s): %s", self.kind, self.namespace,
                            self._in_service(), e)
            self._failing = True
            return False
        self._failing = False
        self._apply(list(doc.get("items") or []))
        return True

    async def run(self) -> None:
        try:
            while True:
                await self.poll_once()
                await asyncio.sleep(self.interval_s)
        finally:
            if self._api is not None:
                await self._api.close()
