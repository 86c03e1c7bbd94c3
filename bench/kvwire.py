"""Moved to :mod:`epp_extproc.dev.kvwire` (tests and benchmarks share it there); this re-export stays for a
release."""

from epp_extproc.dev.kvwire import (  # noqa: F401
    cleared_event,
    pack_all_int64,
    pack_batch,
    removed_event,
    stored_event,
)
