"""One function per rule of the endpoint-picker protocol, each quoting the sentence it enforces.

The quotes are from GAIE's docs/proposals/004-endpoint-picker-protocol/README.md (commit 84436a96, protocol
v1.0.0) unless a check says otherwise. A check speaks to the picker only through `client.Connection` and
reads answers only through `protocol.Answer`, so any ext_proc picker can be checked. Each check looks at its
own rule only (the subset check does not care whether the metadata was set, the metadata check does not care
about subsets), so that a picker that breaks one rule fails exactly one check.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp_extproc.conformance.client import Connection, tls_handshake
from epp_extproc.conformance.protocol import (
    BUFFERED,
    FULL_DUPLEX,
    Answer,
    chat_body,
    first_endpoint,
    is_endpoint_list,
    request_messages,
    served_message,
)
from epp_extproc.gaie import DEST_HEADER, EXT_PROC_SERVICE

__all__ = ["CHECKS", "Check", "Probe", "Verdict", "destination_verdict"]

Level = Literal["MUST", "SHOULD"]
Status = Literal["pass", "fail", "skip"]
OUTSIDE = "192.0.2.1:1"  # RFC 5737 TEST-NET-1: in no pool, so a hint naming only it has an empty intersection
SPOOFED = "192.0.2.66:6666"  # what a client claims as its destination
LEARN_REQUESTS = 8  # requests without a hint, to see which endpoints the picker routes to
HINTED_REQUESTS = 3  # requests per hinted endpoint
HOLD_WAIT_S = 2.0  # how long a held request may take to be routed (a queued one is held all the same)


@dataclass(frozen=True)
class Verdict:
    status: Status
    why: str


def passed(why: str) -> Verdict:
    return Verdict("pass", why)


def failed(why: str) -> Verdict:
    return Verdict("fail", why)


def skipped(why: str) -> Verdict:
    return Verdict("skip", why)


@dataclass
class Probe:
    """What the checks share: the picker, options, and the endpoints it has been seen to route to."""

    conn: Connection
    model: str = "conformance"
    pool: list[str] = field(default_factory=list)  # --pool: endpoints known to be in the picker's pool
    empty: Connection | None = None  # --no-endpoints-target: a picker with no endpoints
    shed_headers: tuple[tuple[str, str], ...] = ()  # --shed-header: what makes a request sheddable
    hold: int = 0  # --hold: requests kept in flight before the sheddable one, to load the pool
    seen: set[str] = field(default_factory=set)

    async def request(self, mode: str = FULL_DUPLEX, *, headers: tuple[tuple[str, str], ...] = (),
                      subset: list[str] | None = None, conn: Connection | None = None,
                      then: Callable[[Answer], list[pb.ProcessingRequest]] | None = None) -> Answer:
        """One fresh request (a new prompt each time, so a prefix-aware picker is free to spread them)."""
        body = chat_body(self.model, salt=uuid.uuid4().hex)
        first, rest = request_messages(mode, body, headers=headers, subset=subset)
        answer = await (conn or self.conn).exchange(first, rest, then)
        if not headers and subset is None and conn is None:  # a plain request: whatever it names is the pool's
            for v in answer.destinations():
                if is_endpoint_list(v):
                    self.seen.add(first_endpoint(v))
        return answer


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    text: str  # the protocol sentence(s) it enforces
    run: Callable[[Probe], Awaitable[Verdict]]
    via: str = ""  # "Envoy": the same rule checked end to end through a real Envoy (envoy_checks)

    @property
    def label(self) -> str:
        return f"{self.name} via {self.via}" if self.via else self.name


def destination_verdict(answer: Answer) -> Verdict:
    """The destination MUSTs on one routed answer: header and `envoy.lb` metadata, one value, the same,
    in `ip:port[,ip:port...]` form."""
    if answer.grpc_error or answer.immediate is not None or answer.timed_out:
        return failed(f"not routed: {answer.summary()} (the checks need a picker with ready endpoints)")
    headers, meta = set(answer.header_values()), set(answer.metadata_values())
    if not headers:
        return failed(f"no `{DEST_HEADER}` header mutation; {answer.summary()}")
    if not meta:
        return failed(f"no `envoy.lb` / `{DEST_HEADER}` dynamic metadata; {answer.summary()}")
    if len(headers) > 1 or len(meta) > 1:
        return failed(f"several values: header {sorted(headers)}, metadata {sorted(meta)}")
    (h,), (m,) = headers, meta
    if h != m:
        return failed(f"header {h!r} and metadata {m!r} differ")
    if not is_endpoint_list(h):
        return failed(f"{h!r} is not `ip:port` or `ip:port,ip:port,...`")
    return passed(f"header and envoy.lb metadata both {h}")


async def streamed_destination(p: Probe) -> Verdict:
    return destination_verdict(await p.request(FULL_DUPLEX))


async def buffered_destination(p: Probe) -> Verdict:
    answer = await p.request(BUFFERED)
    if answer.grpc_error and answer.grpc_error.split(":")[0] in ("FAILED_PRECONDITION", "UNIMPLEMENTED"):
        return skipped(f"the picker refuses BUFFERED ({answer.grpc_error}); the protocol requires streaming only")
    return destination_verdict(answer)


async def client_destination_ignored(p: Probe) -> Verdict:
    answer = await p.request(FULL_DUPLEX, headers=((DEST_HEADER, SPOOFED),))
    if answer.grpc_error or answer.timed_out:
        return failed(answer.summary())
    if answer.immediate is not None:
        return passed(f"refused with ImmediateResponse {answer.immediate_status}: not routed to the client's "
                      "choice")
    for v in answer.destinations():
        if SPOOFED in (s.strip() for s in v.split(",")):
            return failed(f"the client's {DEST_HEADER}: {SPOOFED} became the destination ({answer.summary()})")
    removed = DEST_HEADER in answer.removed_headers()
    appended = [h for h in answer.header_sets() if h.HasField("append") and h.append.value]
    if not removed and not answer.header_sets():
        return failed(f"the client's {DEST_HEADER} is neither removed nor overwritten: the gateway routes on it")
    if not removed and appended:
        return failed(f"the destination is appended (append=true) to the client's {DEST_HEADER}, not replacing it")
    return passed(f"client value {'removed' if removed else 'overwritten'}; routed to "
                  f"{sorted(set(answer.destinations()))}")


async def served_endpoint_accepted(p: Probe) -> Verdict:
    def served(answer: Answer) -> list[pb.ProcessingRequest]:
        dest = answer.destinations()
        return [served_message(first_endpoint(dest[0]) if dest else OUTSIDE)]

    answer = await p.request(FULL_DUPLEX, then=served)
    if answer.grpc_error or answer.timed_out:
        return failed(f"after the gateway reported the served endpoint: {answer.summary()} (Envoy answers the "
                      "client 500 when the ext_proc stream fails)")
    if answer.immediate is not None or not answer.responses:
        return failed(f"not routed: {answer.summary()}")
    kinds = [r.WhichOneof("response") for r in answer.after]
    if kinds != ["response_headers"]:
        return failed(f"the response headers carrying the served endpoint were answered with {kinds or 'nothing'}")
    return passed("response headers with `envoy.lb` / `x-gateway-destination-endpoint-served` answered")


async def _learn(p: Probe) -> list[str]:
    """Endpoints to hint: --pool, else those the picker routed to (a few unhinted requests)."""
    if p.pool:
        return p.pool[:2]
    for _ in range(LEARN_REQUESTS):
        if len(p.seen) >= 2:
            break
        await p.request(FULL_DUPLEX)
    return sorted(p.seen)[:2]


async def subset_respected(p: Probe) -> Verdict:
    targets = await _learn(p)
    if not targets:
        return failed("the picker routed no request, so there is no endpoint to name in a hint")
    for target in targets:
        subset = [target, OUTSIDE]
        for _ in range(HINTED_REQUESTS):
            answer = await p.request(FULL_DUPLEX, subset=subset)
            if answer.grpc_error or answer.timed_out or answer.immediate is not None:
                return failed(f"hint {subset}: {answer.summary()}")
            picked = {s.strip() for v in answer.destinations() for s in v.split(",")}
            if not picked:
                return failed(f"hint {subset}: no destination at all ({answer.summary()})")
            if not picked <= {target}:
                return failed(f"hint {subset}: routed to {sorted(picked)}")
    weak = "" if len(targets) > 1 else " (only one endpoint seen: give --pool to hint others)"
    return passed(f"every hinted request went to the one pool endpoint in its hint {targets}{weak}")


async def _expect_503(p: Probe, subset: list[str]) -> Verdict:
    answer = await p.request(FULL_DUPLEX, subset=subset)
    if answer.immediate_status == 503:
        return passed(f"hint {subset}: ImmediateResponse 503")
    return failed(f"hint {subset}: {answer.summary()}")


async def subset_disjoint_503(p: Probe) -> Verdict:
    return await _expect_503(p, [OUTSIDE])


async def subset_empty_503(p: Probe) -> Verdict:
    return await _expect_503(p, [])


async def health_services(p: Probe) -> Verdict:
    got = {s: await p.conn.health(s) for s in ("liveness", "readiness", EXT_PROC_SERVICE)}
    bad = {s: v for s, v in got.items() if v != "SERVING"}
    if bad:
        return failed("; ".join(f"{s!r}: {v}" for s, v in bad.items()))
    return passed("liveness, readiness, " + EXT_PROC_SERVICE + ": SERVING")


async def health_overall(p: Probe) -> Verdict:
    v = await p.conn.health("")
    return passed('"": SERVING') if v == "SERVING" else failed(f'"": {v}')


async def no_endpoints_503(p: Probe) -> Verdict:
    if p.empty is None:
        return skipped("needs --no-endpoints-target: a picker with no endpoints (the checker cannot empty a live "
                       "pool)")
    answer = await p.request(FULL_DUPLEX, conn=p.empty)
    if answer.immediate_status == 503:
        return passed("ImmediateResponse 503")
    return failed(answer.summary())


async def shedding_429(p: Probe) -> Verdict:
    """A sheddable request is routed while there is room and gets 429 once `--hold` requests are in flight
    (held open, as long generations are). Without `--hold` the pool must already be saturated."""
    if not p.shed_headers:
        return skipped("needs --shed-header (what makes a request sheddable, e.g. `x-gateway-inference-objective: "
                       "NAME` of an InferenceObjective with priority < 0) and --hold N or a saturated pool")
    if p.hold:
        idle = await p.request(FULL_DUPLEX, headers=p.shed_headers)
        if idle.immediate is not None or idle.grpc_error or idle.timed_out:
            return failed(f"shed with no request held ({idle.summary()}): a 429 under load would not show "
                          "shedding, only refusing")
    held = []
    try:
        for _ in range(p.hold):
            body = chat_body(p.model, salt=uuid.uuid4().hex)
            first, rest = request_messages(FULL_DUPLEX, body)
            held.append(await p.conn.hold(first, rest, wait_s=min(p.conn.timeout_s, HOLD_WAIT_S)))
        answer = await p.request(FULL_DUPLEX, headers=p.shed_headers)
    finally:
        for h in held:
            h.release()
    load = f"{len(held)} held" if held else "the pool as it is"
    if answer.immediate_status == 429:
        return passed(f"routed while idle, ImmediateResponse 429 with {load}" if held else
                      f"ImmediateResponse 429 with {load}")
    return failed(f"with {load}: {answer.summary()}")


async def tls_h2(p: Probe) -> Verdict:
    if p.conn.tls.plaintext:
        return skipped("--plaintext: the picker is checked over h2c")
    try:
        hs = await tls_handshake(p.conn.address, p.conn.tls, p.conn.timeout_s)
    except (OSError, ValueError) as e:
        return failed(f"TLS handshake: {type(e).__name__}: {e}")
    if hs.version not in ("TLSv1.2", "TLSv1.3"):
        return failed(f"negotiated {hs.version}")
    if hs.alpn != "h2":
        return failed(f"ALPN offered h2, the picker selected {hs.alpn or 'nothing'} ({hs.version}): a gRPC client "
                      "that enforces ALPN (grpc-go since 1.67) refuses the connection")
    return passed(f"{hs.version}, ALPN h2")


_DEST = ("For each HTTP request, the EPP MUST communicate to the data plane one or more selected model server "
         "endpoints via: 1. Setting the `x-gateway-destination-endpoint` HTTP header [...] 2. Set an unstructured "
         "entry in the dynamic_metadata field [...] with a default of `envoy.lb`. [...] The EPP MUST not set two "
         "different values in the header and the inner response metadata value.")
_SUBSET_503 = ("If none of the endpoints in the list is eligible or the list is empty, then the EPP MUST return a "
               "ImmediateResponse with 503 (Service Unavailable) HTTP status code.")

CHECKS: tuple[Check, ...] = (
    Check("tls-h2", "MUST",
          "(RFC 9113 3.2, 9.2; the picker serves TLS unless started plaintext) A client that makes a request to an "
          "\"https\" URI uses TLS with the ALPN extension. [...] The \"h2\" string identifies the protocol where "
          "HTTP/2 uses TLS. [...] Implementations of HTTP/2 MUST use TLS version 1.2 or higher.", tls_h2),
    Check("streamed-destination", "MUST",
          "The EPP MUST support streaming mode for inference requests and responses. " + _DEST,
          streamed_destination),
    Check("buffered-destination", "MUST", "(BUFFERED, where the picker accepts it) " + _DEST, buffered_destination),
    Check("client-destination-ignored", "MUST",
          "If the key `x-gateway-destination-endpoint-subset` is not set, then the EPP MUST select from the set "
          "defined by the `InferencePool` selector. (A client-sent `x-gateway-destination-endpoint` must not "
          "choose.)", client_destination_ignored),
    Check("subset-disjoint-503", "MUST", _SUBSET_503, subset_disjoint_503),
    Check("subset-empty-503", "MUST", _SUBSET_503, subset_empty_503),
    Check("subset-respected", "MUST",
          "If the key `x-gateway-destination-endpoint-subset` is set, the EPP MUST only select endpoints from the "
          "specified list.", subset_respected),
    Check("served-endpoint-accepted", "SHOULD",
          "For each HTTP response, the data plane MUST communicate to the EPP the endpoint that served the request "
          "as follows: In the ext_proc ProcessingRequest.metadata_context field, a new metadata field "
          "\"x-gateway-destination-endpoint-served\" is added [...] with a default value of `envoy.lb`. (The EPP "
          "must take it: a failed stream turns the answer into a 500.)", served_endpoint_accepted),
    Check("health-services", "MUST",
          "The EPP MUST expose health check endpoints following the gRPC Health Checking Protocol. [...] "
          "`liveness`, `readiness`, `envoy.service.ext_proc.v3.ExternalProcessor`", health_services),
    Check("health-overall", "SHOULD",
          "(grpc/doc/health-checking.md) The server should register all the services manually and set the "
          "individual status, including an empty service name and its status.", health_overall),
    Check("no-endpoints-503", "MUST",
          "[...] it MUST return an error as follows: ImmediateResponse with 503 (Serivce Unavailable) HTTP "
          "status code if there are no ready endpoints.", no_endpoints_503),
    Check("shedding-429", "MUST",
          "[...] ImmediateResponse with 429 (Too Many Requests) HTTP status code if the request should be "
          "dropped (e.g., a Sheddable request, and the servers under heavy load).", shedding_429),
)
