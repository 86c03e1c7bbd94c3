"""A small fake Kubernetes API server that speaks the real list/watch JSON, for discovery tests.

Only what a pod + InferencePool reflector (and the InferenceObjective and InferenceModelRewrite pollers' lists, in
both API groups that serve them: llm-d's `llm-d.ai` and GAIE's `inference.networking.x-k8s.io`) touches is
implemented, but that part behaves like the real apiserver: one cluster-wide resourceVersion counter, list answers carrying `metadata.resourceVersion`, watch
streams of newline-delimited `{"type", "object"}` events replayed from a history after the requested version,
label- and field-selector filtering (an object that stops matching is reported as DELETED, one that starts
matching as ADDED), BOOKMARK events only to watchers that asked for them, `timeoutSeconds`, and 410 Gone for a
version older than the compacted history (as an ERROR event in a 200 stream, like the real server, or as an
HTTP 410). Test controls mutate objects, expire or stall watches, compact history, inject HTTP errors, hold
list answers and uninstall a CRD (its group then answers 404, as an apiserver without it does).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from kubernetes_asyncio import client as k8s_client

PODS = "pods"
POOLS = "inferencepools"
SLICES = "endpointslices"
OBJECTIVES = "inferenceobjectives"
REWRITES = "inferencemodelrewrites"
LLMD_OBJECTIVES = "inferenceobjectives.llm-d.ai"  # the same kinds in llm-d's group, a resource of their own here
LLMD_REWRITES = "inferencemodelrewrites.llm-d.ai"
OBJECTIVE_PREFIX = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/"
LLMD_PREFIX = "/apis/llm-d.ai/v1alpha2/namespaces/"
POOL_PREFIX = "/apis/inference.networking.k8s.io/v1/namespaces/"
SLICE_PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"
_KIND = {PODS: ("Pod", "v1"), POOLS: ("InferencePool", "inference.networking.k8s.io/v1"),
         SLICES: ("EndpointSlice", "discovery.k8s.io/v1"),
         OBJECTIVES: ("InferenceObjective", "inference.networking.x-k8s.io/v1alpha2"),
         REWRITES: ("InferenceModelRewrite", "inference.networking.x-k8s.io/v1alpha2"),
         LLMD_OBJECTIVES: ("InferenceObjective", "llm-d.ai/v1alpha2"),
         LLMD_REWRITES: ("InferenceModelRewrite", "llm-d.ai/v1alpha2")}


def parse_label_selector(sel: str) -> list[tuple[str, str, str]]:
    """`k=v,k==v,k!=v` terms (what our client sends, plus inequality so a bad parse cannot pass)."""
    terms = []
    for raw in filter(None, (t.strip() for t in sel.split(","))):
        for op in ("!=", "==", "="):
            if op in raw:
                k, _, v = raw.partition(op)
                terms.append((k.strip(), "!=" if op == "!=" else "=", v.strip()))
                break
        else:
            raise ValueError(f"unsupported selector term {raw!r}")
    return terms


def _matches(obj: dict[str, Any] | None, labels_sel: list[tuple[str, str, str]],
             fields_sel: list[tuple[str, str, str]]) -> bool:
    if obj is None:
        return False
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    for k, op, v in labels_sel:
        if (labels.get(k) == v) != (op == "="):
            return False
    for k, op, v in fields_sel:
        actual = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace")}.get(k)
        if (actual == v) != (op == "="):
            return False
    return True


@dataclass
class _Change:
    rv: int
    resource: str
    namespace: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None  # None = deleted; `before` is then the last state


@dataclass(eq=False)  # identity-hashed: kept in a set of open watches
class _Watch:
    resource: str
    namespace: str
    labels: list[tuple[str, str, str]]
    fields: list[tuple[str, str, str]]
    bookmarks: bool
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)

    def event_for(self, ch: _Change) -> dict[str, Any] | None:
        """The event this watcher sees for a change, or None; selector transitions become ADDED/DELETED."""
        if ch.resource != self.resource or ch.namespace != self.namespace:
            return None
        was = _matches(ch.before, self.labels, self.fields)
        now = _matches(ch.after, self.labels, self.fields)
        if ch.after is None:
            return {"type": "DELETED", "object": ch.before} if was else None
        if was and now:
            return {"type": "MODIFIED", "object": ch.after}
        if now:
            return {"type": "ADDED", "object": ch.after}
        if was:
            return {"type": "DELETED", "object": ch.after}
        return None


@dataclass
class Request:
    """One request the fake received, kept so tests can assert what the client asked for."""

    resource: str
    namespace: str
    query: dict[str, str]

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1", "True")


class FakeKube:
    """The fake apiserver. Use `async with FakeKube() as kube:`; `kube.api_client()` points a client at it."""

    def __init__(self) -> None:
        self.rv = 1000
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[_Change] = []
        self.compacted_rv = 0
        self.gone_as_http = False
        self.deliver = True
        self.requests: list[Request] = []
        self._watches: set[_Watch] = set()
        self._failures: list[tuple[str, int, bool]] = []
        self._holds: dict[str, asyncio.Event] = {}
        self.uninstalled: set[str] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ------------------------------------------------------------------ server lifecycle

    async def __aenter__(self) -> FakeKube:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._handle_pods)
        app.router.add_get(POOL_PREFIX + "{ns}/inferencepools", self._handle_pools)
        app.router.add_get(SLICE_PREFIX + "{ns}/endpointslices", self._handle_slices)
        app.router.add_get(OBJECTIVE_PREFIX + "{ns}/inferenceobjectives", self._handle_objectives)
        app.router.add_get(OBJECTIVE_PREFIX + "{ns}/inferencemodelrewrites", self._handle_rewrites)
        app.router.add_get(LLMD_PREFIX + "{ns}/inferenceobjectives", self._handle_llmd_objectives)
        app.router.add_get(LLMD_PREFIX + "{ns}/inferencemodelrewrites", self._handle_llmd_rewrites)
        app.router.add_route("*", "/{path:.*}", self._handle_unknown)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1,
                                     handler_cancellation=True)  # a client hang-up ends its watch
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.expire_watches()
        for ev in self._holds.values():
            ev.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def api_client(self) -> k8s_client.ApiClient:
        return k8s_client.ApiClient(k8s_client.Configuration(host=self.url))

    # ------------------------------------------------------------------ test controls

    def put(self, resource: str, obj: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        """Create or replace an object (ADDED or MODIFIED to watchers); returns the stored copy."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", namespace)
        key = (resource, meta["namespace"], meta["name"])
        before = self.objects.get(key)
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        meta.setdefault("uid", f"uid-{meta['name']}-{self.rv}")
        kind, api_version = _KIND[resource]
        obj.setdefault("kind", kind)
        obj.setdefault("apiVersion", api_version)
        self.objects[key] = obj
        self._record(_Change(self.rv, resource, meta["namespace"], before, copy.deepcopy(obj)))
        return obj

    def patch(self, resource: str, name: str, fn: Any, namespace: str = "default") -> dict[str, Any]:
        """Apply `fn(obj)` (mutating) to a copy of the stored object and store it as a modification."""
        obj = copy.deepcopy(self.objects[(resource, namespace, name)])
        fn(obj)
        return self.put(resource, obj, namespace)

    def delete(self, resource: str, name: str, namespace: str = "default") -> None:
        before = self.objects.pop((resource, namespace, name))
        self.rv += 1
        last = copy.deepcopy(before)
        last["metadata"]["resourceVersion"] = str(self.rv)
        self._record(_Change(self.rv, resource, namespace, last, None))

    def bookmark(self) -> int:
        """Send a BOOKMARK at the current resourceVersion to every watcher that allowed bookmarks."""
        self.rv += 1  # other resources moved on; the bookmark tells watchers where they may resume
        for w in self._watches:
            if w.bookmarks:
                kind, api_version = _KIND[w.resource]
                w.queue.put_nowait({"type": "BOOKMARK", "object": {
                    "kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": str(self.rv)}}})
        return self.rv

    def expire_watches(self) -> None:
        """End every open watch stream, as the server does when timeoutSeconds runs out."""
        for w in self._watches:
            w.queue.put_nowait(None)

    def compact(self) -> None:
        """Forget history up to now: a watch from an older resourceVersion gets 410 Gone."""
        self.compacted_rv = self.rv
        self.history.clear()

    def fail_next(self, count: int, status: int = 500, resource: str = PODS, *, watches_only: bool = False) -> None:
        """Answer the next `count` requests for `resource` (or only its watches) with an HTTP error + Status."""
        self._failures.extend([(resource, status, watches_only)] * count)

    def uninstall(self, resource: str) -> None:
        """Drop `resource`'s CRD: every request for it answers 404 (recorded, so a test can count them), the
        way an apiserver answers for a group or resource it does not serve."""
        self.uninstalled.add(resource)

    def hold_lists(self, resource: str) -> asyncio.Event:
        """Block list answers for `resource` until the returned event is set."""
        ev = self._holds[resource] = asyncio.Event()
        return ev

    def lists(self, resource: str) -> list[Request]:
        return [r for r in self.requests if r.resource == resource and not r.watch]

    def watches(self, resource: str) -> list[Request]:
        return [r for r in self.requests if r.resource == resource and r.watch]

    def open_watches(self, resource: str) -> int:
        return sum(1 for w in self._watches if w.resource == resource)

    # ------------------------------------------------------------------ internals

    def _record(self, ch: _Change) -> None:
        self.history.append(ch)
        if not self.deliver:
            return  # a stalled connection: these events are lost to current watchers
        for w in self._watches:
            ev = w.event_for(ch)
            if ev is not None:
                w.queue.put_nowait(copy.deepcopy(ev))

    @staticmethod
    def _status(code: int, reason: str, message: str) -> dict[str, Any]:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code}

    async def _handle_pods(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, PODS)

    async def _handle_pools(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, POOLS)

    async def _handle_slices(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, SLICES)

    async def _handle_objectives(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, OBJECTIVES)

    async def _handle_rewrites(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, REWRITES)

    async def _handle_llmd_objectives(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, LLMD_OBJECTIVES)

    async def _handle_llmd_rewrites(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, LLMD_REWRITES)

    async def _handle_unknown(self, request: web.Request) -> web.StreamResponse:
        """Anything else is recorded under its path (so a test sees what a client asked for) and answered 404."""
        self.requests.append(Request(request.path, "", dict(request.query)))
        return web.json_response(self._status(404, "NotFound", f"{request.method} {request.path}"), status=404)

    async def _handle(self, request: web.Request, resource: str) -> web.StreamResponse:
        ns = request.match_info["ns"]
        query = dict(request.query)
        req = Request(resource, ns, query)
        self.requests.append(req)
        if resource in self.uninstalled:
            return web.Response(status=404, text="404 page not found\n")  # the real apiserver's plain-text body
        for i, (res, status, watches_only) in enumerate(self._failures):
            if res == resource and (req.watch or not watches_only):
                del self._failures[i]
                return web.json_response(self._status(status, "InternalError", "injected failure"),
                                         status=status)
        try:
            labels = parse_label_selector(query.get("labelSelector", ""))
            fields = parse_label_selector(query.get("fieldSelector", ""))
        except ValueError as e:
            return web.json_response(self._status(400, "BadRequest", str(e)), status=400)
        if req.watch:
            return await self._watch(request, resource, ns, labels, fields, query)
        hold = self._holds.get(resource)
        if hold is not None:
            await hold.wait()
        kind, api_version = _KIND[resource]
        items = [copy.deepcopy(o) for (r, n, _), o in sorted(self.objects.items())
                 if r == resource and n == ns and _matches(o, labels, fields)]
        return web.json_response({"kind": f"{kind}List", "apiVersion": api_version,
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    def _backlog(self, w: _Watch, since: int) -> Iterator[dict[str, Any]]:
        for ch in self.history:
            if ch.rv > since:
                ev = w.event_for(ch)
                if ev is not None:
                    yield copy.deepcopy(ev)

    async def _watch(self, request: web.Request, resource: str, ns: str, labels: list[tuple[str, str, str]],
                     fields: list[tuple[str, str, str]], query: dict[str, str]) -> web.StreamResponse:
        since_raw = query.get("resourceVersion", "")
        since = int(since_raw) if since_raw else self.rv
        if since < self.compacted_rv:
            status = self._status(410, "Expired", f"too old resource version: {since} ({self.compacted_rv})")
            if self.gone_as_http:
                return web.json_response(status, status=410)
            resp = web.StreamResponse()
            resp.content_type = "application/json"
            await resp.prepare(request)
            await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            await resp.write_eof()
            return resp
        w = _Watch(resource, ns, labels, fields, query.get("allowWatchBookmarks") in ("true", "1", "True"))
        for ev in self._backlog(w, since):
            w.queue.put_nowait(ev)
        self._watches.add(w)
        resp = web.StreamResponse()
        resp.content_type = "application/json"
        await resp.prepare(request)
        timeout = float(query.get("timeoutSeconds", "1800"))
        try:
            async with asyncio.timeout(timeout):
                while True:
                    ev = await w.queue.get()
                    if ev is None:
                        break
                    await resp.write(json.dumps(ev).encode() + b"\n")
        except (TimeoutError, ConnectionResetError):
            pass
        finally:
            self._watches.discard(w)
        try:
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp


def make_pod(name: str, ip: str | None = "10.0.0.1", *, ready: bool = True,
             labels: dict[str, str] | None = None, terminating: bool = False) -> dict[str, Any]:
    """A pod object shaped like the apiserver's JSON (only the fields discovery reads, plus phase)."""
    meta: dict[str, Any] = {"name": name, "labels": dict(labels if labels is not None else {"app": "llm"})}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"},
    ]}
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {"metadata": meta, "spec": {"containers": [{"name": "worker", "image": "w"}]}, "status": status}


def make_pool(name: str = "llm-pool", match_labels: dict[str, str] | None = None,
              ports: tuple[int, ...] = (8000,)) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {
        "selector": {"matchLabels": dict(match_labels if match_labels is not None else {"app": "llm"})},
        "targetPorts": [{"number": p} for p in ports],
        "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
    }}


def make_slice(name: str, service: str, port: int, endpoints: list[tuple[str, bool, bool]],
               port_name: str = "replica-agg") -> dict[str, Any]:
    """An EndpointSlice of `service`: `endpoints` are (ip, ready, terminating)."""
    return {"metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready, "serving": ready,
                                                             "terminating": term}}
                          for ip, ready, term in endpoints]}
