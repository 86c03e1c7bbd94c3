"""Peer replicas on Kubernetes: the endpoints of the picker's own Service, by list+watch of its EndpointSlices.

A peer is every endpoint address of a slice labelled `kubernetes.io/service-name=<service>`, on the slice's
port named `replica-agg` (Dynamo's name, DYN_EPP_PEER_SERVICE), except this pod (POD_IP) and endpoints that
are terminating. Endpoints that are not Ready are peers too: a starting replica becomes Ready only after it
synced with its peers, so the peers must dial it before it is Ready. The list/watch loop (re-list on 410,
backoff, never publish before the first list) is the InferencePool reflector's, reused as is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kubernetes_asyncio import client as k8s_client

from epp_extproc.adapters.discovery_k8s import ApiClientFactory, InferencePoolDiscovery, default_namespace
from epp_extproc.core.endpoints import EndpointRegistry, format_host_port

log = logging.getLogger(__name__)

PEER_PORT_NAME = "replica-agg"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def slice_peers(eps: Mapping[str, Any], pod_ip: str | None, port_name: str = PEER_PORT_NAME) -> set[str]:
    """The sync targets (`ip:port`) one EndpointSlice names."""
    port = next((p.get("port") for p in eps.get("ports") or () if p.get("name") == port_name), None)
    if not isinstance(port, int):
        return set()
    out = set()
    for ep in eps.get("endpoints") or ():
        if (ep.get("conditions") or {}).get("terminating"):
            continue
        for addr in (ep.get("addresses") or ())[:1]:  # one address per endpoint (the others are the same pod)
            if isinstance(addr, str) and addr and addr != pod_ip:
                out.add(format_host_port(addr, port))
    return out


class PeerServiceDiscovery:
    """Calls `publish(targets)` with the full peer set after the first list and after every change."""

    def __init__(self, publish: Callable[[set[str]], None], service: str, namespace: str | None, *,
                 pod_ip: str | None = None, kubeconfig: str | None = None,
                 api_client_factory: ApiClientFactory | None = None, **reflector: Any) -> None:
        self.publish = publish
        self.service = service
        self.namespace = namespace or default_namespace()
        self.pod_ip = pod_ip
        if not pod_ip:
            log.warning("POD_IP is not set: this replica cannot tell itself apart in the peer service by "
                        "address (the sync handshake still refuses to sync with itself)")
        # The reflector machinery (client, list/watch, backoff) lives in the pool discovery; its registry is
        # unused here.
        self._k = InferencePoolDiscovery(EndpointRegistry(), service, self.namespace, kubeconfig=kubeconfig,
                                         api_client_factory=api_client_factory, **reflector)
        self._slices: dict[str, set[str]] = {}
        self._published: set[str] | None = None

    async def run(self) -> None:
        k = self._k
        k._api = await k._make_client()
        log.info("discovering peer replicas from Service %s/%s (port %s)", self.namespace, self.service,
                 PEER_PORT_NAME)
        try:
            await k._reflect("EndpointSlice", self._request, self._on_list, self._on_event)
        finally:
            await k._close_client()

    def _request(self, **kw: Any) -> Awaitable[Any]:
        assert self._k._api is not None
        return k8s_client.DiscoveryV1Api(self._k._api).list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={self.service}", **kw)

    def _on_list(self, items: list[dict[str, Any]]) -> None:
        self._slices = {(s.get("metadata") or {}).get("name", "?"): slice_peers(s, self.pod_ip) for s in items}
        self._emit()

    def _on_event(self, etype: str, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name", "?")
        if etype == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = slice_peers(obj, self.pod_ip)
        self._emit()

    def _emit(self) -> None:
        peers = set().union(*self._slices.values()) if self._slices else set()
        if peers != self._published:
            log.info("peer replicas: %s", sorted(peers) or "none")
            self._published = peers
            self.publish(peers)
