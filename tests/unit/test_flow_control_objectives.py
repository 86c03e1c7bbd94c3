"""Where priorities come from: InferenceObjective CRD items of our pool, and a file that is reloaded and,
when broken, keeps the previous table."""

from __future__ import annotations

import os
from pathlib import Path

from epp_extproc.adapters.objectives import ObjectivesFile, objectives_for_pool
from epp_extproc.core.flow_objectives import ObjectiveTable


def crd(name: str, pool: str, priority: object = None) -> dict:
    spec: dict = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
            "metadata": {"name": name}, "spec": spec}


def test_only_objectives_of_our_pool_count_and_unset_priority_is_zero() -> None:
    items = [crd("premium", "pool", 10), crd("other", "another-pool", 99), crd("plain", "pool"),
             crd("bad", "pool", "high")]
    assert objectives_for_pool(items, "pool") == {"premium": 10, "plain": 0}


def test_objectives_file_is_reloaded_and_a_broken_edit_keeps_the_previous_table(tmp_path: Path) -> None:
    f = tmp_path / "objectives.yaml"
    f.write_text("premium: 10\n")
    table = ObjectiveTable()
    src = ObjectivesFile(table, str(f))
    src.load_once()
    assert table.snapshot() == {"premium": 10}
    f.write_text("premium: [not, a, number\n")
    os.utime(f, (1, 1))  # a different stamp even within the same mtime tick
    src.load_once()
    assert table.snapshot() == {"premium": 10}
    f.write_text("---\nkind: InferenceObjective\nmetadata: {name: batch}\nspec: {priority: -1}\n")
    os.utime(f, (2, 2))
    src.load_once()
    assert table.snapshot() == {"batch": -1}
