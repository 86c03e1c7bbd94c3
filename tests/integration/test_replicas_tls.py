"""Replica sync over mutual TLS (`--replica-sync-tls-path`): replicas sharing one CA sync; a replica with a
certificate from another CA, or none, cannot push bookings; missing files stop start-up with one line."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from epp_extproc.app import PickerApp
from epp_extproc.cli import load
from tests.integration.test_replicas import WORKER, config, inflight
from tests.integration.test_tls import make_ca, openssl
from tests.netutil import free_port
from tests.waiting import until_async


def make_sync_secret(d: Path, ca: tuple[Path, Path], name: str = "epp-replica-sync") -> Path:
    """d/{tls.crt, tls.key, ca.crt}: one certificate for every replica, with `name` as its DNS SAN."""
    d.mkdir(parents=True, exist_ok=True)
    key, csr, crt, ext = d / "tls.key", d / "tls.csr", d / "tls.crt", d / "ext.cnf"
    ext.write_text(f"subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj",
            "/CN=epp-replica", "-keyout", str(key), "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
            "-days", "2", "-extfile", str(ext), "-out", str(crt))
    (d / "ca.crt").write_bytes(ca[0].read_bytes())
    return d


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("sync-tls")
    ours, theirs = make_ca(d, "ours"), make_ca(d, "theirs")
    return {"ours": make_sync_secret(d / "ours-secret", ours),
            "theirs": make_sync_secret(d / "theirs-secret", theirs)}


@pytest.fixture
async def apps() -> AsyncIterator[list[PickerApp]]:
    started: list[PickerApp] = []
    yield started
    for a in started:
        await a.stop(0)


async def pair(apps: list[PickerApp], a_tls: Path | None, b_tls: Path | None) -> tuple[PickerApp, PickerApp]:
    pa, pb = free_port(), free_port()
    a = PickerApp(config(pa, [pb], replica_sync_tls_path=str(a_tls) if a_tls else None))
    b = PickerApp(config(pb, [pa], replica_sync_tls_path=str(b_tls) if b_tls else None))
    for app in (a, b):
        await app.start()
        apps.append(app)
    return a, b


async def test_replicas_sharing_a_ca_sync_bookings_over_mutual_tls(apps: list[PickerApp],
                                                                  secrets: dict[str, Path]) -> None:
    a, b = await pair(apps, secrets["ours"], secrets["ours"])
    await until_async(lambda: all(lk.up for x in (a, b) for lk in x.sync.links.values()), "both links up")  # type: ignore[union-attr]
    booking = a.load.book(WORKER, 4)
    await until_async(lambda: inflight(b) == 1, "the booking at B")
    booking.free()
    await until_async(lambda: inflight(b) == 0, "the free at B")


@pytest.mark.parametrize("intruder", ["theirs", None])
async def test_a_replica_without_a_certificate_of_our_ca_cannot_push_bookings(
        apps: list[PickerApp], secrets: dict[str, Path], intruder: str | None) -> None:
    a, b = await pair(apps, secrets[intruder] if intruder else None, secrets["ours"])
    a.load.book(WORKER, 4)
    await asyncio.sleep(2.0)  # several connection attempts
    assert inflight(b) == 0 and b.load.peer_inflight() == 0
    assert not any(lk.up for lk in a.sync.links.values())  # type: ignore[union-attr]
    assert not any(lk.up for lk in b.sync.links.values())  # type: ignore[union-attr]


def test_a_tls_path_without_its_files_stops_start_up_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "tls.crt").write_text("x")
    with pytest.raises(SystemExit) as e:
        load(["--peers", "127.0.0.1:1", "--replica-sync-tls-path", str(tmp_path)], env={})
    msg = str(e.value)
    assert "lacks tls.key, ca.crt" in msg and "\n" not in msg


async def test_a_renewed_secret_is_served_to_new_connections_without_a_restart(
        apps: list[PickerApp], secrets: dict[str, Path], tmp_path: Path) -> None:
    """A's Secret moves to the other CA (cert-manager renewed it with a new issuer): without a restart, A
    then links with a replica of that CA, both ways (its server's credentials and its outbound channels)."""
    mounted = tmp_path / "a-secret"
    mounted.mkdir()
    for f in ("tls.crt", "tls.key", "ca.crt"):
        (mounted / f).write_bytes((secrets["ours"] / f).read_bytes())
    a, c = await pair(apps, mounted, secrets["theirs"])
    await asyncio.sleep(1.5)
    assert not any(lk.up for x in (a, c) for lk in x.sync.links.values())  # type: ignore[union-attr]
    for f in ("tls.key", "tls.crt", "ca.crt"):  # not atomic: a half-written set must not be taken
        (mounted / f).write_bytes((secrets["theirs"] / f).read_bytes())
    await until_async(lambda: all(lk.up for x in (a, c) for lk in x.sync.links.values()), "both links up",
                      timeout=15)
    assert a.sync.tls is not None and a.sync.tls.reloads == 1  # type: ignore[union-attr]
    c.load.book(WORKER, 4)
    await until_async(lambda: inflight(a) == 1, "C's booking at A")


async def test_a_renewed_secret_whose_key_does_not_match_keeps_the_previous_one(tmp_path: Path,
                                                                                secrets: dict[str, Path]) -> None:
    from epp_extproc.adapters.replica_sync import SyncTls

    for f in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / f).write_bytes((secrets["ours"] / f).read_bytes())
    tls = SyncTls.load(str(tmp_path), "epp-replica-sync")
    before = tls.cert_pem
    (tmp_path / "tls.crt").write_bytes((secrets["theirs"] / "tls.crt").read_bytes())  # key still the old one
    assert not await tls.check_once()
    assert tls.cert_pem == before and tls.reloads == 0
    (tmp_path / "tls.key").write_bytes((secrets["theirs"] / "tls.key").read_bytes())
    (tmp_path / "ca.crt").write_bytes((secrets["theirs"] / "ca.crt").read_bytes())
    assert await tls.check_once() and tls.cert_pem != before and tls.reloads == 1


def test_a_tls_path_whose_key_is_not_the_certificates_stops_start_up_with_one_line(
        tmp_path: Path, secrets: dict[str, Path]) -> None:
    (tmp_path / "tls.crt").write_bytes((secrets["ours"] / "tls.crt").read_bytes())
    (tmp_path / "tls.key").write_bytes((secrets["theirs"] / "tls.key").read_bytes())
    (tmp_path / "ca.crt").write_bytes((secrets["ours"] / "ca.crt").read_bytes())
    with pytest.raises(SystemExit) as e:
        load(["--peers", "127.0.0.1:1", "--replica-sync-tls-path", str(tmp_path)], env={})
    msg = str(e.value)
    assert "tls.key is not the key of tls.crt" in msg and "\n" not in msg
