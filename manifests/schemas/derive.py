"""Derive description-free JSON schemas for InferencePool, HTTPRoute and Gateway from the upstream CRDs.

Why: the manifest tests validate our custom objects against the real CRD schemas, but the CRDs in
manifests/crds/ (the pinned upstream releases, see its README) are hundreds of KB, mostly prose, and slow to
parse. We keep just what validation needs (types, required, enums, patterns, min/max limits, defaults, the
x-kubernetes-* markers) in this folder, and a test re-derives them from manifests/crds/ to catch drift: after
updating a CRD there, run this script.

    python manifests/schemas/derive.py [CRD_DIR]     # writes manifests/schemas/<kind>-<version>.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_CRD_DIR = HERE.parent / "crds"

# (CRD file, kind, version) of every schema we derive.
WANTED = (
    ("inference.networking.k8s.io_inferencepools.yaml", "InferencePool", "v1"),
    ("gateway.networking.k8s.io_httproutes.yaml", "HTTPRoute", "v1"),
    ("gateway.networking.k8s.io_gateways.yaml", "Gateway", "v1"),
)
# Prose only: dropping it changes nothing a validator checks.
DROPPED_KEYS = frozenset({"description"})


def strip(schema: Any) -> Any:
    """Copy an OpenAPI v3 schema without prose. Keys under `properties` are field NAMES, never dropped."""
    if isinstance(schema, list):
        return [strip(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: strip(sub) for name, sub in value.items()}
        elif key in DROPPED_KEYS:
            continue
        else:
            out[key] = strip(value)
    return out


def schema_filename(kind: str, version: str) -> str:
    return f"{kind.lower()}-{version}.json"


def derive(crd_dir: Path) -> dict[str, str]:
    """File name -> JSON text of every wanted schema (deterministic, so a diff means upstream changed)."""
    out: dict[str, str] = {}
    for filename, kind, version in WANTED:
        docs = [d for d in yaml.safe_load_all((crd_dir / filename).read_text()) if d]
        crd = next(d for d in docs if d.get("kind") == "CustomResourceDefinition"
                   and d["spec"]["names"]["kind"] == kind)
        ver = next(v for v in crd["spec"]["versions"] if v["name"] == version)
        schema = strip(ver["schema"]["openAPIV3Schema"])
        annotations = crd["metadata"].get("annotations") or {}
        bundle = next((v for k, v in sorted(annotations.items()) if k.endswith("/bundle-version")), None)
        schema["x-derived-from"] = {"crd": crd["metadata"]["name"], "version": version, "bundle": bundle}
        out[schema_filename(kind, version)] = json.dumps(schema, indent=1, sort_keys=True) + "\n"
    return out


def main(argv: list[str]) -> int:
    crd_dir = Path(argv[1]) if len(argv) > 1 else DEFAULT_CRD_DIR
    if not crd_dir.is_dir():
        print(f"no CRD folder at {crd_dir}", file=sys.stderr)
        return 1
    for name, text in derive(crd_dir).items():
        (HERE / name).write_text(text)
        print(f"wrote {HERE / name} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
