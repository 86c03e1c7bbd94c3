"""The optional C accelerator of h2grpc's HPACK decoder (``h2grpc._huffman``, built from h2grpc/_csrc/huffman.c
by ``pip install``; see setup.py): ``decode`` decodes a Huffman string (RFC 7541 §5.2) in one call, where the
pure-Python decoder (``hpack_decode.huffman_decode_py``) walks a transition table one input octet at a time.
With Envoy's tracer on, every ext_proc stream carries a fresh Huffman-coded ``traceparent``, and its decode in
Python was the largest single part of what tracing at 10% adds to the picker's work per request (README,
"Tracing", "Where envoy10's extra goes").

``MODULE`` is the loaded module, or None: not built (a failed or skipped compile: logged once here, at
WARNING) or turned off with ``EPP_H2GRPC_PURE=1`` (the tests run both paths this way).  The pure path stays,
with identical results and errors.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)

PURE_ENV = "EPP_H2GRPC_PURE"


def _load() -> ModuleType | None:
    if os.environ.get(PURE_ENV, "").strip() not in ("", "0"):
        log.info("h2grpc: %s is set: HPACK Huffman strings are decoded in pure Python", PURE_ENV)
        return None
    try:
        mod = importlib.import_module("h2grpc._huffman")
    except ImportError as exc:
        log.warning("h2grpc: the C accelerator h2grpc._huffman is not built (%s): HPACK Huffman strings are "
                    "decoded in pure Python (~2 us more per fresh traceparent); reinstall where a C "
                    "compiler and the Python headers are present to build it", exc)
        return None
    return mod


MODULE = _load()
