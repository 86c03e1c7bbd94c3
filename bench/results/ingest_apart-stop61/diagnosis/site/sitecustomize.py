"""Diagnostic (issue 45): log every GC collection of every process with wall-clock stamps."""

import os

if os.environ.get("P45_GCLOG"):
    import gc
    import sys
    import time

    _fd = os.open(os.environ["P45_GCLOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _st = {}
    _pid = os.getpid()
    _role = " ".join(sys.argv[1:4])[:40] if len(sys.argv) > 1 else "?"

    def _cb(phase, info):
        if phase == "start":
            _st["t"] = time.perf_counter()
            _st["w"] = time.monotonic()
        else:
            d = time.perf_counter() - _st.get("t", time.perf_counter())
            if info["generation"] >= 1 or d > 0.001:
                os.write(
                    _fd,
                    f"gc {os.getpid()} {_st['w']:.6f} gen={info['generation']} ms={d * 1000:.3f} collected={info['collected']} cnt={gc.get_count()} frozen={gc.get_freeze_count()}\n".encode(),
                )

    gc.callbacks.append(_cb)
