"""Endpoints from a flag or from a YAML/JSON file that is reloaded when it changes.

File format (YAML or JSON):

    endpoints:
      - name: worker-0
        address: 10.0.0.5:8000
        kv_events: tcp://10.0.0.5:5557   # optional, default tcp://<ip>:<DYN_EPP_KV_EVENT_PORT>
        replay: tcp://10.0.0.5:5558      # optional, default tcp://<ip>:<DYN_EPP_KV_EVENT_REPLAY_PORT> if set
        kv_ranks: 2                      # optional: data-parallel ranks, rank r on both ports + r

A bare list of such entries (or of `ip:port` strings) is accepted too. The flag form is
`name=ip:port;kv=tcp://...;replay=tcp://...;kv_ranks=N` entries separated by commas, or plain `ip:port`.
A file that fails to parse on reload is logged and the previous set is kept: a half-written file must not
empty the pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import yaml

from epp_extproc.core.endpoints import Endpoint, EndpointRegistry, split_host_port, zmq_tcp

log = logging.getLogger(__name__)


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


def make_endpoint(name: str | None, address: str, kv_events: str | None, replay: str | None, *,
                  kv_event_port: int | None, replay_port: int | None, kv_ranks: object = 1) -> Endpoint:
    try:
        host, port = split_host_port(address)
    except ValueError as e:
        raise EndpointSpecError(str(e)) from None
    if kv_events is None and kv_event_port:
        kv_events = zmq_tcp(host, kv_event_port)
    if replay is None and replay_port:
        replay = zmq_tcp(host, replay_port)
    return Endpoint(name or address, address, kv_events or None, replay or None,
                    kv_ranks=parse_kv_ranks(kv_ranks))


def parse_flag(spec: str, *, kv_event_port: int | None, replay_port: int | None) -> list[Endpoint]:
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        parts = [p.strip() for p in item.split(";")]
        name, _, address = parts[0].rpartition("=")
        opts: dict[str, str] = {}
        for p in parts[1:]:
            k, sep, v = p.partition("=")
            if not sep or k not in ("kv", "replay", "kv_ranks"):
                raise EndpointSpecError(f"bad endpoint option {p!r} in {item!r} (use kv=, replay= or kv_ranks=)")
            opts[k] = v
        out.append(make_endpoint(name or None, address, opts.get("kv"), opts.get("replay"),
                                 kv_event_port=kv_event_port, replay_port=replay_port,
                                 kv_ranks=opts.get("kv_ranks", 1)))
    return out


def parse_document(doc: Any, *, kv_event_port: int | None, replay_port: int | None) -> list[Endpoint]:
    if isinstance(doc, dict):
        doc = doc.get("endpoints", [])
    if doc is None:
        return []
    if not isinstance(doc, list):
        raise EndpointSpecError("endpoints file must hold a list of endpoints (or {endpoints: [...]})")
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
                                 kv_ranks=item.get("kv_ranks", 1)))
    return out


def read_file(path: str, *, kv_event_port: int | None, replay_port: int | None) -> list[Endpoint]:
    with open(path, encoding="utf-8") as f:
        try:
            doc = yaml.safe_load(f)  # JSON is YAML
        except yaml.YAMLError as e:
            raise EndpointSpecError(f"{path}: {e}") from None
    return parse_document(doc, kv_event_port=kv_event_port, replay_port=replay_port)


class FileDiscovery:
    """Polls the file's (mtime, size, inode) and reloads on change; cheap and works on every filesystem."""

    def __init__(self, registry: EndpointRegistry, path: str, *, kv_event_port: int | None,
                 replay_port: int | None, interval_s: float = 1.0) -> None:
        self.registry = registry
        self.path = path
        self.kv_event_port = kv_event_port
        self.replay_port = replay_port
        self.interval_s = interval_s
        self._stamp: tuple[float, int, int] | None = None

    def _stat(self) -> tuple[float, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime, st.st_size, st.st_ino)

    def load_once(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        if stamp is None:
            log.error("endpoints file %s is missing; keeping %d known endpoints", self.path, len(self.registry))
            return
        try:
            eps = read_file(self.path, kv_event_port=self.kv_event_port, replay_port=self.replay_port)
        except (OSError, EndpointSpecError) as e:
            log.error("cannot load endpoints file (keeping the previous set): %s", e)
            return
        self.registry.replace(eps)

    async def run(self) -> None:
        while True:
            self.load_once()
            await asyncio.sleep(self.interval_s)
