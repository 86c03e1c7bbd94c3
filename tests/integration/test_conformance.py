"""`epp-extproc conformance`: this picker passes every MUST, and every MUST check can fail.

Against this picker (in-process, plaintext and TLS, both body modes), then against `fake_picker.FakePicker`
broken one rule at a time: each broken picker must fail exactly the check for its rule and pass the others.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.conformance.checks import CHECKS, Probe
from epp_extproc.conformance.client import TlsMode, open_connection
from epp_extproc.conformance.report import Row, exit_code
from epp_extproc.conformance.runner import check_picker, main
from epp_extproc.envoy.tls import ServerCert, self_signed
from tests.integration.fake_picker import SHED_HEADER, Break, start_fake

pytestmark = pytest.mark.transport  # also run on --extproc-transport grpcio by `make test`

POOL = ["127.0.0.1:9", "127.0.0.1:10"]
MUSTS = {c.name for c in CHECKS if c.level == "MUST"}
CONDITIONAL = {"no-endpoints-503", "shedding-429", "tls-h2"}  # skipped unless the checker is given their condition
SHED = (SHED_HEADER,)  # what makes a request sheddable, to the fake and (objectives file) to this picker


def picker_config(**kw: object) -> Config:
    base = dict(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                endpoints="a=127.0.0.1:9,b=127.0.0.1:10", endpoint_probe_interval_ms=0, secure_serving=False)
    return Config(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture
async def this_picker() -> AsyncIterator[PickerApp]:
    app = PickerApp(picker_config())
    await app.start()
    yield app
    await app.stop(grace=0.5)


async def run_checks(port: int, *, empty_port: int | None = None, tls: TlsMode | None = None,
                     health_port: int | None = None, shed: tuple[tuple[str, str], ...] = (),
                     hold: int = 0) -> dict[str, Row]:
    tls = tls or TlsMode(plaintext=True)
    conn = await open_connection(f"127.0.0.1:{port}", tls=tls, timeout_s=5,
                                 health_address=None if health_port is None else f"127.0.0.1:{health_port}",
                                 health_tls=TlsMode(plaintext=True))
    empty = None if empty_port is None else await open_connection(f"127.0.0.1:{empty_port}", tls=tls, timeout_s=5)
    try:
        rows = await check_picker(Probe(conn, empty=empty, shed_headers=shed, hold=hold))
    finally:
        await conn.close()
        if empty is not None:
            await empty.close()
    return {r.check.name: r for r in rows}


def results(rows: dict[str, Row]) -> dict[str, str]:
    return {name: r.verdict.status for name, r in rows.items()}


async def test_this_picker_passes_every_must_the_checker_can_create(this_picker: PickerApp) -> None:
    rows = await run_checks(this_picker.grpc_port, health_port=this_picker.health_port)
    got = results(rows)
    assert all(got[n] == "pass" for n in MUSTS - CONDITIONAL), {n: rows[n].verdict.why for n in rows}
    assert got["health-overall"] == "pass" and got["served-endpoint-accepted"] == "pass"
    assert got["shedding-429"] == "skip" and got["no-endpoints-503"] == "skip" and got["tls-h2"] == "skip"
    assert exit_code(list(rows.values())) == 0
    assert await _settles(this_picker)  # every stream the checker opened was ended and its booking freed


async def test_this_picker_sheds_a_sheddable_request_with_429_once_its_pool_is_loaded(tmp_path) -> None:  # noqa: ANN001
    """Flow control on, saturation = prompt tokens booked by this picker, `batch` an objective of priority -1:
    the checker holds one request per endpoint open and the sheddable one is refused with 429."""
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text("batch: -1\n")
    app = PickerApp(picker_config(flow_control=True, max_num_batched_tokens=1,
                                  inference_objectives_file=str(objectives)))
    await app.start()
    try:
        rows = await run_checks(app.grpc_port, health_port=app.health_port, shed=SHED, hold=len(POOL))
        assert rows["shedding-429"].verdict.status == "pass", rows["shedding-429"].verdict.why
        assert "routed while idle" in rows["shedding-429"].verdict.why
        assert await _settles(app)  # the held streams' bookings were freed when the checker let them go
    finally:
        await app.stop(grace=0.5)


async def _settles(app: PickerApp) -> bool:
    for _ in range(200):
        if app.load.total_inflight() == 0 and app.picker.open_requests == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_the_command_checks_a_tls_picker_and_one_without_endpoints(tmp_path, capsys) -> None:  # noqa: ANN001
    """The command line as a user runs it: TLS with the picker's self-signed certificate, health on its own
    port, and a second picker with no endpoints for the 503 check; JSON out, exit 0."""
    empty_file = tmp_path / "endpoints.yaml"
    empty_file.write_text("endpoints: []\n")
    app = PickerApp(picker_config(secure_serving=True))
    empty = PickerApp(picker_config(secure_serving=True, endpoints=None, endpoints_file=str(empty_file)))
    await app.start()
    await empty.start()
    try:
        rc = await asyncio.to_thread(main, [
            f"127.0.0.1:{app.grpc_port}", "--health", f"127.0.0.1:{app.health_port}",
            "--no-endpoints-target", f"127.0.0.1:{empty.grpc_port}", "--json"])
    finally:
        await app.stop(grace=0.5)
        await empty.stop(grace=0.5)
    doc = json.loads(capsys.readouterr().out)
    got = {c["check"]: c["result"] for c in doc["checks"]}
    assert rc == 0 and doc["ok"], doc
    assert got["no-endpoints-503"] == "pass" and got["shedding-429"] == "skip" and got["tls-h2"] == "pass"
    assert all(got[n] == "pass" for n in MUSTS - {"shedding-429"}), doc


# ------------------------------------------------------------------ every MUST check can fail
_BROKEN = [  # (the rule a fake picker breaks, the one check that must then fail)
    (Break.NO_METADATA_STREAMED, "streamed-destination"),
    (Break.NO_METADATA_BUFFERED, "buffered-destination"),
    (Break.HONOUR_CLIENT_HEADER, "client-destination-ignored"),
    (Break.FAIL_ON_SERVED, "served-endpoint-accepted"),
    (Break.CONTINUE_ON_DISJOINT_SUBSET, "subset-disjoint-503"),
    (Break.EMPTY_SUBSET_IS_NO_HINT, "subset-empty-503"),
    (Break.IGNORE_SUBSET, "subset-respected"),
    (Break.NOT_READY, "health-services"),
    (Break.NO_OVERALL_HEALTH, "health-overall"),
    (Break.NO_ENDPOINTS_500, "no-endpoints-503"),
    (Break.SHED_503, "shedding-429"),
]


@pytest.fixture
async def fake():  # noqa: ANN201
    """Start fake pickers on demand; all stopped at the end."""
    servers = []

    async def start(brk: Break, endpoints: list[str] | None = None, tls: ServerCert | None = None) -> int:
        server, port = await start_fake(POOL if endpoints is None else endpoints, brk, tls=tls)
        servers.append(server)
        return port

    yield start
    for s in servers:
        await s.stop(0)


async def test_a_picker_that_follows_the_protocol_passes_every_check(fake) -> None:  # noqa: ANN001
    cert = self_signed()
    rows = await run_checks(await fake(Break.NONE, tls=cert), empty_port=await fake(Break.NONE, [], tls=cert),
                            tls=TlsMode(), shed=SHED, hold=len(POOL))
    assert {n: s for n, s in results(rows).items() if s != "pass"} == {}


async def test_a_plaintext_picker_skips_tls_and_without_shed_headers_skips_429(fake) -> None:  # noqa: ANN001
    rows = await run_checks(await fake(Break.NONE), empty_port=await fake(Break.NONE, []))
    assert {n: s for n, s in results(rows).items() if s != "pass"} == {"shedding-429": "skip", "tls-h2": "skip"}


@pytest.mark.parametrize(("brk", "check"), _BROKEN, ids=lambda v: v.value if isinstance(v, Break) else v)
async def test_a_picker_breaking_one_rule_fails_exactly_that_check(fake, brk: Break, check: str) -> None:  # noqa: ANN001
    cert = self_signed()
    rows = await run_checks(await fake(brk, tls=cert), empty_port=await fake(brk, [], tls=cert), tls=TlsMode(),
                            shed=SHED, hold=len(POOL))
    failures = {n for n, s in results(rows).items() if s == "fail"}
    assert failures == {check}, {n: rows[n].verdict.why for n in failures}
    assert exit_code(list(rows.values())) == (1 if rows[check].check.level == "MUST" else 0)


async def test_a_picker_whose_tls_selects_no_alpn_fails_tls_h2_naming_the_cause(fake) -> None:  # noqa: ANN001
    """Not "exactly one check": gRPC's own client (grpc-core, as grpc-go since 1.67) refuses a TLS server that
    selects no ALPN, so every check that speaks gRPC fails too; tls-h2 is the one that says why."""
    rows = await run_checks(await fake(Break.TLS_NO_ALPN, tls=self_signed()), tls=TlsMode())
    assert rows["tls-h2"].verdict.status == "fail"
    assert "selected nothing" in rows["tls-h2"].verdict.why
    assert rows["streamed-destination"].verdict.status == "fail"  # the gRPC client refused it as well
    assert exit_code(list(rows.values())) == 1


def test_every_must_check_has_a_breaking_picker() -> None:
    """A MUST check no broken picker fails could be a check that cannot fail."""
    covered = {c for _, c in _BROKEN} | {"tls-h2"}  # tls-h2: the test above
    assert MUSTS - covered == set()


async def test_a_picker_refusing_buffered_is_skipped_not_failed(fake) -> None:  # noqa: ANN001
    rows = await run_checks(await fake(Break.REFUSE_BUFFERED))
    assert rows["buffered-destination"].verdict.status == "skip"
    assert "FAILED_PRECONDITION" in rows["buffered-destination"].verdict.why
    assert exit_code(list(rows.values())) == 0


async def test_an_unreachable_picker_fails_every_must_it_speaks_to() -> None:
    from tests.netutil import free_port

    rows = await run_checks(free_port())
    assert rows["streamed-destination"].verdict.status == "fail"
    assert exit_code(list(rows.values())) == 1
