"""The prefill workers this sidecar may call: the static ``--allowed-prefillers`` united with the prefill pods of
an InferencePool, kept current by a watch (``--inference-pool``).

Why from the pool: pod IPs change on every rollout, so a hand-kept list of ``ip:port`` either refuses every new
prefill pod (403) or is an allowlist nobody maintains. llm-d's sidecar derives its SSRF allowlist from the pool:
llm-d/llm-d-router ``pkg/sidecar/proxy/allowlist.go`` at commit 33fe52b26ee8cf06c8edb4dfe8b4e9594b5bcd3b (read
for this module) runs an informer on the InferencePool by name (``metadata.name`` field selector), starts one on
the pods its ``spec.selector.matchLabels`` selects, and allows every selected pod that has a ``podIP`` on every
``spec.targetPorts[].number`` (plus ``podName:port``), rebuilding the set on every pod or pool event; a deleted
pool stops its pod informer and empties its part.

We do the same with the picker's own reflector (:class:`epp_extproc.adapters.discovery_k8s.InferencePoolDiscovery`,
reused so the sidecar and the picker agree on what "the pool" is and share one list/watch implementation: 410
re-lists, backoff, selector changes), and allow less than llm-d does, each for a reason:

- only **serving** pods (Ready, not terminating, an IP literal): the picker never names another, so a pod that
  stops being ready is refused until it is ready again (llm-d allows any pod that has an IP);
- only pods whose role label (``llm-d.ai/role`` by default) says **prefill**: the picker names nothing else in
  ``x-prefiller-host-port``, and a decode pod's target port is its own sidecar (one sidecar sending a prefill
  leg to another is a loop, not a prefill);
- no ``podName:port`` entries: the header must be an IP literal here (``target.py``), there is nothing to resolve;
- at most ``cap`` entries from the pool (``--max-allowed-prefillers``): a pool that grows past it cannot grow the
  sidecar's memory or log lines without bound; the entries past the cap (by pod name) are refused and counted.

Failures: a list or watch that fails keeps the last published set (the reflector publishes only complete lists)
and is counted in ``pd_sidecar_allowlist_watch_errors_total``; the reflector retries with backoff. Everything
runs as one task on the sidecar's event loop and only awaits I/O; a rebuild is O(selected pods).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from epp_extproc.core.contract import Role
from epp_extproc.core.endpoints import Endpoint

from .metrics import SidecarMetrics
from .target import canonical

if TYPE_CHECKING:
    from epp_extproc.adapters.discovery_k8s import InferencePoolDiscovery

log = logging.getLogger("epp_extproc.pd_sidecar.allowlist")

DEFAULT_MAX_ALLOWED = 4096  # pool entries kept (--max-allowed-prefillers); far above any prefill tier we know of
DEFAULT_ROLE_LABEL = "llm-d.ai/role"  # the picker's --role-label default (discovery_k8s.DEFAULT_ROLE_LABEL)
CLIENT_RETRY_S = 30.0  # a client that could not be built (no kubeconfig, not in a cluster) is retried this often
LOGGED_NAMES = 10  # joined/left entries named per log line


def parse_pool_ref(spec: str) -> tuple[str | None, str]:
    """``[namespace/]name``, llm-d's ``--inference-pool`` form; the namespace is None when not given (the
    sidecar then watches its own pod's namespace, where a namespace-agnostic manifest puts the pool)."""
    ns, sep, name = spec.strip().rpartition("/")
    if not name or (sep and not ns) or "/" in ns:
        raise ValueError(f"--inference-pool {spec!r} is not NAME or NAMESPACE/NAME")
    return (ns or None), name


def _names(entries: Iterable[str]) -> list[str]:
    items = sorted(entries)
    return items[:LOGGED_NAMES] + ([f"... {len(items) - LOGGED_NAMES} more"] if len(items) > LOGGED_NAMES else [])


class Allowlist:
    """The set the request path checks (``current``), swapped whole on every change so a check never sees a
    half-built set. ``replace`` is the sink :class:`InferencePoolDiscovery` publishes to (as it does to the
    picker's endpoint registry)."""

    def __init__(self, static: frozenset[str] = frozenset(), *, cap: int = DEFAULT_MAX_ALLOWED,
                 metrics: SidecarMetrics | None = None, from_pool: bool = False) -> None:
        if cap < 1:
            raise ValueError(f"--max-allowed-prefillers must be at least 1, got {cap}")
        self.static = static
        self.cap = cap
        self.metrics = metrics
        self.pool: frozenset[str] = frozenset()
        self.current: frozenset[str] = static
        # Without a pool there is nothing to wait for; with one, the sidecar is not ready until the pool and its
        # pods have been listed once (a decode pod that answered 403 to the picker's first prefill pick is worse
        # than one that joins the pool a moment later).
        self.synced = not from_pool
        self.over_cap = 0
        # address -> canonical entry, from the previous rebuild: a pod event re-canonicalises only the addresses
        # it brought (parsing every address on every event was most of a rebuild's cost); holds this pool only
        self._canonical: dict[str, str | None] = {}
        if metrics is not None:
            metrics.allowed.labels("static").set(len(static))
            metrics.allowed.labels("pool").set(0)
            metrics.allowlist_synced.set(1 if self.synced else 0)

    def replace(self, endpoints: Iterable[Endpoint]) -> None:
        """The pool's serving endpoints as discovery sees them now: keep the prefill ones, up to the cap."""
        kept: dict[str, None] = {}
        over = 0
        known, seen = self._canonical, dict[str, str | None]()
        for ep in endpoints:  # discovery hands them sorted by pod name: the cap keeps the same ones each time
            if ep.role is not Role.PREFILL:
                continue
            entry = seen[ep.address] = known[ep.address] if ep.address in known else canonical(ep.address)
            if entry is None or entry in kept:
                continue
            if len(kept) >= self.cap:
                over += 1
                continue
            kept[entry] = None
        self._canonical = seen
        new = frozenset(kept)
        joined, left = new - self.pool, self.pool - new
        first = not self.synced
        self.pool = new
        self.current = self.static | new
        self.synced = True
        if over and over != self.over_cap:
            log.warning("the pool has %d prefill entries past --max-allowed-prefillers=%d: they are refused",
                        over, self.cap)
        self.over_cap = over
        if first:
            log.info("allowlist synced from the pool: %d prefill worker(s) %s", len(new), _names(new))
        elif joined or left:
            log.info("allowlist: allowed %s, refused again %s (%d from the pool)", _names(joined), _names(left),
                     len(new))
        m = self.metrics
        if m is not None:
            m.allowlist_updates.inc()
            m.allowed.labels("pool").set(len(new))
            m.allowlist_over_cap.set(over)
            m.allowlist_synced.set(1)

    def watch_failed(self, resource: str, error: Exception) -> None:
        """A failed list/watch (the reflector logged it and retries): count it; the current set stays."""
        if self.metrics is not None:
            self.metrics.allowlist_watch_errors.labels(resource.lower()).inc()


class PoolWatch:
    """Runs the pool reflector for an :class:`Allowlist` as one task, started and stopped with the sidecar."""

    def __init__(self, allowlist: Allowlist, pool: str, namespace: str | None = None, *,
                 role_label: str = DEFAULT_ROLE_LABEL, kubeconfig: str | None = None,
                 api_client_factory: Callable[[], Any] | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, **discovery_kw: Any) -> None:
        # imported here: kubernetes_asyncio is loaded only by a sidecar that watches a pool
        from epp_extproc.adapters.discovery_k8s import InferencePoolDiscovery

        self.allowlist = allowlist
        self._sleep = sleep
        self.discovery: InferencePoolDiscovery = InferencePoolDiscovery(
            allowlist, pool, namespace, kubeconfig=kubeconfig, role_label=role_label,
            api_client_factory=api_client_factory, on_error=allowlist.watch_failed, sleep=sleep, **discovery_kw)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pd-allowlist-{self.discovery.pool_name}")

    async def _run(self) -> None:
        """The reflector retries API failures itself; what ends ``run()`` is a client that could not be built
        (no kubeconfig outside a cluster, an unreadable service-account token): log, count, try again later,
        and stay unready meanwhile rather than die silently."""
        while True:
            try:
                await self.discovery.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.error("cannot watch InferencePool %s/%s (%s: %s); retrying in %.0fs",
                          self.discovery.namespace, self.discovery.pool_name, type(e).__name__, e, CLIENT_RETRY_S)
                self.allowlist.watch_failed("client", e)
                await self._sleep(CLIENT_RETRY_S)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self.discovery.close()
