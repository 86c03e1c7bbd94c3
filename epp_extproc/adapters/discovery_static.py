"""Endpoints from a flag or from a YAML/JSON file that is reloaded when it changes.

File format (YAML or JSON):

    endpoints:
      - name: worker-0
        address: 10.0.0.5:8000
        kv_events: tcp://10.0.0.5:5557   # optional, default tcp://<ip>:<DYN_EPP_KV_EVENT_PORT>
        replay: tcp://10.0.0.5:5558      # optional, default tcp://<ip>:<DYN_EPP_KV_EVENT_REPLAY_PORT> if set
        kv_ranks: 2                      # optional: data-parallel ranks, rank r on both ports + r
        role: decode                     # optional: prefill | decode | both (default; llm-d's names too)

A bare list of such entries (or of `ip:port` strings) is accepted too. The flag form is
`name=ip:port;kv=tcp://...;replay=tcp://...;kv_ranks=N;role=prefill;storage=tcp://...` entries separated by commas,
or plain `ip:port` (`storage`: llm-d's file-system connector's event PUB; `kv_storage_events` in a file).
Only `ip:port` literals (IPv6 as `[addr]:port`) are endpoints: that is all Envoy's ORIGINAL_DST cluster
can route (see `core.endpoints.split_host_port`).

A file that is empty, fails to parse, is larger than its byte cap (`file_byte_cap`), nests deeper than libyaml's
limit or lists more than `--max-endpoints` (`MAX_ENDPOINTS` by default) is logged and the previous set is kept: a half-written (truncated, even 0-byte)
file must not empty the pool. To empty it on purpose write `endpoints: []`. A file changed while it is read is
read again on the next poll. Reading and parsing run in a worker thread, so a large file costs the request
loop no stall (at most the GIL share a 1 MiB YAML parse takes, ~0.5 s of one thread).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
import yaml

from epp_extproc.core.contract import Role
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry, clip, parse_role, split_host_port, zmq_tcp
from epp_extproc.file_watch import FileWatch

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1024 * 1024  # the byte cap at the default MAX_ENDPOINTS (~20,000 entries in the verbose YAML form)
# --max-endpoints' default (Config.max_endpoints; a test keeps them equal): each endpoint costs a probe and a
# KV-event subscription (three ZeroMQ sockets, about four file descriptors, in whichever process ingests)
MAX_ENDPOINTS = 4096
BYTES_PER_ENDPOINT = 256  # past the default, a file may hold this much per endpoint allowed
_CAP_SETTING = "--max-endpoints (DYN_EPP_MAX_ENDPOINTS)"
MAX_NAME_CHARS = 253  # a DNS name / Kubernetes object name
# libyaml: iterative, and refuses nesting beyond 1,000 levels; PyYAML's pure-Python composer recurses and
# raises RecursionError at ~300 (600 brackets = 1.2 kB), which is also caught below.
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)



class EndpointSpecError(ValueError):
    pass


def parse_kv_ranks(value: object) -> int:
    """`kv_ranks`: a small positive int (each rank costs one subscription and one index slot)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise EndpointSpecError(f"kv_ranks must be an integer, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise EndpointSpecError(f"kv_ranks must be an integer, got {value!r}") from None
    if not 1 <= n <= MAX_KV_RANKS:
        raise EndpointSpecError(f"kv_ranks must be between 1 and {MAX_KV_RANKS}, got {n}")
    return n


MAX_KV_RANKS = 64


def parse_role_spec(value: object) -> Role:
    """`role`: prefill, decode or both (llm-d's `prefill-decode` too); absent = both (an aggregated worker)."""
    if value is None:
        return Role.BOTH
    role = parse_role(value)
    if role is None:
        raise EndpointSpecError(f"role must be prefill, decode or both, got {clip(value, 60)}")
    return role


def make_endpoint(name: str | None, address: str, kv_events: str | None, replay: str | None, *,
                  kv_event_port: int | None, replay_port: int | None, kv_ranks: object = 1,
                  role: object = None, storage: object = None) -> Endpoint:
    try:
        host, port = split_host_port(address)
    except ValueError as e:
        raise EndpointSpecError(str(e)) from None
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_CHARS):
        raise EndpointSpecError(f"endpoint {address}: name must be a string of at most {MAX_NAME_CHARS} "
                                f"characters, got {clip(name, 80)}")
    if kv_events is None and kv_event_port:
        kv_events = zmq_tcp(host, kv_event_port)
    if replay is None and replay_port:
        replay = zmq_tcp(host, replay_port)
    if storage is not None and (not isinstance(storage, str) or not storage.startswith(("tcp://", "ipc://"))
                                or len(storage) > MAX_NAME_CHARS):
        raise EndpointSpecError(f"endpoint {address}: kv_storage_events must be a tcp:// or ipc:// ZeroMQ "
                                f"endpoint, got {clip(storage, 80)}")
    return Endpoint(name or address, address, kv_events or None, replay or None,
                    kv_ranks=parse_kv_ranks(kv_ranks), role=parse_role_spec(role), kv_storage_events=storage or None)


def parse_flag(spec: str, *, kv_event_port: int | None, replay_port: int | None) -> list[Endpoint]:
    out: list[Endpoint] = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        parts = [p.strip() for p in item.split(";")]
        name, _, address = parts[0].rpartition("=")
        opts: dict[str, str] = {}
        for p in parts[1:]:
            k, sep, v = p.partition("=")
            if not sep or k not in ("kv", "replay", "kv_ranks", "role", "storage"):
                raise EndpointSpecError(f"bad endpoint option {clip(p, 60)} in {clip(item, 120)} "
                                        "(use kv=, replay=, kv_ranks=, role= or storage=)")
            opts[k] = v
        out.append(make_endpoint(name or None, address, opts.get("kv"), opts.get("replay"),
                                 kv_event_port=kv_event_port, replay_port=replay_port,
                                 kv_ranks=opts.get("kv_ranks", 1), role=opts.get("role"),
                                 storage=opts.get("storage")))
    return out


def file_byte_cap(max_endpoints: int = MAX_ENDPOINTS) -> int:
    """The most bytes an endpoints file may hold when it may list `max_endpoints`."""
    return max(MAX_FILE_BYTES, max_endpoints * BYTES_PER_ENDPOINT)


def parse_document(doc: Any, *, kv_event_port: int | None, replay_port: int | None,
                   max_endpoints: int = MAX_ENDPOINTS) -> list[Endpoint]:
    """The endpoints of a parsed file. No document (empty or comment-only file) and a mapping without an
    `endpoints` list are errors, not "zero endpoints": a truncated file looks exactly like that."""
    if doc is None:
        raise EndpointSpecError("the file holds no document (empty or half-written?); write `endpoints: []` "
                                "to empty the pool on purpose")
    if isinstance(doc, dict):
        if "endpoints" not in doc:
            raise EndpointSpecError("the file has no `endpoints:` key")
        doc = doc["endpoints"]
    if not isinstance(doc, list):
        raise EndpointSpecError("endpoints file must hold a list of endpoints (or {endpoints: [...]})")
    if len(doc) > max_endpoints:
        raise EndpointSpecError(f"{len(doc)} endpoints exceed the cap of {max_endpoints}: raise {_CAP_SETTING} "
                                "(each endpoint holds a KV-event subscription: about four file descriptors "
                                "where events are ingested, so `ulimit -n` with it)")
    out = []
    for i, item in enumerate(doc):
        if isinstance(item, str):
            out.append(make_endpoint(None, item, None, None, kv_event_port=kv_event_port,
                                     replay_port=replay_port))
            continue
        if not isinstance(item, dict) or not isinstance(item.get("address"), str):
            raise EndpointSpecError(f"endpoint #{i} needs an `address: ip:port`")
        out.append(make_endpoint(item.get("name"), item["address"], item.get("kv_events"), item.get("replay"),
                                 kv_event_port=kv_event_port, replay_port=replay_port,
                                 kv_ranks=item.get("kv_ranks", 1), role=item.get("role"),
                                 storage=item.get("kv_storage_events")))
    return out


def parse_bytes(raw: bytes, *, kv_event_port: int | None, replay_port: int | None,
                max_endpoints: int = MAX_ENDPOINTS) -> list[Endpoint]:
    """Parse a file's bytes: JSON with orjson (C, depth-limited) when it is JSON, else YAML with libyaml."""
    cap = file_byte_cap(max_endpoints)
    if len(raw) > cap:
        raise EndpointSpecError(f"the file exceeds the {cap}-byte cap (that of {max_endpoints} endpoints, "
                                f"{_CAP_SETTING})")
    if not raw.strip():
        return parse_document(None, kv_event_port=kv_event_port, replay_port=replay_port)
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:  # not JSON (or JSON nested past orjson's 1,024 levels): try YAML
        try:
            doc = yaml.load(raw, Loader=_YAML_LOADER)  # noqa: S506 - a safe loader (CSafeLoader/SafeLoader)
        except yaml.YAMLError as e:
            raise EndpointSpecError(f"not valid YAML/JSON: {clip(str(e), 300)}") from None
        except RecursionError:
            raise EndpointSpecError("the file nests too deeply to be an endpoints list") from None
    return parse_document(doc, kv_event_port=kv_event_port, replay_port=replay_port, max_endpoints=max_endpoints)


def read_capped(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """At most `limit` + 1 bytes of the file: a 5 GB file is refused after reading 1 MiB, not whole."""
    with open(path, "rb") as f:
        return f.read(limit + 1)


def read_file(path: str, *, kv_event_port: int | None, replay_port: int | None,
              max_endpoints: int = MAX_ENDPOINTS) -> list[Endpoint]:
    return parse_bytes(read_capped(path, file_byte_cap(max_endpoints)), kv_event_port=kv_event_port,
                       replay_port=replay_port, max_endpoints=max_endpoints)


class FileDiscovery:
    """Polls the file's (mtime, size, inode) and reloads on change; cheap and works on every filesystem.

    The polling is `file_watch.FileWatch` (the house's one file watcher): stat, read and parse run in a
    worker thread; only `registry.replace` runs on the loop. No error stops the polling: every failure is
    logged once per file version and the previous set is kept.
    """

    def __init__(self, registry: EndpointRegistry, path: str, *, kv_event_port: int | None,
                 replay_port: int | None, interval_s: float = 1.0, max_endpoints: int = MAX_ENDPOINTS) -> None:
        self.registry = registry
        self.max_endpoints = max_endpoints
        self.path = path
        self.kv_event_port = kv_event_port
        self.replay_port = replay_port
        self.interval_s = interval_s
        self._watch: FileWatch[list[Endpoint]] = FileWatch(
            [path], self._read, registry.replace, on_error=self._refused, interval_s=interval_s)

    @property
    def failures(self) -> int:
        """Reloads refused since start (a test and /debug can read it)."""
        return self._watch.failures

    def _read(self) -> list[Endpoint]:
        try:
            return read_file(self.path, kv_event_port=self.kv_event_port, replay_port=self.replay_port,
                             max_endpoints=self.max_endpoints)
        except FileNotFoundError:
            raise FileNotFoundError(f"endpoints file {clip(self.path)} is missing") from None

    def _refused(self, e: Exception) -> None:
        log.error("cannot load endpoints file %s (keeping the %d known endpoints): %s",
                  clip(self.path), len(self.registry), clip(str(e), 300))

    async def load_once(self) -> None:
        """Reload if the file changed; never raises (but a cancellation)."""
        await self._watch.check()

    async def run(self) -> None:
        await self._watch.run()
