"""`epp-extproc conformance --envoy`: the rules only a gateway shows, through a real Envoy the checker starts
in front of the picker under test, with its own stand-in workers.

This picker passes every "via Envoy" row; a fake picker broken one rule at a time fails exactly that rule's
row through Envoy (the client's 503/429 and where the request landed are read from outside, not from the
picker's messages).
"""

from __future__ import annotations

import json
import tempfile

import pytest

from epp_extproc.app import PickerApp
from epp_extproc.conformance.envoy_checks import ENVOY_CHECKS
from epp_extproc.conformance.report import Row, exit_code, render_table
from epp_extproc.conformance.runner import check_through_envoy, main
from tests.integration.fake_picker import SHED_HEADER, Break, start_fake
from tests.integration.test_conformance import _BROKEN, picker_config
from tests.netutil import free_port

SHED = (SHED_HEADER,)


def a_pool() -> list[str]:
    return [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]


def by_name(rows: list[Row]) -> dict[str, Row]:
    assert all(r.check.via == "Envoy" for r in rows)
    return {r.check.name: r for r in rows}


def results(rows: dict[str, Row]) -> dict[str, str]:
    return {n: r.verdict.status for n, r in rows.items()}


async def test_this_picker_passes_every_check_through_envoy(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    temp = tmp_path / "temp"  # where the checker's Envoys keep their configs and logs while it runs
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    pool = a_pool()
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text("batch: -1\n")
    empty_file = tmp_path / "endpoints.yaml"
    empty_file.write_text("endpoints: []\n")
    app = PickerApp(picker_config(endpoints=f"a={pool[0]},b={pool[1]}", flow_control=True, max_num_batched_tokens=1,
                                  inference_objectives_file=str(objectives)))
    empty = PickerApp(picker_config(endpoints=None, endpoints_file=str(empty_file)))
    await app.start()
    await empty.start()
    try:
        rows = by_name(await check_through_envoy(f"127.0.0.1:{app.grpc_port}", pool, plaintext=True,
                                                 empty_target=f"127.0.0.1:{empty.grpc_port}", shed_headers=SHED,
                                                 hold=len(pool)))
    finally:
        await app.stop(grace=0.5)
        await empty.stop(grace=0.5)
    assert {n: r.verdict.why for n, r in rows.items() if r.verdict.status != "pass"} == {}
    assert set(rows) == {c.name for c in ENVOY_CHECKS}
    assert "via Envoy" in render_table("t", list(rows.values()))
    assert list(temp.iterdir()) == []  # the run left nothing behind


# The direct suite's mutants whose rule a gateway shows: every one but the missing-metadata pickers (Envoy routes
# on the header; metadata that is not there changes nothing the client or a worker can see).
_BROKEN_VIA_ENVOY = [(brk, check) for brk, check in _BROKEN if check in {c.name for c in ENVOY_CHECKS}
                     and brk not in (Break.NO_METADATA_STREAMED, Break.NO_METADATA_BUFFERED)]


def test_six_of_the_direct_suites_mutants_are_visible_through_envoy() -> None:
    assert {c for _, c in _BROKEN_VIA_ENVOY} == {"client-destination-ignored", "subset-disjoint-503", "subset-respected",
                                                 "no-endpoints-503", "shedding-429", "served-endpoint-accepted"}


@pytest.mark.parametrize(("brk", "check"), [(Break.NONE, None), *_BROKEN_VIA_ENVOY],
                         ids=lambda v: v.value if isinstance(v, Break) else str(v))
async def test_a_picker_breaking_one_rule_fails_that_row_through_envoy(brk: Break, check: str | None) -> None:
    pool = a_pool()
    server, port = await start_fake(pool, brk)
    empty, empty_port = await start_fake([], brk)
    try:
        rows = by_name(await check_through_envoy(f"127.0.0.1:{port}", pool, plaintext=True,
                                                 empty_target=f"127.0.0.1:{empty_port}", shed_headers=SHED,
                                                 hold=len(pool)))
    finally:
        await server.stop(0)
        await empty.stop(0)
    got = results(rows)
    if brk is Break.FAIL_ON_SERVED:  # every routed request's answer is Envoy's 500: the routing rows fail too
        assert got["served-endpoint-accepted"] == "fail" and "HTTP 500" in rows[check].verdict.why
        return
    failures = {n for n, s in got.items() if s == "fail"}
    assert failures == ({check} if check else set()), {n: rows[n].verdict.why for n in failures}
    assert exit_code(list(rows.values())) == (1 if check else 0)


async def test_a_picker_that_changes_the_body_fails_both_destination_rows_through_envoy() -> None:
    """Invisible to the direct checks (they read the picker's messages, not the worker's bytes)."""
    pool = a_pool()
    server, port = await start_fake(pool, Break.ALTER_BODY)
    try:
        rows = by_name(await check_through_envoy(f"127.0.0.1:{port}", pool, plaintext=True))
    finally:
        await server.stop(0)
    for name in ("streamed-destination", "buffered-destination"):
        assert rows[name].verdict.status == "fail" and "body changed" in rows[name].verdict.why, rows[name].verdict
    assert exit_code(list(rows.values())) == 1


async def test_a_tls_picker_is_checked_through_an_envoy_speaking_tls_to_it() -> None:
    from epp_extproc.envoy.tls import self_signed

    pool = a_pool()
    server, port = await start_fake(pool, tls=self_signed())
    try:
        rows = by_name(await check_through_envoy(f"127.0.0.1:{port}", pool,
                                                 checks=[c for c in ENVOY_CHECKS if c.name == "streamed-destination"]))
    finally:
        await server.stop(0)
    assert rows["streamed-destination"].verdict.status == "pass", rows["streamed-destination"].verdict


async def test_a_pool_address_the_checker_cannot_bind_is_a_clear_error_exit_2(capsys) -> None:  # noqa: ANN001
    import asyncio
    import socket

    pool = a_pool()
    server, port = await start_fake(pool)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = f"127.0.0.1:{taken.getsockname()[1]}"
    try:
        rc = await asyncio.to_thread(main, [f"127.0.0.1:{port}", "--plaintext", "--envoy", "--pool", busy,
                                            "--only", "health-services"])
    finally:
        taken.close()
        await server.stop(0)
    assert rc == 2
    assert f"cannot serve a stand-in worker on {busy}" in capsys.readouterr().err


async def test_no_envoy_binary_is_a_clear_error_naming_how_to_get_one(monkeypatch, capsys) -> None:  # noqa: ANN001
    import asyncio

    monkeypatch.setenv("ENVOY_BIN", "/nonexistent/envoy")
    server, port = await start_fake(a_pool())
    try:
        rc = await asyncio.to_thread(main, [f"127.0.0.1:{port}", "--plaintext", "--envoy", "--pool", ",".join(a_pool()),
                                            "--only", "health-services"])
    finally:
        await server.stop(0)
    assert rc == 2 and "ENVOY_BIN='/nonexistent/envoy' is not an executable" in capsys.readouterr().err


async def test_the_command_with_envoy_prints_the_workers_it_serves_and_both_kinds_of_rows(capsys) -> None:  # noqa: ANN001
    import asyncio

    pool = a_pool()
    server, port = await start_fake(pool)
    try:
        rc = await asyncio.to_thread(main, [f"127.0.0.1:{port}", "--plaintext", "--envoy", "--pool", ",".join(pool),
                                            "--json"])
    finally:
        await server.stop(0)
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert rc == 0 and doc["ok"], doc
    assert ",".join(pool) in out.err
    vias = {c["via"] for c in doc["checks"]}
    assert vias == {"ext_proc", "Envoy"}
