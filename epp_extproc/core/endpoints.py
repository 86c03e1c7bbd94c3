"""The set of worker endpoints the picker may name, and who wants to hear when it changes.

Every discovery source (static list, watched file, Kubernetes InferencePool) produces the same plain
`Endpoint` values and hands the full current set to `EndpointRegistry.replace`. The registry diffs it and
tells listeners (KV-event subscribers, load accounting) what was added and removed, so discovery code never
needs to know who consumes endpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One routable worker. `address` is what Envoy receives (`ip:port`, IPv6 as `[addr]:port`)."""

    name: str
    address: str
    kv_events: str | None = None  # ZMQ PUB endpoint, e.g. tcp://10.0.0.5:5557 (rank 0's with kv_ranks > 1)
    replay: str | None = None  # ZMQ ROUTER replay endpoint (rank 0's with kv_ranks > 1)
    labels: tuple[tuple[str, str], ...] = ()
    kv_ranks: int = 1  # data-parallel ranks: rank r publishes on kv_events' port + r (replay port + r)

    @property
    def kv_endpoints(self) -> tuple[tuple[int | None, str, str | None], ...]:
        """(rank, PUB endpoint, replay endpoint) per KV-event stream of this worker; rank None for a single
        stream.  TensorRT-LLM attention-DP, vLLM and SGLang bind rank r at base port + r (both sockets)."""
        if not self.kv_events:
            return ()
        if self.kv_ranks <= 1:
            return ((None, self.kv_events, self.replay),)
        return tuple((r, offset_port(self.kv_events, r), offset_port(self.replay, r) if self.replay else None)
                     for r in range(self.kv_ranks))

    @property
    def host(self) -> str:
        return split_host_port(self.address)[0]


def split_host_port(address: str) -> tuple[str, int]:
    """Split `ip:port` / `[v6]:port`; raises ValueError on anything else."""
    address = address.strip()
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            raise ValueError(f"bad address {address!r}")
    else:
        host, sep, port = address.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError(f"bad address {address!r}")
    p = int(port)
    if not 0 < p < 65536:
        raise ValueError(f"bad port in {address!r}")
    return host, p


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def offset_port(endpoint: str, n: int) -> str:
    """`tcp://host:port` with the port moved by `n` (the engines' per-rank rule); other schemes unchanged."""
    base, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        return endpoint
    return f"{base}:{int(port) + n}"


def zmq_tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


Listener = Callable[[list[Endpoint], list[Endpoint]], None]  # (added, removed)


class EndpointRegistry:
    """Current endpoints keyed by address; `synced` turns true after the first full set arrives.

    Discovery says which endpoints exist; the prober (endpoint_probe.py) says which of them answer. Only
    `routable()` ones are named to Envoy.
    """

    def __init__(self) -> None:
        self._by_address: dict[str, Endpoint] = {}
        self._listeners: list[Listener] = []
        self._down: set[str] = set()
        self.synced = False

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)
        if self._by_address:
            listener(list(self._by_address.values()), [])

    def replace(self, endpoints: Iterable[Endpoint]) -> tuple[list[Endpoint], list[Endpoint]]:
        new: dict[str, Endpoint] = {}
        for ep in endpoints:
            if ep.address in new:
                log.warning("duplicate endpoint address %s (%s and %s); keeping the first",
                            ep.address, new[ep.address].name, ep.name)
                continue
            new[ep.address] = ep
        removed = [ep for addr, ep in self._by_address.items() if new.get(addr) != ep]
        added = [ep for addr, ep in new.items() if self._by_address.get(addr) != ep]
        self._by_address = new
        self._down &= new.keys()
        self.synced = True
        if added or removed:
            log.info("endpoints changed: +%s -%s (now %d)", [e.name for e in added],
                     [e.name for e in removed], len(new))
            for listener in self._listeners:
                try:
                    listener(added, removed)
                except Exception:  # a broken listener must not stop discovery
                    log.exception("endpoint listener failed")
        return added, removed

    def set_healthy(self, address: str, healthy: bool) -> bool:
        """Record a probe verdict; returns True when it changed the endpoint's state."""
        if address not in self._by_address:
            return False
        was = address not in self._down
        if healthy:
            self._down.discard(address)
        else:
            self._down.add(address)
        return was != healthy

    def healthy(self, address: str) -> bool:
        return address in self._by_address and address not in self._down

    def routable(self) -> list[Endpoint]:
        """The endpoints the picker may name now: the healthy ones, or all of them when none is healthy
        (Envoy's panic mode: a probe outage must not take the whole pool out of rotation)."""
        up = [ep for addr, ep in self._by_address.items() if addr not in self._down]
        return up or list(self._by_address.values())

    def get(self, address: str) -> Endpoint | None:
        return self._by_address.get(address)

    def all(self) -> list[Endpoint]:
        return list(self._by_address.values())

    def __len__(self) -> int:
        return len(self._by_address)

    def __contains__(self, address: object) -> bool:
        return address in self._by_address
