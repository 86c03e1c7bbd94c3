"""Hold resources of one kind for a while (what a 1,000-worker bench run holds), stamping the phases."""

import json
import mmap
import os
import socket
import sys
import time

phases = []


def hold(kind, n, s):
    objs = []
    if kind == "unixpairs":
        objs = [socket.socketpair() for _ in range(n)]
    elif kind == "pipes":
        objs = [os.pipe() for _ in range(n)]
    elif kind == "mem":
        m = mmap.mmap(-1, n << 20)
        for i in range(0, n << 20, 4096):
            m[i] = 1
        objs = [m]
    elif kind == "tcplisten":
        for _ in range(n):
            s_ = socket.socket()
            s_.bind(("127.0.0.1", 0))
            s_.listen()
            objs.append(s_)
    t0 = time.monotonic()
    time.sleep(float(os.environ.get("P45_HOLD", "10")))
    phases.append((kind, n, t0, time.monotonic()))
    for o in objs:
        if isinstance(o, tuple):
            for x in o:
                x.close() if hasattr(x, "close") else os.close(x)
        else:
            o.close()


for arg in sys.argv[1:]:
    k, n = arg.split(":")
    hold(k, int(n), 10.0)
print(json.dumps(phases))
