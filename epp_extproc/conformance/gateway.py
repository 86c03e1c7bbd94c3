"""`--envoy`: the real gateway the checker starts in front of the picker under test, and the stand-in workers.

Envoy is configured by the project's own generator (`epp_extproc.dev.envoy_config`, the configuration every
test and `make run` use) the way GAIE's gateways are: the ext_proc filter with `failure_mode_allow: false`,
FULL_DUPLEX_STREAMED bodies both ways (one Envoy) or BUFFERED requests (a second Envoy), the ORIGINAL_DST
`workers` cluster keyed on `x-gateway-destination-endpoint`, the `envoy.lb.subset_hint` and `envoy.lb`
namespaces forwarded. Two test-only additions: a request header `x-gateway-destination-endpoint-subset` is
copied into the subset-hint metadata (as a comma separated string, the form Envoy's header_to_metadata
writes), and the picker is not health-checked by Envoy (health is checked directly; GAIE's reference picker
serves it on another port).

The workers are tiny aiohttp servers bound to the pool's `ip:port` endpoints (any 127.0.0.0/8 address works
on Linux): each answers with a digest of the exact bytes it received and records the destination header it
was routed with, so a check can tell where a request went and whether its body arrived unchanged. A request
carrying `x-conformance-hold` is answered only when released: a long generation, for the shedding check. The
`decoy` is a worker outside the pool: a request that reaches it was routed by a client-sent destination.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from epp_extproc.dev import envoy_config, procs
from epp_extproc.gaie import DEST_HEADER, SUBSET_KEY

__all__ = ["ConformanceGateway", "GatewayError", "Received", "Worker", "HOLD_HEADER", "ID_HEADER", "SERVED_BY_HEADER"]

ID_HEADER = "x-conformance-id"  # names one request, so a worker's record can be matched to it
HOLD_HEADER = "x-conformance-hold"  # the worker answers only once the checker releases held requests
SERVED_BY_HEADER = "x-conformance-served-by"  # the worker's own address, on its answer
MAX_BODY = 16 * 1024 * 1024


class GatewayError(RuntimeError):
    """The checker could not set up its gateway (a --pool address it cannot bind, Envoy missing or failing)."""


@dataclass(frozen=True)
class Received:
    """One request as a worker saw it."""

    worker: str  # the worker's own ip:port
    request_id: str
    destination: str | None  # the x-gateway-destination-endpoint it was routed with
    sha256: str
    length: int


@dataclass
class Worker:
    address: str  # ip:port it binds
    received: list[Received] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    async def _handle(self, req: web.Request) -> web.StreamResponse:
        if req.method == "GET":  # a picker's health probe or metrics scrape: not traffic
            return web.Response(status=404 if req.path == "/metrics" else 200)
        body = await req.read()
        digest = hashlib.sha256(body).hexdigest()
        self.received.append(Received(self.address, req.headers.get(ID_HEADER, ""), req.headers.get(DEST_HEADER),
                                      digest, len(body)))
        if req.headers.get(HOLD_HEADER):
            await self.release.wait()
        return web.json_response({"served_by": self.address, "sha256": digest, "length": len(body),
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}]},
                                 headers={SERVED_BY_HEADER: self.address})

    async def start(self) -> None:
        host, _, port = self.address.rpartition(":")
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host.strip("[]"), int(port)).start()

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


@dataclass
class ConformanceGateway:
    """The workers, the decoy and one Envoy per body mode (plus one to the no-endpoints picker, if given)."""

    picker: str  # the picker's ext_proc HOST:PORT
    pool: list[str]
    plaintext: bool = False
    ca_file: str | None = None
    empty_picker: str | None = None
    workers: dict[str, Worker] = field(default_factory=dict)
    decoy: Worker | None = None
    urls: dict[str, str] = field(default_factory=dict)  # body mode (or "empty") -> the Envoy listener's URL
    _envoys: list[procs.Proc] = field(default_factory=list)
    _dir: Path | None = None

    async def start(self) -> ConformanceGateway:
        try:
            for address in self.pool:
                self.workers[address] = Worker(address)
                try:
                    await self.workers[address].start()
                except (OSError, ValueError) as e:
                    raise GatewayError(f"cannot serve a stand-in worker on {address} ({e}): --pool must name free "
                                       "local ip:port addresses, which the picker under test routes to") from None
            self.decoy = Worker(f"127.0.0.1:{procs.free_port()}")
            await self.decoy.start()
            self._dir = Path(tempfile.mkdtemp(prefix="epp-conformance-"))
            for mode in envoy_config.BODY_MODES:
                self.urls[mode] = await self._envoy(mode.lower(), self.picker, mode)
            if self.empty_picker:
                self.urls["empty"] = await self._envoy("empty", self.empty_picker, "FULL_DUPLEX_STREAMED")
        except BaseException:
            await self.stop()
            raise
        return self

    async def _envoy(self, name: str, picker: str, mode: str) -> str:
        host, _, port = picker.rpartition(":")
        opts = envoy_config.EnvoyOptions(
            listen_port=0, admin_port=0, picker_host=host.strip("[]"), picker_port=int(port), body_mode=mode,
            response_mode="echo", failure_mode_allow=False, forward_metadata=True, subset_hint_header=SUBSET_KEY,
            picker_tls=not self.plaintext, picker_tls_ca=self.ca_file, picker_health_check=False)
        assert self._dir is not None
        try:
            proc = procs.envoy(self._dir, opts, name=f"envoy-{name}")  # names the binary: EnvoyNotFound here
            self._envoys.append(proc)
            await asyncio.to_thread(proc.start, 60)
        except (RuntimeError, envoy_config.EnvoyNotFound) as e:
            raise GatewayError(f"Envoy ({name}) did not start: {e}") from None
        return f"http://127.0.0.1:{opts.listen_port}"

    def release_held(self) -> None:
        for w in self.workers.values():
            w.release.set()
            w.release = asyncio.Event()

    def received(self, request_id: str) -> list[Received]:
        """Every worker's (and the decoy's) record of one request."""
        everyone = [*self.workers.values(), *([self.decoy] if self.decoy else [])]
        return [r for w in everyone for r in w.received if r.request_id == request_id]

    async def stop(self) -> None:
        for p in self._envoys:
            await asyncio.to_thread(p.stop)
        self._envoys.clear()
        for w in [*self.workers.values(), *([self.decoy] if self.decoy else [])]:
            await w.stop()
        if self._dir is not None:  # the Envoys' configs and logs: no report names them, so none outlives a run
            await asyncio.to_thread(shutil.rmtree, self._dir, True)
            self._dir = None
