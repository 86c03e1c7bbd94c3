"""gRPC to the picker under test: one ext_proc stream per request, and gRPC health Check.

TLS is what GAIE's gateways speak to their picker, without verifying it (the picker's certificate is usually
self-signed). grpcio cannot switch verification off, so by default the checker reads the certificate the
picker presents and trusts exactly that one (trust on first use); `--ca` verifies against a CA instead and
`--plaintext` speaks h2c.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from cryptography import x509
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_extproc.conformance.protocol import BUFFERED, FULL_DUPLEX, Answer

__all__ = ["Connection", "Held", "TlsMode", "open_connection", "tls_handshake"]


@dataclass(frozen=True)
class TlsMode:
    plaintext: bool = False
    ca_pem: bytes | None = None  # None with TLS: trust the certificate the server presents


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _cert_name(pem: bytes) -> str | None:
    """A DNS name the certificate carries, for `ssl_target_name_override` (None: dial by address)."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = names.get_values_for_type(x509.DNSName)
        if dns:
            return dns[0]
    except x509.ExtensionNotFound:
        pass
    cn = cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)
    return str(cn[0].value) if cn else None


async def _channel(address: str, tls: TlsMode) -> grpc.aio.Channel:
    if tls.plaintext:
        return grpc.aio.insecure_channel(address)
    options: list[tuple[str, str]] = []
    ca = tls.ca_pem
    if ca is None:
        ca = (await asyncio.to_thread(ssl.get_server_certificate, _split(address), timeout=10)).encode()
        name = _cert_name(ca)
        if name:
            options.append(("grpc.ssl_target_name_override", name))
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), options=options)


@dataclass
class Held:
    """A request routed (or still waiting) whose stream is kept open: to the picker it is in flight, booked
    on its endpoint, as a long generation is. `release()` ends it as a gateway does when the client leaves."""

    answer: Answer
    call: grpc.aio.StreamStreamCall

    def release(self) -> None:
        self.call.cancel()


@dataclass(frozen=True)
class Handshake:
    version: str  # "TLSv1.3", ...
    alpn: str | None  # the protocol the server selected, None when it selected none


def _handshake(address: str, ca_pem: bytes | None, timeout_s: float) -> Handshake:
    """A TLS handshake offering ALPN h2 (and http/1.1, so a server that only knows that can say so)."""
    ctx = ssl.create_default_context(cadata=ca_pem.decode()) if ca_pem else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca_pem is None:  # trust on first use, as the channel does: the handshake's facts, not the identity
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.check_hostname = False  # the certificate's name is not the address dialled; the CA still verifies
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    host, port = _split(address)
    with socket.create_connection((host, port), timeout=timeout_s) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        return Handshake(str(tls.version()), tls.selected_alpn_protocol())


async def tls_handshake(address: str, tls: TlsMode, timeout_s: float) -> Handshake:
    return await asyncio.to_thread(_handshake, address, tls.ca_pem, timeout_s)


class Connection:
    """The picker's ext_proc port (and its health port, which may be the same)."""

    def __init__(self, extproc: grpc.aio.Channel, health: grpc.aio.Channel, timeout_s: float, *,
                 address: str = "", tls: TlsMode | None = None) -> None:
        self.address = address  # where the ext_proc port is, for checks below gRPC (the TLS handshake)
        self.tls = tls or TlsMode(plaintext=True)
        self._extproc = extproc
        self._health = health
        self.stub = pb_grpc.ExternalProcessorStub(extproc)
        self.health_stub = health_pb2_grpc.HealthStub(health)
        self.timeout_s = timeout_s

    async def close(self) -> None:
        await self._extproc.close()
        if self._health is not self._extproc:
            await self._health.close()

    async def exchange(self, first: pb.ProcessingRequest, rest: list[pb.ProcessingRequest],
                       then: Callable[[Answer], list[pb.ProcessingRequest]] | None = None) -> Answer:
        """Send one request as Envoy would and collect the request phase's answers, then end the stream (as a
        gateway does when its client goes away: a picker must free what it booked). `then(answer)`: messages of
        the response phase sent once the request was routed, each answer read (`Answer.after`)."""
        answer = Answer()
        mode = first.protocol_config.request_body_mode
        call = self.stub.Process(timeout=self.timeout_s + 5)
        try:
            async with asyncio.timeout(self.timeout_s):
                await call.write(first)
                if mode == _mode(BUFFERED):  # Envoy waits for the headers' answer before the body
                    if not await self._read(call, answer) or answer.immediate is not None:
                        return answer
                for m in rest:
                    await call.write(m)
                while await self._read(call, answer):
                    if _request_phase_done(answer, mode):
                        break
                if then is not None and answer.immediate is None and answer.responses:
                    for m in then(answer):
                        await call.write(m)
                        r = await call.read()
                        if r is grpc.aio.EOF:
                            break
                        answer.after.append(r)
        except TimeoutError:
            answer.timed_out = True
        except grpc.aio.AioRpcError as e:
            answer.grpc_error = f"{e.code().name}: {e.details()}"
        finally:
            call.cancel()
        return answer

    async def hold(self, first: pb.ProcessingRequest, rest: list[pb.ProcessingRequest],
                   wait_s: float) -> Held:
        """Send one FULL_DUPLEX_STREAMED request and keep its stream open; the answer is what came within
        `wait_s` (a picker that queues the request answers nothing yet: it is held all the same)."""
        answer = Answer()
        call = self.stub.Process(timeout=self.timeout_s + 60)
        held = Held(answer, call)
        try:
            async with asyncio.timeout(wait_s):
                await call.write(first)
                for m in rest:
                    await call.write(m)
                while await self._read(call, answer):
                    if _request_phase_done(answer, _mode(FULL_DUPLEX)):
                        break
        except TimeoutError:
            answer.timed_out = True
        except grpc.aio.AioRpcError as e:
            answer.grpc_error = f"{e.code().name}: {e.details()}"
        return held

    @staticmethod
    async def _read(call: grpc.aio.StreamStreamCall, answer: Answer) -> bool:
        r = await call.read()
        if r is grpc.aio.EOF:
            return False
        answer.responses.append(r)
        return True

    async def health(self, service: str) -> str:
        """The status name a health Check gives `service` (SERVING, NOT_SERVING, ...) or the gRPC error."""
        try:
            r = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                             timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            return f"gRPC {e.code().name}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _mode(name: str) -> int:
    return processing_mode_pb2.ProcessingMode.BodySendMode.Value(name)


def _request_phase_done(answer: Answer, mode: int) -> bool:
    last = answer.responses[-1]
    if last.HasField("immediate_response"):
        return True
    if last.WhichOneof("response") != "request_body":
        return False
    if mode != _mode(FULL_DUPLEX):
        return True  # BUFFERED: the one body answer
    return last.request_body.response.body_mutation.streamed_response.end_of_stream


async def open_connection(address: str, *, health_address: str | None = None, tls: TlsMode = TlsMode(),
                          health_tls: TlsMode | None = None, timeout_s: float = 10.0) -> Connection:
    """Channels to the picker; health defaults to the ext_proc port itself (GAIE's Envoy checks it there)."""
    extproc = await _channel(address, tls)
    if health_address is None or health_address == address:
        return Connection(extproc, extproc, timeout_s, address=address, tls=tls)
    return Connection(extproc, await _channel(health_address, health_tls or tls), timeout_s, address=address,
                      tls=tls)
