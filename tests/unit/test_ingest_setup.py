"""Which KV view a picker gets (`--kv-ingest`), and who runs the ingest shards."""

from __future__ import annotations

import dataclasses
import os
import shutil

from prometheus_client import CollectorRegistry

from epp_extproc.adapters.kv_remote import RemoteKv
from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.config import Config, KvSection, ProcessSlot, load_config
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.ingest.setup import build_kv
from epp_extproc.processes import child_configs


def test_inprocess_is_the_default_and_runs_no_shard() -> None:
    kv, group, directory = build_kv(KvSection(), ProcessSlot(), EndpointRegistry(), CollectorRegistry())
    assert isinstance(kv, KvRouting) and group is None and directory is None


def test_a_lone_picker_with_apart_runs_its_own_shards_in_a_private_directory() -> None:
    kv, group, directory = build_kv(KvSection(kv_ingest="apart", kv_ingest_shards=3), ProcessSlot(),
                                    EndpointRegistry(), CollectorRegistry())
    try:
        assert isinstance(kv, RemoteKv) and len(kv.shards) == 3
        assert group is not None and len(group.argvs) == 3
        assert directory is not None and os.path.isdir(directory)
        assert all(directory in argv for argv in group.argvs)
    finally:
        shutil.rmtree(directory or "", ignore_errors=True)


def test_a_processes_child_uses_the_supervisors_shards() -> None:
    kv, group, directory = build_kv(KvSection(kv_ingest="apart"), ProcessSlot(index=1, ingest_dir="/run/x"),
                                    EndpointRegistry(), CollectorRegistry())
    assert isinstance(kv, RemoteKv) and kv.directory == "/run/x"
    assert group is None and directory is None


def test_processes_children_share_one_ingest_directory_only_when_apart() -> None:
    apart = child_configs(Config(processes=3, kv_ingest="apart"), "/tmp/d")
    assert {slot.ingest_dir for _, slot in apart} == {"/tmp/d"}
    inproc = child_configs(Config(processes=3), "/tmp/d")
    assert {slot.ingest_dir for _, slot in inproc} == {None}


def test_siblings_sharing_an_ingest_do_not_send_each_other_predictions() -> None:
    from epp_extproc.app import PickerApp

    def listeners(slot: ProcessSlot) -> int:
        app = PickerApp(Config(kv_ingest="apart", tokenizer_protocol="trtllm-render",
                               tokenizer_service_url="http://127.0.0.1:1", peers="unix:/tmp/nowhere.sock"), slot)
        try:
            assert app.kv is not None
            return len(app.kv.facts.predict_listeners)
        finally:
            if app.ingest_dir:  # nothing was started: only the directory to clean
                shutil.rmtree(app.ingest_dir, ignore_errors=True)

    assert listeners(ProcessSlot(index=0, ingest_dir="/tmp/d", sync_listen=("unix:/tmp/a.sock",))) == 0
    assert listeners(ProcessSlot()) == 1  # cross-host peers still get them


def test_each_view_answers_the_capabilities_the_app_asks_for_without_the_app_knowing_which_it_has() -> None:
    """What differs between the views is answered by the view (None where it has none), so app.py has no
    isinstance switch: the in-process index follows bookings and reads churn; the shards keep neither."""
    inproc, _, _ = build_kv(KvSection(), ProcessSlot(), EndpointRegistry(), CollectorRegistry())
    follow = inproc.use_queue_lifetime(0.5, 30.0)
    assert follow is not None and inproc.churn_window() is not None
    assert not inproc.warm("w:1") and inproc.index is not None
    apart, _, directory = build_kv(KvSection(kv_ingest="apart"), ProcessSlot(), EndpointRegistry(),
                                   CollectorRegistry())
    try:
        assert apart.use_queue_lifetime(0.5, 30.0) is None and apart.churn_window() is None
        assert not apart.warm("w:1") and apart.index is apart
    finally:
        shutil.rmtree(directory or "", ignore_errors=True)


def test_the_app_feeds_booking_changes_to_the_view_that_holds_predictions_for_them() -> None:
    from epp_extproc.app import PickerApp

    cfg = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1",
                 prediction_lifetime="queue")
    app = PickerApp(cfg)
    assert isinstance(app.kv, KvRouting) and app.kv.grace_s == cfg.prediction_grace_s
    assert app.kv.on_booking in app.load._listeners  # booking changes release the held predictions


def test_build_kv_works_from_the_kv_section_alone() -> None:
    """The index and the shards get their settings from `config.sections.kv` (and the log level handed in)."""
    section = load_config(["--kv-cache-block-size", "16", "--kv-ingest-shards", "2", "--kv-event-topic", "t",
                           "--kv-shared-stores", "pvc=a:1,b:2", "--kv-storage-block-size", "64"],
                          env={}).sections.kv
    inproc, _, _ = build_kv(section, ProcessSlot(), EndpointRegistry(), CollectorRegistry())
    assert isinstance(inproc, KvRouting) and inproc.block_size("w:1") == 16
    apart, group, directory = build_kv(dataclasses.replace(section, kv_ingest="apart"), ProcessSlot(),
                                       EndpointRegistry(), CollectorRegistry(), log_level="DEBUG")
    try:
        assert isinstance(apart, RemoteKv) and len(apart.shards) == 2 and group is not None
        for argv in group.argvs:
            flags = dict(zip(argv[3::2], argv[4::2], strict=True))
            assert (flags["--block-size"], flags["--topic"], flags["--log-level"]) == ("16", "t", "DEBUG")
            # the shards place and credit a store's workers by the picker's own store settings
            assert (flags["--shared-stores"], flags["--storage-block-size"]) == ("pvc=a:1,b:2", "64")
        assert apart.stores == {"a:1": "pvc", "b:2": "pvc"}
    finally:
        shutil.rmtree(directory or "", ignore_errors=True)
