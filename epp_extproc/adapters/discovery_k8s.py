"""Endpoints from a Gateway API Inference Extension InferencePool, kept current by list+watch.

The pool (`inference.networking.k8s.io/v1`) says which pods serve it (`selector.matchLabels`) and on which
ports (`targetPorts`). An endpoint is a selected pod that is Ready, not terminating and has an IP, times each
target port. We hand the whole set to `EndpointRegistry.replace` and let the registry diff it, so KV-event
subscribers open/close and a departed worker's index entries are dropped without this module knowing.

Why the list/watch loop is ours rather than `kubernetes_asyncio.watch.Watch`: that helper silently
reconnects once after a 410 with the same too-old resourceVersion, turns non-JSON error bodies into string
"events" and builds a second ApiClient of its own. A reflector must instead re-list on 410 (the only way not
to miss deletions), back off on errors, and never publish a half-synced set. We still use the maintained
client for everything below the event stream: config (in-cluster or kubeconfig), auth, TLS and URLs.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from epp_extproc.core.contract import Role
from epp_extproc.core.endpoints import (
    Endpoint,
    EndpointRegistry,
    clip,
    format_host_port,
    parse_port,
    parse_role,
    split_host_port,
    zmq_tcp,
)
from epp_extproc.core.logs import Throttled
from kvindex.backoff import Backoff

log = logging.getLogger(__name__)
_throttled = Throttled(log)
DEFAULT_ROLE_LABEL = "llm-d.ai/role"  # llm-d's RoleLabel (bylabel/roles.go); --role-label names another

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"
SERVICE_ACCOUNT_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

ApiClientFactory = Callable[[], "k8s_client.ApiClient | Awaitable[k8s_client.ApiClient]"]
Sleep = Callable[[float], Awaitable[None]]
OnError = Callable[[str, Exception], None]


class EndpointSink(Protocol):
    """What discovery publishes to: the picker's `EndpointRegistry`, or the P/D sidecar's allowlist, which
    reuses this reflector instead of keeping a second list+watch loop of its own."""

    def replace(self, endpoints: Iterable[Endpoint]) -> object: ...


class ResourceExpired(Exception):
    """The server no longer has the history we asked to watch from (HTTP/watch 410): re-list."""


def default_namespace(path: str = SERVICE_ACCOUNT_NAMESPACE_FILE) -> str:
    """The pod's own namespace when running in a cluster, so manifests need not repeat it; else "default"."""
    try:
        ns = Path(path).read_text().strip()
    except OSError:
        return "default"
    return ns or "default"


def selector_string(match_labels: Mapping[str, str]) -> str:
    """`matchLabels` as the labelSelector query parameter (`k=v,k2=v2`), sorted so it is stable."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def pod_is_serving(pod: Mapping[str, Any]) -> bool:
    """Ready, not terminating, has an IP: the three conditions under which traffic may be sent to a pod."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return False
    if not status.get("podIP"):
        return False
    for cond in status.get("conditions") or ():
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


KV_RANKS_ANNOTATION = "epp-extproc/kv-ranks"  # data-parallel ranks of the pod's engine (rank r on port + r)


def pod_kv_ranks(meta: Mapping[str, Any]) -> int:
    """The pod's `epp-extproc/kv-ranks` annotation (1 when absent or not an integer in 1..64)."""
    raw = (meta.get("annotations") or {}).get(KV_RANKS_ANNOTATION)
    try:
        n = int(raw) if raw is not None else 1
    except (TypeError, ValueError):
        n = 1
    return n if 1 <= n <= 64 else 1


KV_STORAGE_EVENTS_ANNOTATION = "epp-extproc/kv-storage-events"  # llm-d fs connector's storage_events_endpoint
_BIND_ALL = ("*", "0.0.0.0", "[::]")  # the connector binds its PUB: a copied bind address means the pod itself


def pod_kv_storage_events(meta: Mapping[str, Any], ip: str) -> str | None:
    """The pod's `epp-extproc/kv-storage-events` annotation as a ZeroMQ endpoint, or None when it is absent.

    The value names the PUB socket of llm-d's file-system connector in the pod (its `storage_events_endpoint`,
    `Endpoint.kv_storage_events`): a bare port (`5559`) is the pod's IP on that port, as the KV-event port is;
    `tcp://ip:port` names an address (an IP literal); `tcp://*:port` (the connector's bind form, also
    `0.0.0.0` and `[::]`) is the pod's IP. Anything else is ignored with a warning naming the pod: discovery
    never fails a pod over an annotation, the worker is still routed to, without the storage stream.
    """
    raw = (meta.get("annotations") or {}).get(KV_STORAGE_EVENTS_ANNOTATION)
    if raw is None:
        return None
    value = raw.strip() if isinstance(raw, str) else raw
    try:
        if not isinstance(value, str) or not value.isascii():
            raise ValueError("not a string")
        if value.startswith("tcp://"):
            host, sep, port = value[len("tcp://"):].rpartition(":")
            if sep and host in _BIND_ALL:
                value = port
            else:
                return zmq_tcp(*split_host_port(value[len("tcp://"):]))
        return zmq_tcp(ip, parse_port(value))
    except ValueError:
        name = clip(meta.get("name", "?"), 80)  # a pod's every status update recomputes it: once per pod a while
        _throttled.warning(f"kv-storage-events:{name}", "pod %s has annotation %s=%s, not a port, tcp://ip:port or "
                           "tcp://*:port; ignoring it (no storage-event stream for this pod)", name,
                           KV_STORAGE_EVENTS_ANNOTATION, clip(raw, 80))
        return None


def pod_role(meta: Mapping[str, Any], role_label: str) -> Role | None:
    """The pod's role from its `role_label` label (llm-d's `llm-d.ai/role` by default): none = both
    (llm-d's decode filter keeps unlabelled pods too); a value this picker cannot serve (encode, a typo) = None."""
    raw = (meta.get("labels") or {}).get(role_label)
    return Role.BOTH if raw is None else parse_role(raw)


def pod_endpoints(pod: Mapping[str, Any], ports: tuple[int, ...], kv_event_port: int,
                  replay_port: int | None, role_label: str = DEFAULT_ROLE_LABEL) -> list[Endpoint]:
    """One Endpoint per target port of a serving pod (none for a pod that is not serving)."""
    if not pod_is_serving(pod):
        return []
    meta = pod.get("metadata") or {}
    name = meta.get("name", "?")
    role = pod_role(meta, role_label)
    if role is None:
        _throttled.warning("unknown-role", "pod %s has label %s=%s, not prefill, decode or both; skipping it",
                           clip(name, 80), role_label, clip((meta.get("labels") or {}).get(role_label), 60))
        return []
    ip = pod["status"]["podIP"]
    try:
        if not isinstance(ip, str):
            raise ValueError("not a string")
        split_host_port(format_host_port(ip, 1))  # Envoy routes IP literals only (no names, no spaces)
    except ValueError:
        log.warning("pod %s has podIP %s, not an IP literal Envoy can route; skipping it", clip(name, 80),
                    clip(ip, 80))
        return []
    labels = tuple(sorted((meta.get("labels") or {}).items()))
    kv = zmq_tcp(ip, kv_event_port)
    replay = zmq_tcp(ip, replay_port) if replay_port else None
    storage = pod_kv_storage_events(meta, ip)
    return [
        Endpoint(name=name if len(ports) == 1 else f"{name}:{port}", address=format_host_port(ip, port),
                 kv_events=kv, replay=replay, labels=labels, kv_ranks=pod_kv_ranks(meta), role=role,
                 kv_storage_events=storage)
        for port in ports
    ]


def _labels_match(obj: Mapping[str, Any], match_labels: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in match_labels.items())


class InferencePoolDiscovery:
    """Watches one InferencePool and the pods it selects; publishes the endpoint set to a registry.

    Nothing is published before the pool and its pods have been listed once, so the registry's `synced`
    flag (gRPC readiness) stays false until the picker knows the real pool; after that every change is
    published. A selector edit restarts the pod watch and replaces the whole set once the new list is in.
    """

    def __init__(self, registry: EndpointRegistry | EndpointSink, pool_name: str, namespace: str | None, *,
                 kv_event_port: int = 5557, replay_port: int | None = None, kubeconfig: str | None = None,
                 role_label: str = DEFAULT_ROLE_LABEL,
                 api_client_factory: ApiClientFactory | None = None,
                 watch_timeout_s: float = 300.0, backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0,
                 sleep: Sleep = asyncio.sleep, rng: random.Random | None = None,
                 on_error: OnError | None = None) -> None:
        self.registry = registry
        self._on_error = on_error  # told of every failed list/watch (the sidecar counts them); never raises
        self.pool_name = pool_name
        self.namespace = namespace or default_namespace()
        self.kv_event_port = kv_event_port
        self.replay_port = replay_port
        self.role_label = role_label
        self.kubeconfig = kubeconfig
        self._factory = api_client_factory
        self._watch_timeout_s = watch_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._api: k8s_client.ApiClient | None = None
        # State of what we have seen. `_pool` is None both before the first list and when the pool is absent;
        # `_pool_synced` tells the two apart.
        self._pool: dict[str, Any] | None = None
        self._pool_synced = False
        self._match_labels: dict[str, str] | None = None
        self._ports: tuple[int, ...] = ()
        self._pods: dict[str, dict[str, Any]] = {}
        # Each selected pod's endpoints, computed when the pod (or the pool's ports) changes, not on every
        # publish: a publish per pod event that rebuilt every pod's endpoints cost O(pods) in IP parsing on the
        # event loop (about 8 ms per event at 1,000 pods, 40 ms at 4,096, measured for the P/D sidecar).
        self._pod_eps: dict[str, list[Endpoint]] = {}
        self._pods_synced = False
        self._pod_generation = 0
        self._pod_task: asyncio.Task[None] | None = None
        self._stale_tasks: set[asyncio.Task[None]] = set()
        self._published = False

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """List+watch until cancelled. API failures are retried with backoff, never raised."""
        self._api = await self._make_client()
        log.info("discovering endpoints from InferencePool %s/%s", self.namespace, self.pool_name)
        try:
            await self._reflect("InferencePool", self._pool_request, self._on_pool_list, self._on_pool_event)
        finally:
            await self._stop_pod_watch()
            await self._close_client()

    async def close(self) -> None:
        """Stop the pod watch and release the HTTP client (run() does this too when it is cancelled)."""
        await self._stop_pod_watch()
        await self._close_client()

    async def _make_client(self) -> k8s_client.ApiClient:
        if self._factory is not None:
            made = self._factory()
            return await made if inspect.isawaitable(made) else made
        return await api_client(self.kubeconfig)

    async def _close_client(self) -> None:
        api, self._api = self._api, None
        if api is not None:
            await api.close()

    # ------------------------------------------------------------------ requests

    def _pool_request(self, **kw: Any) -> Awaitable[Any]:
        assert self._api is not None
        return k8s_client.CustomObjectsApi(self._api).list_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL,
            field_selector=f"metadata.name={self.pool_name}", **kw)

    def _pod_request(self, label_selector: str) -> Callable[..., Awaitable[Any]]:
        def request(**kw: Any) -> Awaitable[Any]:
            assert self._api is not None
            return k8s_client.CoreV1Api(self._api).list_namespaced_pod(
                self.namespace, label_selector=label_selector, **kw)
        return request

    # ------------------------------------------------------------------ the reflector

    async def _reflect(self, what: str, request: Callable[..., Awaitable[Any]],
                       on_list: Callable[[list[dict[str, Any]]], None],
                       on_event: Callable[[str, dict[str, Any]], None]) -> None:
        """List, then watch from the list's resourceVersion; re-list on 410, back off on errors. Forever.

        The backoff resets only once a watch has worked (delivered an event or ran to its timeout), not on a
        successful list: a server whose lists succeed but whose watches fail must not be re-listed in a
        tight loop.
        """
        backoff = Backoff(self._backoff_initial_s, self._backoff_max_s, rng=self._rng.random)
        progress = backoff.succeeded

        while True:
            try:
                listing = await self._get_json(request(_preload_content=False))
                rv = (listing.get("metadata") or {}).get("resourceVersion", "")
                on_list(list(listing.get("items") or ()))
                while True:  # watch windows; each ends by server timeout or connection drop
                    rv = await self._watch_once(what, request, rv, on_event, progress)
                    progress()
            except asyncio.CancelledError:
                raise
            except ResourceExpired as e:
                log.info("%s watch expired (%s); re-listing", what, e)
                continue
            except Exception as e:  # API errors, connection refused, malformed answers: retry after backoff
                delay = backoff.failed()
                log.warning("%s list/watch in %s failed (%s: %s); retrying in %.2fs (attempt %d)", what,
                            self.namespace, type(e).__name__, clip(str(e), 300), delay, backoff.failures)
                if self._on_error is not None:
                    try:
                        self._on_error(what, e)
                    except Exception:  # a broken hook must not end the reflector: the last list stays
                        log.exception("%s list/watch error hook failed", what)
                await self._sleep(delay)

    async def _watch_once(self, what: str, request: Callable[..., Awaitable[Any]], rv: str,
                          on_event: Callable[[str, dict[str, Any]], None], progress: Callable[[], None]) -> str:
        """One watch request from `rv`; returns the newest resourceVersion seen. Calls `progress` per event."""
        # Server-side timeout with jitter (like client-go) so replicas do not reconnect in lockstep; the client
        # read timeout sits above it so a silently dead connection is still noticed.
        timeout = int(self._watch_timeout_s * (1 + self._rng.random()))
        resp = await request(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                             timeout_seconds=max(timeout, 1), _preload_content=False,
                             _request_timeout=aiohttp.ClientTimeout(connect=10, sock_read=timeout + 30))
        try:
            if resp.status == 410:
                raise ResourceExpired(await self._error_text(resp))
            if not 200 <= resp.status < 300:
                raise ApiException(status=resp.status, reason=await self._error_text(resp))
            while True:
                line = await resp.content.readline()
                if not line:
                    return rv  # server closed the window: watch again from rv
                if not line.strip():
                    continue
                event = json.loads(line)
                etype = event.get("type")
                obj = event.get("object") or {}
                if etype == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        raise ResourceExpired(obj.get("message", "Gone"))
                    raise ApiException(status=code or 500, reason=obj.get("message", "watch error"))
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if new_rv:
                    rv = new_rv
                progress()
                if etype == "BOOKMARK":
                    log.debug("%s bookmark at resourceVersion %s", what, rv)
                    continue
                if etype in ("ADDED", "MODIFIED", "DELETED"):
                    on_event(etype, obj)
                else:
                    log.warning("%s watch: ignoring unknown event type %s", what, clip(etype, 60))
        finally:
            resp.close()  # drop the connection: an unfinished stream must not go back to the pool

    @staticmethod
    async def _get_json(pending: Awaitable[Any]) -> dict[str, Any]:
        resp = await pending
        try:
            if resp.status == 410:
                raise ResourceExpired(await InferencePoolDiscovery._error_text(resp))
            if not 200 <= resp.status < 300:
                raise ApiException(status=resp.status, reason=await InferencePoolDiscovery._error_text(resp))
            data = json.loads(await resp.read())
        finally:
            resp.release()
        if not isinstance(data, dict):
            raise ValueError(f"list answer is not a JSON object: {type(data).__name__}")
        return data

    @staticmethod
    async def _error_text(resp: Any) -> str:
        body = (await resp.read()).decode("utf-8", "replace")
        try:
            status = json.loads(body)
            return f"HTTP {resp.status}: {status.get('reason', '')} {status.get('message', '')}".strip()
        except ValueError:
            return f"HTTP {resp.status}: {body[:200]}"

    # ------------------------------------------------------------------ the pool

    def _on_pool_list(self, items: list[dict[str, Any]]) -> None:
        pool = next((p for p in items if (p.get("metadata") or {}).get("name") == self.pool_name), None)
        self._pool_synced = True
        self._set_pool(pool)

    def _on_pool_event(self, etype: str, obj: dict[str, Any]) -> None:
        if (obj.get("metadata") or {}).get("name") != self.pool_name:
            return
        self._set_pool(None if etype == "DELETED" else obj)

    def _set_pool(self, pool: dict[str, Any] | None) -> None:
        existed = self._pool is not None
        self._pool = pool
        if pool is None:
            if existed or not self._published:
                log.error("InferencePool %s/%s %s: routing to NO endpoints until it exists", self.namespace,
                          self.pool_name, "was deleted" if existed else "does not exist")
            self._match_labels = None
            self._ports = ()
            self._start_pod_watch(None)
            self._publish()
            return
        spec = pool.get("spec") or {}
        match_labels = dict((spec.get("selector") or {}).get("matchLabels") or {})
        ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or () if "number" in p)
        if not match_labels:
            # An empty selector would select every pod in the namespace; the CRD forbids it, so refuse too.
            log.error("InferencePool %s/%s has an empty selector; routing to no endpoints", self.namespace,
                      self.pool_name)
        if match_labels != self._match_labels:
            log.info("InferencePool %s/%s selects pods %r on ports %s", self.namespace, self.pool_name,
                     selector_string(match_labels), list(ports))
            self._match_labels = match_labels
            self._ports = ports
            self._start_pod_watch(match_labels or None)
        elif ports != self._ports:
            log.info("InferencePool %s/%s target ports now %s", self.namespace, self.pool_name, list(ports))
            self._ports = ports
            self._pod_eps = {name: self._endpoints_of(pod) for name, pod in self._pods.items()}
        self._publish()

    # ------------------------------------------------------------------ the pods

    def _start_pod_watch(self, match_labels: dict[str, str] | None) -> None:
        """(Re)start the pod reflector for a new selector; None means no pods are wanted."""
        if self._pod_task is not None:
            self._pod_task.cancel()
            self._stale_tasks.add(self._pod_task)
            self._pod_task.add_done_callback(self._stale_tasks.discard)
            self._pod_task = None
        self._pod_generation += 1
        self._pods = {}
        self._pod_eps = {}
        self._pods_synced = match_labels is None
        if match_labels is None:
            return
        gen = self._pod_generation
        request = self._pod_request(selector_string(match_labels))
        self._pod_task = asyncio.create_task(self._reflect(
            "Pod", request,
            lambda items: self._on_pod_list(gen, items),
            lambda etype, obj: self._on_pod_event(gen, etype, obj)), name=f"pod-watch-{self.pool_name}")

    async def _stop_pod_watch(self) -> None:
        tasks = set(self._stale_tasks)
        if self._pod_task is not None:
            self._pod_task.cancel()
            tasks.add(self._pod_task)
            self._pod_task = None
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # pragma: no cover - the reflector does not raise, but never mask shutdown
                log.exception("pod watch ended with an error")

    def _on_pod_list(self, gen: int, items: list[dict[str, Any]]) -> None:
        if gen != self._pod_generation:
            return
        self._pods = {p["metadata"]["name"]: p for p in items if self._selected(p)}
        self._pod_eps = {name: self._endpoints_of(pod) for name, pod in self._pods.items()}
        self._pods_synced = True
        self._publish()

    def _on_pod_event(self, gen: int, etype: str, pod: dict[str, Any]) -> None:
        if gen != self._pod_generation:
            return
        name = (pod.get("metadata") or {}).get("name")
        if not name:
            return
        if etype == "DELETED" or not self._selected(pod):
            # A relabelled pod leaves the selection; a label-selected watch reports that as DELETED, but an
            # older or non-conforming server may send MODIFIED, so check the labels ourselves too.
            self._pods.pop(name, None)
            self._pod_eps.pop(name, None)
        else:
            self._pods[name] = pod
            self._pod_eps[name] = self._endpoints_of(pod)
        self._publish()

    def _selected(self, pod: Mapping[str, Any]) -> bool:
        return bool(self._match_labels) and _labels_match(pod, self._match_labels or {})

    # ------------------------------------------------------------------ publishing

    def endpoints(self) -> list[Endpoint]:
        """The endpoint set implied by what has been seen so far (sorted by name, for stable logs)."""
        if self._pool is None or not self._match_labels:
            return []
        return sorted((ep for eps in self._pod_eps.values() for ep in eps), key=lambda e: e.name)

    def _endpoints_of(self, pod: Mapping[str, Any]) -> list[Endpoint]:
        return pod_endpoints(pod, self._ports, self.kv_event_port, self.replay_port, self.role_label)

    def _publish(self) -> None:
        if not (self._pool_synced and self._pods_synced):
            return  # never hand the registry a half-listed pool: readiness must mean "knows the pool"
        first = not self._published
        self._published = True
        endpoints = self.endpoints()
        if first:
            log.info("InferencePool %s/%s first sync: %d endpoint(s) %s", self.namespace, self.pool_name,
                     len(endpoints), [e.name for e in endpoints[:10]] + (["..."] if len(endpoints) > 10 else []))
        self.registry.replace(endpoints)


async def api_client(kubeconfig: str | None) -> k8s_client.ApiClient:
    """An API client from a kubeconfig file (outside the cluster) or the pod's service account."""
    configuration = k8s_client.Configuration()
    if kubeconfig:
        await k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        k8s_config.load_incluster_config(client_configuration=configuration)
    return k8s_client.ApiClient(configuration)
