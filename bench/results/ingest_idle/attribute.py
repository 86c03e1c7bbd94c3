"""Share of a py-spy raw (collapsed) profile per part of the picker: `python attribute.py FILE...`.

Line numbers are /work/main's render_fingerprint.py before the fix (93: the due list, 96: retain, 98: the
next due time); `worker HTTP` is every stack through adapters/http1.py (here: the fingerprint reads)."""
import collections
import sys

PARTS = [("render_fingerprint.py:93", "fingerprint watcher: due list over every entry"),
         ("render_fingerprint.py:96", "fingerprint watcher: retain (set of every entry)"),
         ("render_fingerprint.py:98", "fingerprint watcher: next due time over every entry"),
         ("http1.py", "worker HTTP (fingerprint reads: connects, GETs)"),
         ("FingerprintWatcher", "fingerprint watcher: the rest"),
         ("SubscriberManager", "kv ingest (subscriber, decode, index)"), ("KvIndex", "kv ingest (subscriber, decode, index)")]
for path in sys.argv[1:]:
    c: collections.Counter[str] = collections.Counter()
    tot = 0
    for line in open(path):
        st, _, n = line.rpartition(" ")
        tot += int(n)
        c[next((v for k, v in PARTS if k in st), "other (uvloop's own code, timers, ...)")] += int(n)
    print(path, "samples", tot)
    for k, v in c.most_common():
        print(f"  {v:5d} {v / tot:6.1%} {k}")
