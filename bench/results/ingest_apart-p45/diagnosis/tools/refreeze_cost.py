"""Instructions of one refreeze after 1,000 workers were added to a shard-sized heap: the full one (unfreeze,
collect everything, freeze) against collect(1) + freeze. Run under callgrind, toggled on the collector."""
import gc
import sys

import epp_extproc.ingest.server  # noqa: F401  the shard's imports: its start-up heap
from epp_extproc.heap import Refreezer, freeze_startup_heap


class Sub:
    def __init__(self, i: int) -> None:
        self.me = self  # a subscription and its task refer to each other
        self.state = {"addr": f"10.0.{i // 250}.{i % 250}:8000", "stats": [0] * 8, "seen": {}}
        self.parts = [[i, j] for j in range(40)]


# automatic collections run during set-up, as in a shard; "none" counts them alone, to subtract
freeze_startup_heap()
workers = [Sub(i) for i in range(1000)]  # ~45 tracked objects each
r = Refreezer(quiet_s=0.0, min_interval_s=0.0)
r.changed(removed=sys.argv[1] == "full")
if sys.argv[1] != "none":
    r.maybe()
print(sys.argv[1], "frozen", gc.get_freeze_count(), "full", r.full_refreezes)
sys.stdout.flush()
import os  # noqa: E402

os._exit(0)  # no shutdown collections in the count
