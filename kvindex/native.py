"""The optional C accelerator of the KV-event ingest (``kvindex._native``, built from kvindex/_csrc/native.c by
``pip install``; see setup.py): ``chain`` hashes a whole chain in one call, ``decode`` reads the common batch
shape without one Python int per token id.  One core ingests about 0.6-0.7M blocks/s in pure Python and
about twice that with it (bench/README.md, "4. The index alone"): msgpack's unpacking alone, which makes an
int per token id, is slower than the 1M blocks/s target once hashing and insert are added.

``MODULE`` is the loaded module, or None: not built (a failed or skipped compile: logged once here, at
WARNING) or turned off with ``EPP_KVINDEX_PURE=1`` (the tests run both paths this way).  Every caller keeps a
pure-Python path that gives byte-identical hashes, decodes and index state.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)

PURE_ENV = "EPP_KVINDEX_PURE"


def _load() -> ModuleType | None:
    if os.environ.get(PURE_ENV, "").strip() not in ("", "0"):
        log.info("kvindex: %s is set: KV-event ingest runs in pure Python", PURE_ENV)
        return None
    try:
        mod = importlib.import_module("kvindex._native")
    except ImportError as exc:
        log.warning("kvindex: the C accelerator kvindex._native is not built (%s): KV-event ingest runs in pure "
                    "Python, about half as fast; reinstall where a C compiler and the Python headers are present "
                    "to build it", exc)
        return None
    return mod


MODULE = _load()
