"""`--max-buffered-body-bytes` held in the picker's resident memory, not only in its counters (issue 43).

The real `epp-extproc` runs in its own process (tests/integration/body_rss.py) and its VmRSS is read from /proc
against a baseline taken in the same run, after a warm-up call; every reading follows two PINGs answered (the
picker has read every frame sent before them and run the handlers they woke), so nothing here waits for a
time. The bound asserted is the README's: the budget B plus 1 MiB per unfinished message, with 10% of B for
what the interpreter itself does meanwhile (the figures are well apart: before the fix the same attacks held
1.5-2.2 x B, after it 0.9 x B).

Each attack is k calls whose bodies together pass B, sent interleaved, never finished:
- `chunks`: FULL_DUPLEX_STREAMED-shaped 64 KiB messages, run twice: the second round is the one glibc's
  rising mmap threshold used to put on the heap, in buffers copied as they grew and holes left resident;
- `both`: half of each body as a whole message, the other half as an unfinished one: the exchange and the
  transport each held up to B on their own, and the servicer kept the whole message's protobuf as well.

The quick module scales B to 64 MiB; `slow` runs the issue's own figures (ten 30 MB bodies, B = 256 MiB).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp_extproc.dev import procs
from tests.integration.body_rss import MiB, attack, start_picker


def _run(workdir: Path, budget: int, max_body: int, calls: int, size: int) -> dict[str, dict[str, float]]:
    """Warm-up, then chunks twice and both twice on one picker; each round's figures (bytes)."""
    p: procs.Proc = start_picker(workdir, "h2", ("--max-buffered-body-bytes", str(budget), "--max-body-bytes",
                                                 str(max_body)))
    try:
        async def main() -> dict[str, dict[str, float]]:
            out: dict[str, dict[str, float]] = {}
            # warm-up: the first requests' imports and caches, and the heap the small blocks of a chunked body
            # settle in (kept for the next ones, as the second round shows), are not the bodies' memory. The
            # warm-up's chunked round is full-size: after a smaller one the allocator's one-time step of 7-9 MB
            # landed in the first measured round in some runs and in the second in others (CI: kept +6, +13,
            # +13, +13 MB, read as growth), so the rounds measured now all come after it
            await attack(p, "both", 1, 200_000)
            await attack(p, "chunks", calls, size)
            for tag, shape in (("chunks1", "chunks"), ("chunks2", "chunks"), ("both1", "both"), ("both2", "both")):
                out[tag] = await attack(p, shape, calls, size)
            return out

        figures = asyncio.run(main())
    finally:
        p.stop()
    base = figures["chunks1"]["base"]
    for tag, f in figures.items():
        print(f"{tag}: base {f['base'] / 1e6:.0f} MB, held +{(f['held'] - base) / 1e6:.0f} MB, peak "
              f"+{(f['peak'] - base) / 1e6:.0f} MB, after +{(f['after'] - base) / 1e6:.0f} MB, "
              f"{f['ended']:.0f} of {calls} calls ended (sent {f['sent'] / 1e6:.0f} MB, budget {budget / 1e6:.0f} MB)")
    return figures


def _check(figures: dict[str, dict[str, float]], budget: int, calls: int) -> None:
    base = figures["chunks1"]["base"]  # one baseline for every round: a later round may not grow past it
    bound = budget + calls * MiB + budget // 10
    for tag, f in figures.items():
        assert f["sent"] > budget, tag  # the attack passes the budget: the bound is the budget's, not the sender's
        assert f["held"] - base <= bound, (tag, (f["held"] - base) / 1e6, bound / 1e6)
        # freed with the calls: what stays is the allocator's and the interpreter's warm state (0-15 MB measured
        # on a loaded 2-core machine at a 64 MiB budget), a quarter of the budget at most, and it does not grow
        assert f["after"] - base <= budget // 4, (tag, (f["after"] - base) / 1e6)
        assert f["ended"] < calls, tag  # some bodies were held: the bound was met by holding, not refusing all
    # no round keeps more than the least an earlier round kept: a first round's warm state released a round later
    # (+11 MB, then 0, 0, 0 in one CI run) is not growth; 0, 7, 14 MB would be
    afters = [f["after"] for f in figures.values()]
    for i in range(1, len(afters)):
        assert afters[i] - min(afters[:i]) <= budget // 10, [round((a - base) / 1e6) for a in afters]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, float]]]:
    yield _run(tmp_path_factory.mktemp("body-rss"), 64 * MiB, 16 * MiB, 8, 12_000_000)


def test_unfinished_bodies_hold_at_most_the_budget_in_resident_memory(quick) -> None:  # noqa: ANN001
    _check(quick, 64 * MiB, 8)


def test_a_second_round_of_chunked_bodies_grows_no_further_than_the_first(quick) -> None:  # noqa: ANN001
    first, second = quick["chunks1"], quick["chunks2"]
    assert second["held"] - first["held"] <= 64 * MiB // 10, ((second["held"] - first["held"]) / 1e6)


@pytest.mark.slow
def test_the_issues_ten_unfinished_30_mb_bodies_hold_at_most_256_mib(tmp_path: Path) -> None:
    _check(_run(tmp_path, 256 * MiB, 32 * MiB, 10, 30_000_000), 256 * MiB, 10)
