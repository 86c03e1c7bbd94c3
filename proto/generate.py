"""Regenerate the Python modules for every .proto under proto/ (run by `make proto` and by a test).

`-I epp_extproc/proto_gen=proto` maps the proto tree under the package the modules live in, so protoc writes
`epp_extproc/proto_gen/epp/v1/replica_sync_pb2.py` and the gRPC module imports it by that absolute name:
no import rewriting, nothing on sys.path.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = "epp_extproc/proto_gen"


def protos() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Write the generated modules under `out_dir` (the repository root by default); returns their paths."""
    files = [f"{PACKAGE}/{p.relative_to(PROTO_DIR).as_posix()}" for p in protos()]
    args = ["grpc_tools.protoc", f"-I{PACKAGE}={PROTO_DIR}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out = []
    for f in files:
        stem = out_dir / f.removesuffix(".proto")
        out += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return out


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(p)
