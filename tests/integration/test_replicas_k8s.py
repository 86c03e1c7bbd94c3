"""Peer replicas found through the picker Service's EndpointSlices (fake apiserver, real list/watch JSON),
and two real pickers that find each other that way and share load over real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from epp_extproc.adapters.discovery_peers import PeerServiceDiscovery
from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from tests.fake_k8s import SLICES, FakeKube, make_slice
from tests.netutil import free_port
from tests.waiting import until_async

pytestmark = pytest.mark.timeout(30)
SERVICE = "epp"


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as k:
        yield k


@pytest.fixture
async def peers(kube: FakeKube) -> AsyncIterator[list[set[str]]]:
    seen: list[set[str]] = []
    d = PeerServiceDiscovery(seen.append, SERVICE, "default", pod_ip="10.0.0.1", api_client_factory=kube.api_client)
    task = asyncio.create_task(d.run())
    yield seen
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_peers_are_the_service_endpoints_on_the_named_port_without_self(kube, peers) -> None:  # noqa: ANN001
    kube.put(SLICES, make_slice("epp-a", SERVICE, 9004, [("10.0.0.1", True, False), ("10.0.0.2", True, False),
                                                        ("10.0.0.3", False, False), ("10.0.0.4", True, True)]))
    kube.put(SLICES, make_slice("other-a", "other", 9004, [("10.0.0.9", True, False)]))
    await until_async(lambda: bool(peers), "the first peer set")
    # not-ready 10.0.0.3 is a peer (it waits for us to become ready); terminating 10.0.0.4 is not
    assert peers[-1] == {"10.0.0.2:9004", "10.0.0.3:9004"}


async def test_a_slice_without_the_named_port_names_no_peers(kube, peers) -> None:  # noqa: ANN001
    kube.put(SLICES, make_slice("epp-a", SERVICE, 9002, [("10.0.0.2", True, False)], port_name="grpc"))
    await until_async(lambda: len(peers) == 1, "the first publish")
    assert peers[-1] == set()


async def test_slice_changes_update_the_peer_set(kube, peers) -> None:  # noqa: ANN001
    kube.put(SLICES, make_slice("epp-a", SERVICE, 9004, [("10.0.0.2", True, False)]))
    await until_async(lambda: peers and peers[-1] == {"10.0.0.2:9004"}, "one peer")
    kube.put(SLICES, make_slice("epp-b", SERVICE, 9004, [("10.0.0.5", False, False)]))
    await until_async(lambda: peers[-1] == {"10.0.0.2:9004", "10.0.0.5:9004"}, "a second slice")
    kube.delete(SLICES, "epp-a")
    await until_async(lambda: peers[-1] == {"10.0.0.5:9004"}, "the deleted slice's peer gone")


async def test_two_pickers_find_each_other_through_the_service_and_share_load(kube: FakeKube,
                                                                              tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "default"}}],
        "users": [{"name": "u", "user": {}}]}))
    ips, ports = ["127.0.0.1", "127.0.0.2"], [free_port(), free_port()]
    for i, (ip, port) in enumerate(zip(ips, ports, strict=True)):
        kube.put(SLICES, make_slice(f"epp-{i}", SERVICE, port, [(ip, False, False)]))
    apps = [PickerApp(Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind=ip, endpoints="w=127.0.0.1:1",
                             endpoint_probe_interval_ms=0, replica_sync_port=port, peer_service=SERVICE,
                             namespace="default", pod_ip=ip, kubeconfig=str(kubeconfig), peer_timeout_ms=500,
                             peer_expiry_ms=300))
            for ip, port in zip(ips, ports, strict=True)]
    for a in apps:
        await a.start()
    try:
        await until_async(lambda: all(a.ready() for a in apps), "both ready after syncing with each other")
        held = apps[0].load.book("127.0.0.1:1", 3)
        await until_async(lambda: apps[1].load.load("127.0.0.1:1").inflight == 1, "A's booking at B")
        kube.delete(SLICES, "epp-0")  # A leaves the Service: B stops pushing to it, A still pushes to B
        await until_async(lambda: not apps[1].sync.links, "B's link to A closed")  # type: ignore[union-attr]
        held.free()
        await until_async(lambda: apps[1].load.load("127.0.0.1:1").inflight == 0, "A's free at B")
    finally:
        for a in apps:
            await a.stop(0)
