"""The checked-in modules in epp_extproc/proto_gen are exactly what `make proto` generates from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

_spec = importlib.util.spec_from_file_location("proto_generate", Path(__file__).parents[2] / "proto" / "generate.py")
assert _spec is not None and _spec.loader is not None
_gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gen)  # proto/ is a folder of .proto files, not a package (`proto` would shadow proto-plus)
ROOT, generate = _gen.ROOT, _gen.generate


def test_generated_modules_match_the_proto_files(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "no .proto under proto/"
    stale = [str(p.relative_to(tmp_path)) for p in fresh
             if not (ROOT / p.relative_to(tmp_path)).exists()
             or (ROOT / p.relative_to(tmp_path)).read_bytes() != p.read_bytes()]
    assert stale == [], f"run `make proto`: these differ from what proto/ generates: {stale}"
