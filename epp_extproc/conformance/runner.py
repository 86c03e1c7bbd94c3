"""`epp-extproc conformance HOST:PORT [options]`: run every check in order and print the verdicts."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from epp_extproc.conformance.checks import CHECKS, Check, Probe, failed
from epp_extproc.conformance.client import Connection, TlsMode, open_connection
from epp_extproc.conformance.envoy_checks import ENVOY_CHECKS, EnvoyProbe
from epp_extproc.conformance.gateway import ConformanceGateway, GatewayError
from epp_extproc.conformance.report import Row, exit_code, render_json, render_table

__all__ = ["DEFAULT_ENVOY_POOL", "check_picker", "check_through_envoy", "main", "parser"]

DEFAULT_ENVOY_POOL = ("127.0.0.1:18001", "127.0.0.1:18002")  # --envoy without --pool: the workers it serves


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="epp-extproc conformance",
        description="Check an ext_proc endpoint picker against the endpoint-picker protocol (GAIE): speaks "
                    "ext_proc to it as Envoy does; exits 1 if a MUST failed.")
    ap.add_argument("target", help="the picker's ext_proc address, HOST:PORT")
    ap.add_argument("--health", metavar="HOST:PORT", help="its gRPC health address (default: the ext_proc "
                    "address; GAIE's reference picker serves health on 9003)")
    ap.add_argument("--plaintext", action="store_true", help="h2c instead of TLS (a picker started with "
                    "--secure-serving=false)")
    ap.add_argument("--health-plaintext", action=argparse.BooleanOptionalAction, default=None,
                    help="h2c to the health address (default: plaintext when --health differs from the target, "
                    "as health ports are; else as the target)")
    ap.add_argument("--ca", type=Path, help="verify the picker's certificate against this CA (default: trust the "
                    "certificate it presents, as GAIE's gateways do not verify)")
    ap.add_argument("--model", default="conformance", help="the `model` of the requests sent (default %(default)s)")
    ap.add_argument("--pool", default="", help="comma separated ip:port endpoints in the picker's pool, to name "
                    "in subset hints (default: the endpoints it routes to)")
    ap.add_argument("--no-endpoints-target", metavar="HOST:PORT",
                    help="a picker with no endpoints, for the 503 check (skipped without it)")
    ap.add_argument("--shed-header", action="append", default=[], metavar="'NAME: VALUE'",
                    help="a header that makes a request sheddable (repeatable), e.g. 'x-gateway-inference-objective: "
                    "batch' for an InferenceObjective with priority < 0; the 429 check is skipped without it")
    ap.add_argument("--hold", type=int, default=0, metavar="N",
                    help="requests to keep in flight (streams held open) before the sheddable one, to saturate "
                    "the pool the way long generations do (default 0: the pool is saturated already)")
    ap.add_argument("--envoy", action="store_true",
                    help="also check end to end through a real Envoy the command starts (GAIE's ext_proc "
                    "configuration, both body modes) with stand-in workers bound to the --pool endpoints (default "
                    f"{','.join(DEFAULT_ENVOY_POOL)}): start the picker with exactly those endpoints")
    ap.add_argument("--only", action="append", default=[], metavar="CHECK", help="run only this check (repeatable)")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="per request (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="machine output")
    return ap


async def check_through_envoy(target: str, pool: Sequence[str], *, plaintext: bool = False,
                              ca_file: str | None = None, empty_target: str | None = None, model: str = "conformance",
                              shed_headers: tuple[tuple[str, str], ...] = (), hold: int = 0, timeout_s: float = 10.0,
                              checks: Sequence[Check] = ENVOY_CHECKS) -> list[Row]:
    """The "via Envoy" rows: start the workers and Envoy, run the checks, stop everything it started."""
    import aiohttp

    gw = await ConformanceGateway(target, list(pool), plaintext=plaintext, ca_file=ca_file,
                                  empty_picker=empty_target).start()
    try:
        async with aiohttp.ClientSession() as session:
            probe = EnvoyProbe(gw, session, model=model, shed_headers=shed_headers, hold=hold, timeout_s=timeout_s)
            return await check_picker(probe, checks)  # type: ignore[arg-type]
    finally:
        await gw.stop()


async def check_picker(probe: Probe, checks: Sequence[Check] = CHECKS) -> list[Row]:
    """Every check in order; a check that raises is a failure naming the exception, not a crash."""
    rows = []
    for c in checks:
        try:
            verdict = await c.run(probe)
        except Exception as e:  # noqa: BLE001 - the picker under test may answer anything
            verdict = failed(f"{type(e).__name__}: {e}")
        rows.append(Row(c, verdict))
    return rows


async def _run(args: argparse.Namespace) -> list[Row]:
    shed = tuple(_header(h) for h in args.shed_header)
    tls = TlsMode(plaintext=args.plaintext, ca_pem=args.ca.read_bytes() if args.ca else None)
    health_plain = args.health_plaintext
    if health_plain is None:
        health_plain = args.plaintext or (args.health is not None and args.health != args.target)
    health_tls = TlsMode(plaintext=health_plain, ca_pem=tls.ca_pem)
    conn = await open_connection(args.target, health_address=args.health, tls=tls, health_tls=health_tls,
                                 timeout_s=args.timeout_s)
    empty: Connection | None = None
    if args.no_endpoints_target:
        empty = await open_connection(args.no_endpoints_target, tls=tls, timeout_s=args.timeout_s)
    checks = [c for c in CHECKS if not args.only or c.name in args.only]
    pool = [s.strip() for s in args.pool.split(",") if s.strip()]
    if args.envoy and not pool:
        pool = list(DEFAULT_ENVOY_POOL)
    try:
        rows = await check_picker(Probe(conn, model=args.model, empty=empty, shed_headers=shed, hold=args.hold,
                                        pool=pool), checks)
        if args.envoy:
            print(f"epp-extproc conformance: --envoy serves stand-in workers at {','.join(pool)} (the picker must "
                  "route to exactly these)", file=sys.stderr)
            rows += await check_through_envoy(
                args.target, pool, plaintext=args.plaintext, ca_file=str(args.ca) if args.ca else None,
                empty_target=args.no_endpoints_target, model=args.model, shed_headers=shed, hold=args.hold,
                timeout_s=args.timeout_s, checks=[c for c in ENVOY_CHECKS if not args.only or c.name in args.only])
        return rows
    finally:
        await conn.close()
        if empty is not None:
            await empty.close()


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise SystemExit(f"epp-extproc conformance: --shed-header {text!r} is not 'NAME: VALUE'")
    return name.strip().lower(), value.strip()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    unknown = set(args.only) - {c.name for c in CHECKS}
    if unknown:
        print(f"epp-extproc conformance: unknown check(s) {sorted(unknown)}; known: "
              f"{[c.name for c in CHECKS]}", file=sys.stderr)
        return 2
    try:
        rows = asyncio.run(_run(args))
    except GatewayError as e:
        print(f"epp-extproc conformance --envoy: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the TLS certificate could not be read: the picker is not there
        print(f"epp-extproc conformance: cannot reach {args.target}: {e}", file=sys.stderr)
        return 2
    print(render_json(args.target, rows) if args.json else render_table(args.target, rows))
    return exit_code(rows)
