"""Nothing in the repository imports the `bench.kvwire` re-export: the wire encoder is the product's
`epp_extproc.dev.kvwire` (tests and benchmarks share it there). `bench/kvwire.py` stays for one release only, for
code outside this repository; a test still importing it would break when it goes, and would keep two names for
one module in the suite (issue 43 item 6)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("epp_extproc", "kvindex", "trtllm_mock", "h2grpc", "tests", "bench")
SHIM = ROOT / "bench" / "kvwire.py"


def imports_of_the_shim(path: Path) -> list[int]:
    """The lines of `path` that import `bench.kvwire` (as a module, or as a name from `bench`)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == "bench.kvwire" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (
                node.module == "bench.kvwire" or (node.module == "bench" and
                                                   any(a.name == "kvwire" for a in node.names))):
            lines.append(node.lineno)
    return lines


def test_nothing_imports_the_bench_kvwire_reexport() -> None:
    found = {str(p.relative_to(ROOT)): n for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))
             if p != SHIM and (n := imports_of_the_shim(p))}
    assert found == {}, f"import epp_extproc.dev.kvwire instead: {found}"
