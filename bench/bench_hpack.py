"""What decoding one ext_proc stream's header block costs: `hpack.Decoder` against h2grpc's own decoder.

Every ext_proc stream from Envoy opens with one HEADERS block, so its decode is paid on every request. Two
sequences of blocks, each encoded by one `hpack.Encoder` (Huffman on, as Envoy's encoder) and decoded in order
by one decoder per repeat, as a connection would:

- (a) Envoy's usual ext_proc header block, repeated: after the first block every field is an indexed reference;
- (b) the same with a fresh random W3C `traceparent` per block (what Envoy's tracing adds to each stream): a
  Huffman-coded literal with incremental indexing, so the table also churns.

`hpack` and h2grpc's decoder (its Huffman strings on the pure path, and on the C decoder where built) alternate
within each repeat (same process, same blocks); the figures are microseconds per block, the median and the
best of the repeats. Also: the Huffman decode of one `traceparent` alone (hpack's, h2grpc's pure path and its C
decoder `h2grpc._huffman` where built), and the memory and build time of the pure path's Huffman tables
(tracemalloc, built first, in this process).

    python -m bench.bench_hpack [--blocks 2000] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence

import hpack
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman

from h2grpc import hpack_decode, native

USUAL = [(":method", "POST"), (":scheme", "http"),
         (":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"), (":authority", "epp-extproc"),
         ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", "200m"),
         ("x-envoy-internal", "true"), ("x-request-id", "7f3c2a9e-4d1b-4c8e-9a6f-2b5d8e1c0a47"),
         ("user-agent", "envoy/1.33.0")]


def traceparent(rng: random.Random) -> str:
    return f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"


def blocks(n: int, tracing: bool, seed: int = 1) -> list[bytes]:
    """`n` blocks of one connection, in order: (a) the usual list each time, (b) with a fresh traceparent."""
    rng = random.Random(seed)
    encoder = hpack.Encoder()
    return [encoder.encode(USUAL + [("traceparent", traceparent(rng))] if tracing else USUAL) for _ in range(n)]


def hpack_decoder() -> Callable[[bytes], object]:
    decoder = hpack.Decoder(max_header_list_size=65_536)
    return lambda block: decoder.decode(block, raw=False)


def new_decoder() -> Callable[[bytes], object]:
    return hpack_decode.Decoder(65_536, 4_096).decode


def per_block_us(make: Callable[[], Callable[[bytes], object]], sequence: Sequence[bytes]) -> float:
    decode = make()
    start = time.perf_counter()
    for block in sequence:
        decode(block)
    return (time.perf_counter() - start) / len(sequence) * 1e6


def table_memory() -> tuple[int, float]:
    """(bytes the Huffman tables hold, build ms): built here first under tracemalloc for the bytes, then
    rebuilt without it for the time (the best of three)."""
    if hpack_decode._NEXT is not None:
        raise RuntimeError("the Huffman tables were built before they could be measured")
    tracemalloc.start()
    hpack_decode.huffman_tables()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    times = []
    for _ in range(3):
        hpack_decode._NEXT = None
        start = time.perf_counter()
        hpack_decode.huffman_tables()
        times.append((time.perf_counter() - start) * 1e3)
    return held, min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    held, build_ms = table_memory()
    huffmans: list[tuple[str, Callable[[bytes], bytes]]] = [("pure", hpack_decode.huffman_decode_py)]
    if native.MODULE is not None:
        huffmans.append(("C", native.MODULE.decode))
    result: dict[str, object] = {"blocks": args.blocks, "repeats": args.repeats, "huffman_c": native.MODULE is not None,
                                 "pure_tables_kib": round(held / 1024), "pure_tables_build_ms": round(build_ms, 1)}
    print(f"Huffman tables (pure path): {held / 1024:.0f} KiB held, built in {build_ms:.0f} ms (once, at the first "
          f"Huffman string)")
    active = hpack_decode.huffman_decode
    for key, name, tracing in (("usual", "(a) usual block, repeated", False),
                               ("traceparent", "(b) + fresh traceparent", True)):
        sequence = blocks(args.blocks, tracing)
        expected = [list(h) for h in map(hpack_decoder(), sequence)]  # type: ignore[call-overload]
        times: dict[str, list[float]] = {"hpack": [], **{f"h2grpc {label}": [] for label, _ in huffmans}}
        for label, huffman in huffmans:
            hpack_decode.huffman_decode = huffman
            decode = new_decoder()
            assert [decode(b) for b in sequence] == expected, f"the decoders disagree (Huffman: {label})"
        for _ in range(args.repeats):  # alternating, in this process
            times["hpack"].append(per_block_us(hpack_decoder, sequence))
            for label, huffman in huffmans:
                hpack_decode.huffman_decode = huffman
                times[f"h2grpc {label}"].append(per_block_us(new_decoder, sequence))
        hpack_decode.huffman_decode = active
        octets = sum(map(len, sequence)) / len(sequence)
        print(f"{name}: {octets:.0f} octets a block on average; us per block, median (best) of {args.repeats}: "
              + ", ".join(f"{label} {statistics.median(t):.2f} ({min(t):.2f})" for label, t in times.items()))
        result[f"block_{key}_us"] = {"octets": round(octets, 1), **{
            f"{label.replace(' ', '_')}_{stat}": round(fn(t), 3) for label, t in times.items()
            for stat, fn in (("median", statistics.median), ("best", min))}}
    coded = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(traceparent(random.Random(2)).encode())
    runs = 20_000
    decoders: list[tuple[str, Callable[[bytes], bytes]]] = [("hpack", decode_huffman),
                                                             ("h2grpc pure", hpack_decode.huffman_decode_py)]
    if native.MODULE is not None:
        decoders.append(("h2grpc C", native.MODULE.decode))
    result["traceparent_huffman_octets"] = len(coded)
    for label, fn in decoders:
        best = min(_loop(fn, coded, runs) for _ in range(args.repeats))
        print(f"Huffman decode of one traceparent ({len(coded)} octets), {label}: {best:.2f} us (best)")
        result[f"traceparent_huffman_us_{label.replace(' ', '_')}"] = round(best, 3)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


def _loop(fn: Callable[[bytes], bytes], data: bytes, runs: int) -> float:
    start = time.perf_counter()
    for _ in range(runs):
        fn(data)
    return (time.perf_counter() - start) / runs * 1e6


if __name__ == "__main__":
    main()
