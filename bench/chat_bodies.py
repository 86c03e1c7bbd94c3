"""The chat bodies of the overhead benchmarks: one long system prompt shared by every request (so render and
KV scoring have real work), then a short question of its own. Its own module so that `bench_overhead` and
`request_floor` (which `bench_overhead` runs) both use it without importing each other."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

WORDS = ("alpha beta gamma delta kernel cache block token route prefix worker envoy picker tensor batch "
         "decode prefill latency stream queue").split()


def make_bodies(n_words: int) -> Callable[[int], bytes]:
    rng = random.Random(3)
    system = " ".join(rng.choice(WORDS) for _ in range(n_words))

    def make(i: int) -> bytes:
        return json.dumps({"model": "mock-model", "max_tokens": 1, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {i}: " + " ".join(rng.choice(WORDS) for _ in range(12))}],
        }).encode()
    return make
