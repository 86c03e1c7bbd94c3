"""The nats-plane manifests (manifests/nats-plane): the relay sidecar's arguments are ones `epp-kv-relay`
accepts, and they name the worker by the address the picker knows it by (pod IP : the pool's target port)."""

from __future__ import annotations

from pathlib import Path

import yaml

from epp_extproc.kvplane.relay import parse_args, workers_of

OVERLAY = Path(__file__).resolve().parents[2] / "manifests" / "nats-plane" / "kustomization.yaml"


def relay_container() -> dict:
    k = yaml.safe_load(OVERLAY.read_text())
    for p in k["patches"]:
        for op in yaml.safe_load(p["patch"]):
            if op["path"] == "/spec/template/spec/containers/-" and op["value"]["name"] == "kv-relay":
                return op["value"]
    raise AssertionError("no kv-relay sidecar in the overlay")


def test_the_relay_sidecar_arguments_are_accepted_by_the_relay_cli():
    c = relay_container()
    assert c["command"] == ["epp-kv-relay"]
    args = parse_args([a.replace("$(POD_IP)", "10.1.2.3") for a in c["args"]])
    workers = workers_of(args)
    assert list(workers) == ["10.1.2.3:8000"] and workers["10.1.2.3:8000"][0].endpoint == "tcp://127.0.0.1:5557"
    assert args.nats_url == "nats://nats:4222" and args.kv_cache_block_size == 32
