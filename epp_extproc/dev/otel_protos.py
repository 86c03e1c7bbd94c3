"""Two packages ship the files `opentelemetry/proto/**`: `opentelemetry-proto` (what the OTLP exporters are built
against) and `xds-protos` (Envoy's protos, with an older copy). pip lets whichever it installs last win, and in a
fresh environment that is often xds-protos', whose `common_pb2` predates `InstrumentationScope`: the exporters
then fail to import. Envoy's protos only need the older messages, which the newer files keep.

    python -m epp_extproc.dev.otel_protos            # exit 1 and say so when the copies are the wrong ones
    python -m epp_extproc.dev.otel_protos --repair   # reinstall opentelemetry-proto's own files over them

`make install` runs the repair; so does the picker's image (manifests/Dockerfile).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

REPAIR = "pip install --force-reinstall --no-deps opentelemetry-proto=={version}"


def intact() -> bool:
    """Whether `opentelemetry.proto` is opentelemetry-proto's own (the exporters' messages import)."""
    try:
        from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope  # noqa: F401
    except ImportError:
        return False
    return True


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("opentelemetry-proto")
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repair", action="store_true")
    a = ap.parse_args(argv)
    version = installed_version()
    if version is None or intact():
        return 0
    if not a.repair:
        print(f"opentelemetry.proto is xds-protos' older copy; run: {REPAIR.format(version=version)}",
              file=sys.stderr)
        return 1
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps",
                    f"opentelemetry-proto=={version}"], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
