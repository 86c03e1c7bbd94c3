"""The set of worker endpoints the picker may name, and who wants to hear when it changes.

Every discovery source (static list, watched file, Kubernetes InferencePool) produces the same plain
`Endpoint` values and hands the full current set to `EndpointRegistry.replace`. The registry diffs it and
tells listeners (KV-event subscribers, load accounting) what was added and removed, so discovery code never
needs to know who consumes endpoints.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from epp_extproc.core.contract import Role

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
    role: Role = Role.BOTH  # prefill / decode workers of a disaggregated pool; both = aggregated
    # llm-d's file-system connector PUB (its `storage_events_endpoint`, e.g. tcp://10.0.0.5:5559): the chunks
    # the worker writes to shared storage, a second subscription (kvindex/decode.py `decode_storage_payload`)
    kv_storage_events: str | None = None

    @property
    def decodes(self) -> bool:
        """May be a request's destination (decode, or aggregated)."""
        return self.role is not Role.PREFILL

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


_PORT = re.compile(r"[1-9][0-9]{0,4}")  # ASCII digits only: int() also takes "3_4001", "+80", " 80", "٨٠"
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
MAX_ADDRESS_CHARS = 64  # "[" + 45-char IPv6 text + "]:" + 5 digits fits; anything longer is not an address


# Role names as written in endpoint files, flags and pod labels. llm-d's values (llm-d-inference-scheduler
# pkg/epp/framework/plugins/scheduling/filter/bylabel/roles.go @520af47): `prefill`, `decode`, `prefill-decode`
# and the deprecated `both` (its decode filter keeps pods without the label); `encode-prefill` and
# `encode-prefill-decode` pass its prefill (and decode) filters, so they map to prefill and both. A pure
# `encode` worker serves neither phase and is refused (None) like any unknown value.
ROLE_NAMES: dict[str, Role] = {"both": Role.BOTH, "prefill-decode": Role.BOTH, "encode-prefill-decode": Role.BOTH,
                               "prefill": Role.PREFILL, "encode-prefill": Role.PREFILL, "decode": Role.DECODE}


def parse_role(value: object) -> Role | None:
    """A role name (case-insensitive); None for anything else."""
    if not isinstance(value, str):
        return None
    return ROLE_NAMES.get(value.strip().lower())


def clip(text: object, limit: int = 120) -> str:
    """`repr(text)` cut to `limit` characters: what discovery logs of a value a file or an API server sent."""
    r = repr(text)
    return r if len(r) <= limit else f"{r[:limit]}...({len(r)} chars)"


def split_host_port(address: str) -> tuple[str, int]:
    """Split an `ip:port` / `[v6]:port` literal; raises ValueError on anything Envoy could not route.

    The address is handed to Envoy verbatim (`x-gateway-destination-endpoint`), whose ORIGINAL_DST cluster
    accepts only numeric `ip:port`: so no host names (`localhost:8000`), no surrounding whitespace, no short
    IPv4 forms (`127.1`), no leading zeros, no IPv6 zone ids, no Python-only integer spellings in the port.
    """
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS or not address.isascii():
        raise ValueError(f"bad address {clip(address)}: want ip:port or [ipv6]:port")
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        v6 = True
    else:
        host, sep, port = address.rpartition(":")
        v6 = False
    if not sep or not _PORT.fullmatch(port) or int(port) > 65535:
        raise ValueError(f"bad address {clip(address)}: want ip:port or [ipv6]:port with a port 1-65535")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"bad address {clip(address)}: {clip(host)} is not an IP literal") from None
    if ip.version == 4 and v6:
        raise ValueError(f"bad address {clip(address)}: only IPv6 is bracketed")
    if ip.version == 6 and (not v6 or "%" in host):
        raise ValueError(f"bad address {clip(address)}: IPv6 must be bracketed ([addr]:port), without a zone id")
    if ip.is_unspecified or ip.is_multicast or ip == _BROADCAST:
        raise ValueError(f"bad address {clip(address)}: not a unicast address")  # 0.0.0.0 would mean "self"
    return host, int(port)


def parse_port(text: object) -> int:
    """A port 1-65535 written in plain ASCII digits (as `split_host_port` reads one); raises ValueError."""
    if not isinstance(text, str) or not _PORT.fullmatch(text) or int(text) > 65535:
        raise ValueError(f"bad port {clip(text)}: want 1-65535")
    return int(text)


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


def _names(eps: list[Endpoint], limit: int = 10) -> str:
    """At most `limit` clipped names: a 1,000-endpoint change is one short log line, not 100 kB."""
    shown = ", ".join(clip(e.name, 60) for e in eps[:limit])
    return f"[{shown}{f', ... +{len(eps) - limit} more' if len(eps) > limit else ''}]"


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
        self._prefill = 0  # prefill-only workers known: > 0 makes the pool disaggregated
        self._destinations: tuple[str, ...] | None = None  # destinations()' answer until the pool or a verdict changes
        self.synced = False

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)
        if self._by_address:
            listener(list(self._by_address.values()), [])

    def replace(self, endpoints: Iterable[Endpoint]) -> tuple[list[Endpoint], list[Endpoint]]:
        new: dict[str, Endpoint] = {}
        for ep in endpoints:
            try:
                split_host_port(ep.address)  # every source validates; this guards the ones that forget
            except ValueError as e:
                log.warning("ignoring endpoint %s: %s", clip(ep.name, 80), e)
                continue
            if ep.address in new:
                log.warning("duplicate endpoint address %s (%s and %s); keeping the first",
                            ep.address, clip(new[ep.address].name, 80), clip(ep.name, 80))
                continue
            new[ep.address] = ep
        removed = [ep for addr, ep in self._by_address.items() if new.get(addr) != ep]
        added = [ep for addr, ep in new.items() if self._by_address.get(addr) != ep]
        self._by_address = new
        self._prefill = sum(1 for ep in new.values() if ep.role is Role.PREFILL)
        self._down &= new.keys()
        self._destinations = None
        self.synced = True
        if added or removed:
            log.info("endpoints changed: +%s -%s (now %d)", _names(added), _names(removed), len(new))
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
        if was != healthy:
            self._destinations = None
        return was != healthy

    def healthy(self, address: str) -> bool:
        return address in self._by_address and address not in self._down

    def routable(self) -> list[Endpoint]:
        """The endpoints the picker may name now: the healthy ones, or all of them when none is healthy
        (Envoy's panic mode: a probe outage must not take the whole pool out of rotation)."""
        up = [ep for addr, ep in self._by_address.items() if addr not in self._down]
        return up or list(self._by_address.values())

    def destinations(self) -> tuple[str, ...]:
        """The addresses of the `routable()` endpoints that may be a request's destination (`decodes`). Every
        decision starts from it, so it is kept until the pool or a probe verdict changes (a thousand
        endpoints cost a decision 0.1 ms to filter again)."""
        d = self._destinations
        if d is None:
            d = self._destinations = tuple(ep.address for ep in self.routable() if ep.decodes)
        return d

    def has_prefill(self) -> bool:
        """Whether the pool is disaggregated: some known worker serves the prefill role only."""
        return self._prefill > 0

    def role_counts(self) -> dict[str, int]:
        """Known endpoints per role (every role named, 0s included: a gauge must drop to 0)."""
        counts = {r.value: 0 for r in Role}
        for ep in self._by_address.values():
            counts[ep.role.value] += 1
        return counts

    def get(self, address: str) -> Endpoint | None:
        return self._by_address.get(address)

    def all(self) -> list[Endpoint]:
        return list(self._by_address.values())

    def __len__(self) -> int:
        return len(self._by_address)

    def __contains__(self, address: object) -> bool:
        return address in self._by_address
