"""The optional C accelerator (kvindex._native, kvindex/native.py) against the pure-Python path it shadows.

Hashes, decodes and index state must be identical whichever path runs: the differential tests feed both the
same generated and hostile payloads. A decode the accelerator declines (None) is the pure path's; a decode it
accepts must equal the pure path's, field for field. Hostile input (truncated, oversized lengths, wrong
types, deep nesting, random bytes) must never crash it or make it read out of bounds. The whole kvindex suite
also runs with ``EPP_KVINDEX_PURE=1`` (the pure path alone).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
import struct
import subprocess
import sys
from array import array
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvindex.index as kvindex_index
from epp_extproc.dev.kvwire import cleared_event, pack_batch, removed_event, stored_event
from kvindex import decode, hashing, native
from kvindex.index import KvIndex

ROOT = Path(__file__).resolve().parents[2]
_native = native.MODULE
needs_native = pytest.mark.skipif(_native is None, reason="kvindex._native is not built or EPP_KVINDEX_PURE is set")
U64 = (1 << 64) - 1


def test_the_accelerator_is_built_where_a_c_compiler_is_present():
    """`pip install` (or `python setup.py build_ext --inplace`) builds it wherever gcc/cc is found."""
    if os.environ.get(native.PURE_ENV, "") not in ("", "0"):
        pytest.skip("the pure path is forced")
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert _native is not None, "kvindex._native is not built: run `python setup.py build_ext --inplace`"


def test_pure_env_turns_the_accelerator_off_everywhere():
    code = ("import kvindex.native as n, kvindex.hashing as h, kvindex.decode as d, kvindex.index as i;"
            "assert n.MODULE is None and d._native_decode is None;"
            "assert h.chain_hashes is h.chain_hashes_py and i.chain_for_index is h.chain_blocks_py")
    env = {**os.environ, native.PURE_ENV: "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT, timeout=60)


def test_a_missing_build_falls_back_to_pure_python_with_a_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "kvindex._native", None)  # makes `from kvindex import _native` fail
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="kvindex.native"):
        assert native._load() is None
    assert "not built" in caplog.text and "pure Python" in caplog.text


def test_a_failed_compile_does_not_fail_the_build(tmp_path):
    """The extension is optional: with a compiler that fails, the build says so and succeeds."""
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    shutil.copytree(ROOT / "kvindex" / "_csrc", tmp_path / "kvindex" / "_csrc")
    (tmp_path / "kvindex" / "__init__.py").write_text("")
    env = {**os.environ, "CC": "false", "LDSHARED": "false"}
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "kvindex._native" in proc.stdout + proc.stderr and "failed" in (proc.stdout + proc.stderr).lower()
    assert not list((tmp_path / "kvindex").glob("_native*"))


# ----------------------------------------------------------------------------------------------- hashing
def test_chain_hashes_are_todays_values():
    """Golden values of the pure path (the request side hashes prompts the same way): whichever path runs."""
    toks = list(range(1000, 1000 + 96))
    assert hashing.block_hashes(toks, 32) == hashing.chain_hashes_py(hashing.pack_tokens(toks), 96, 32, 1337)
    assert hashing.block_hashes(toks, 32)[0] == hashing._xxh3(struct.pack("<32I", *toks[:32]), 1337)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.integers(1, 70), st.integers(0, U64))
def test_native_chain_equals_the_pure_chain(toks, bs, seed):
    packed = hashing.pack_tokens(toks)
    n = len(toks) // bs
    assert _native.chain(packed, n, bs, seed) == hashing.chain_blocks_py(packed, n, bs, seed)
    assert hashing.chain_hashes(packed, len(toks), bs, seed) == hashing.chain_hashes_py(packed, len(toks), bs, seed)
    assert _native.chain(packed.tobytes(), n, bs, seed) == hashing.chain_blocks_py(packed, n, bs, seed)


def _fromlist(ids: list) -> array:
    """What pack_tokens did before the accelerator packed lists (and still does without it)."""
    a = array("I")
    a.fromlist(ids)
    return a


class _Index:
    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


class _Int(int):
    pass


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 2**30 + 5), st.booleans(),
                          st.integers(0, 2**32 - 1).map(_Index), st.integers(0, 2**32 - 1).map(_Int)), max_size=300))
def test_native_pack_u32_is_fromlist(ids):
    """dec45: a list of token ids packs to the same u32s through the accelerator as through array.fromlist,
    whatever int-like values it holds (bools, int subclasses, objects with __index__, 1- and 2-digit ints)."""
    assert hashing.pack_tokens(ids) == _fromlist(ids)
    assert hashing.pack_tokens(ids).typecode == "I"


@needs_native
@pytest.mark.parametrize("bad", [[1, -1], [1, 2**32], [2**64], [-(2**70)], [1, 1.5], [1, "2"], [None], [1, _Index(-3)],
                                 [_Index(2**32)], [_Int(-1)]])
def test_native_pack_u32_refuses_what_fromlist_refuses_with_the_same_error(bad):
    with pytest.raises((TypeError, OverflowError)) as want:
        _fromlist(bad)
    with pytest.raises(want.type) as got:
        hashing.pack_tokens(bad)
    assert str(got.value) == str(want.value)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, U64), st.integers(0, 2**30 + 5), st.integers(2**59, 2**61), st.booleans(),
                          st.integers(0, U64).map(_Index), st.integers(0, U64).map(_Int)), max_size=300))
def test_native_pack_u64_is_array_q(values):
    """dec45: block hashes pack to the same u64s through the accelerator as through array('Q', list) (what a
    lookup and a prediction send), whatever int-like values the list holds."""
    got = hashing.pack_u64(values)
    assert got == array("Q", values) and got.typecode == "Q"
    assert hashing.pack_u64(got) is got and hashing.pack_u64(tuple(values)) == got


@needs_native
@pytest.mark.parametrize("bad", [[1, -1], [2**64], [U64, 2**64 + 5], [-(2**70)], [1.5], ["2"], [None], [_Index(-3)],
                                 [_Index(2**64)], [_Int(-1)], [2**90]])
def test_native_pack_u64_refuses_what_array_q_refuses_with_the_same_error(bad):
    with pytest.raises((TypeError, OverflowError)) as want:
        array("Q", bad)
    with pytest.raises(want.type) as got:
        hashing.pack_u64(bad)
    assert str(got.value) == str(want.value)
    with pytest.raises(ValueError):
        _native.pack_u64([1, 2], array("Q", [0]))
    with pytest.raises(ValueError):
        _native.pack_u64([1], array("I", [0, 0]))  # 8 bytes, but not of u64 items


@needs_native
def test_native_pack_u32_stops_when_the_list_changes_size_and_checks_its_buffer():
    ids: list = [1, 2, 3]

    class Shrinks:
        def __index__(self) -> int:
            ids.pop()
            return 7

    ids.insert(1, Shrinks())
    with pytest.raises(RuntimeError, match="changed size"):
        _native.pack_u32(ids, array("I", [0]) * len(ids))
    with pytest.raises(ValueError):
        _native.pack_u32([1, 2], array("I", [0]))
    with pytest.raises(ValueError):
        _native.pack_u32([1], bytearray(4))  # 4 bytes, but not of u32 items
    with pytest.raises(TypeError):
        _native.pack_u32((1, 2), array("I", [0, 0]))  # a list only: pack_tokens sends anything else to array()
    assert hashing.pack_tokens([]) == array("I")


@needs_native
@pytest.mark.parametrize("args", [(1, 4, 0), (-1, 4, 0), (0, 0, 0), (0, -1, 0), (1, 1 << 62, 0)])
def test_native_chain_refuses_a_buffer_shorter_than_its_blocks(args):
    with pytest.raises(ValueError):
        _native.chain(array("I", [1, 2, 3]), *args)


@needs_native
@pytest.mark.parametrize("args", [("x", 1, 1, 0), (b"", 0, 1, 1.5), (b"", "0", 1, 0)])
def test_native_chain_refuses_wrong_types(args):
    with pytest.raises(TypeError):
        _native.chain(*args)


@needs_native
@pytest.mark.parametrize("seed", [-1, 1 << 64, (1 << 64) + 5, -(1 << 70)])
def test_native_chain_wraps_an_out_of_range_seed_as_xxhash_does(seed):
    packed = hashing.pack_tokens(list(range(8)))
    assert _native.chain(packed, 2, 4, seed) == hashing.chain_blocks_py(packed, 2, 4, seed)


# ------------------------------------------------------------------------------------------------ decode
def _py(p: object, max_events: int | None = None) -> decode.DecodedBatch:
    return decode._decode_payload_py(p, max_events)  # type: ignore[arg-type]


def _fast(p: object, max_events: int | None = None) -> decode.DecodedBatch | None:
    return decode._decode_native(p, max_events)


def _same(p: object, max_events: int | None = None) -> decode.DecodedBatch | None:
    """The accelerator's answer (None: declined) after checking it is the pure path's, and that the public
    entry point gives the pure path's answer either way."""
    py = _py(p, max_events)
    fast = _fast(p, max_events) if _native is not None else None
    if fast is not None:
        if py.ts != py.ts:  # a NaN ts (random bytes can make one): equal as NaN, the rest compared as usual
            assert fast.ts != fast.ts
            assert dataclasses.replace(fast, ts=0.0) == dataclasses.replace(py, ts=0.0)
        else:
            assert fast == py
        assert [type(e.token_ids) for e in fast.events if hasattr(e, "token_ids")] == \
               [type(e.token_ids) for e in py.events if hasattr(e, "token_ids")]
    public = decode.decode_payload(p, max_events)  # type: ignore[arg-type]
    assert public == py or (py.ts != py.ts and public.ts != public.ts)
    return fast


def _plain(rng: random.Random, dialect: str, n_events: int = 3) -> bytes:
    events: list[object] = []
    parent = None
    for _ in range(n_events):
        k = rng.randint(1, 8)
        hs = [rng.getrandbits(64) - (1 << 63) for _ in range(k)]
        toks = [rng.choice((rng.randrange(128), rng.randrange(256), rng.randrange(65536), rng.randrange(2**32)))
                for _ in range(k * 4)]
        ev = stored_event(hs, parent, toks, 4, **({"extra_keys": None, "group_idx": 0} if "vllm" in dialect else {}))
        if dialect == "vllm-array":
            ev = ["BlockStored", ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"], 4, None, "GPU", None]
        events.append(ev)
        parent = hs[-1]
    events.append(removed_event([parent]) if dialect != "vllm-array" else ["BlockRemoved", [parent], "GPU"])
    events.append(cleared_event() if dialect != "vllm-array" else ["AllBlocksCleared"])
    return pack_batch(events, all_int64=dialect == "trtllm-int64", rank=rng.choice((None, 0, 3)))


@needs_native
@pytest.mark.parametrize("dialect", ["vllm", "vllm-array", "trtllm", "trtllm-int64"])
def test_the_accelerator_decodes_every_engines_plain_batches_as_the_pure_path_does(dialect):
    rng = random.Random(dialect)
    for _ in range(200):
        assert _same(_plain(rng, dialect)) is not None  # accepted, and equal


@needs_native
def test_a_text_chains_extra_keys_of_nils_and_optional_keys_stay_on_the_fast_path():
    ev = stored_event([1, 2], None, list(range(8)), 4, extra_keys=[None, None], group_idx=0, event_version=1,
                      kv_cache_spec_kind="full", locality="local", session_id=None)
    assert _same(pack_batch([ev, stored_event([3], 2, [1, 2, 3, 4], 4, extra_keys=[])])) is not None
    assert _same(pack_batch([ev], envelope="array2")) is not None


@pytest.mark.parametrize("ev", [
    stored_event([1], None, [1, 2, 3, 4], 4, lora_name="a", lora_id=1),
    stored_event([1], None, [1, 2, 3, 4], 4, extra_keys=[["salt"]]),
    stored_event([1], None, [1, 2, 3, 4], 4, cache_salt="s"),
    stored_event([1], None, [1, 2, 3, 4], 4, medium="CPU"),
    stored_event([1], None, [1, 2, 3, 4], 4, group_idx=1),
    stored_event([1], None, [1, 2, 3], 4),
    stored_event([1], None, [1, 2, 3, -4], 4),
    stored_event([1], None, [1, 2, 3, 1 << 32], 4),
    stored_event([1], None, [1, 2, 3, True], 4),
    stored_event([1], None, [[1, 2], [2, 3], [3, 4], [4, 0]], 4),
    stored_event([b"\x01" * 32], None, [1, 2, 3, 4], 4),
    stored_event([1], b"\x02" * 32, [1, 2, 3, 4], 4),
    stored_event([], None, [], 4),
    stored_event([1], None, [1, 2, 3, 4], 0),
    stored_event([1], None, [1, 2, 3, 4], 4.0),
    stored_event([1], None, [1, 2, 3, 4], 4, mm_keys=[[{"hash": "ab", "start_offset": 0}]]),
    stored_event([1], None, [1, 2, 3, 4], 4, brand_new_key=1),
    stored_event([1], None, [1, 2, 3, 4], 4, locality="\u00e9"),
    {"type": "Unknown"},
    {"type": 5},
    {"no_type": 1},
    removed_event([1], medium="CPU"),
    removed_event([1], token_ids=[1]),
    ["BlockStored", [1], None, [1, 2, 3, 4]],
    ["AllBlocksCleared", 1],
    [],
    7,
])
def test_shapes_beyond_the_common_one_are_left_to_the_pure_path(ev):
    assert _same(pack_batch([ev])) is None or _native is None


def test_envelopes_beyond_the_common_one_are_left_to_the_pure_path():
    ev = stored_event([1], None, [1, 2, 3, 4], 4)
    for p in (pack_batch([ev], envelope="map"), msgpack.packb([1, [ev], 0]), msgpack.packb([1.0, [ev], 1 << 16]),
              msgpack.packb([1.0, [ev], -1]), msgpack.packb([1.0, [ev], 0, 0]), pack_batch([ev]) + b"\x00",
              msgpack.packb([1.0, [ev], "r"]), msgpack.packb([1.0]), msgpack.packb({"ts": 1.0})):
        assert _same(p) is None or _native is None


def test_the_event_budget_and_non_bytes_payloads_are_the_pure_paths():
    p = pack_batch([removed_event([1])] * 5)
    assert _same(p, max_events=4) is None or _native is None
    assert _py(p, max_events=4).garbage
    assert _same(p, max_events=5) is not None or _native is None
    for bad in ("text", 5, None, array("I", [1])):
        assert _same(bad) is None
    assert _same(memoryview(p)) is not None or _native is None
    assert _same(bytearray(p)) is not None or _native is None


# values a field may take: the common shape's and everything the pure path must judge
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.sampled_from(["GPU", "CPU", "", "x", "BlockStored", "\u00e9"]), st.binary(max_size=4))
_ints = st.lists(st.integers(-5, 2**32 + 5) | st.integers(0, 2**64 - 1), max_size=12)
_value = st.one_of(_scalar, _ints, st.lists(_scalar, max_size=3), st.lists(st.lists(_scalar, max_size=2), max_size=2),
                   st.dictionaries(st.sampled_from(["type", "name", "salt"]), _scalar, max_size=2))
_keys = st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                         "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "event_version", "cache_salt",
                         "mm_keys", "locality", "other"])


@st.composite
def _event(draw):
    """Mostly near-plain events (so both paths see many accepted ones), with fields bent at random."""
    k = draw(st.integers(1, 4))
    bs = draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]))
    ev: dict[str, object] = {"type": kind}
    if kind in ("BlockStored", "BlockRemoved"):
        ev["block_hashes"] = draw(st.lists(st.integers(-(2**63), 2**64 - 1), min_size=k, max_size=k))
        ev["medium"] = draw(st.sampled_from(["GPU", None]))
    if kind == "BlockStored":
        ev.update(parent_block_hash=draw(st.none() | st.integers(0, 2**64 - 1)), block_size=bs,
                  token_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=k * bs, max_size=k * bs)),
                  lora_id=None, lora_name=None)
    for _ in range(draw(st.integers(0, 2))):  # bend: set or delete a field
        key = draw(_keys)
        if draw(st.booleans()):
            ev[key] = draw(_value)
        else:
            ev.pop(key, None)
    if draw(st.integers(0, 4)) == 0:  # positional form
        return [ev.get("type"), *(ev.get(f) for f in decode.STORED_FIELDS[: draw(st.integers(0, 11))])]
    return ev


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_event(), max_size=4), st.booleans(), st.sampled_from(["array3", "array2", "map"]),
       st.none() | st.integers(-2, 70000))
def test_any_batch_decodes_the_same_on_both_paths(events, int64, envelope, rank):
    p = pack_batch(events, all_int64=int64, envelope=envelope, rank=rank, ts=1.5)
    _same(p)


@given(st.binary(max_size=200))
@settings(max_examples=500, deadline=None)
def test_random_bytes_never_crash_and_agree(p):
    _same(p)


def test_every_truncation_and_byte_flip_of_a_batch_agrees():
    rng = random.Random(5)
    for dialect in ("vllm", "vllm-array", "trtllm-int64"):
        p = _plain(rng, dialect, n_events=2)
        for cut in range(len(p)):
            _same(p[:cut])
        for _ in range(400):
            b = bytearray(p)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            _same(bytes(b))


def _s(text: str) -> bytes:
    b = text.encode()
    return bytes([0xA0 | len(b)]) + b


_INT_FORMS = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}


def _int(v: int, form: int | None) -> bytes:
    """`v` in one msgpack int encoding (None: a fixint), whatever the smallest one would be."""
    return struct.pack(">b", v) if form is None else bytes([form]) + struct.pack(_INT_FORMS[form], v)


def _one_block(tokens: bytes, tail: bytes) -> bytes:
    """One 4-token block with its ids last in the event and `tail` (the rank) after them: a short tail puts
    the last ids within 9 bytes of the payload's end, where they are read one bounds-checked int at a time."""
    ev = (b"\x84" + _s("type") + _s("BlockStored") + _s("block_hashes") + b"\x91\x01" + _s("block_size")
          + b"\x04" + _s("token_ids") + b"\x94" + tokens)
    return b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91" + ev + tail


def _encodable(form: int | None, value: int) -> bool:
    try:
        _int(value, form)
    except struct.error:
        return False
    return form is not None or -32 <= value <= 127


_VALUES = (0, 5, 127, -1, -4, -128, 200, -200, 40000, -40000, 2**31 + 3, -(2**31), 2**32 - 1)


@pytest.mark.parametrize(("form", "value"), [(f, v) for f in (None, *_INT_FORMS) for v in _VALUES if _encodable(f, v)])
def test_every_int_encoding_of_a_token_id_agrees(form, value):
    """msgpack may write a non-negative id in a signed form (TRT-LLM's C++ side writes every int as int64),
    and a hostile peer a negative one in any form: only ids in 0..2**32-1 are accepted, as the pure path does."""
    tok = _int(value, form)
    for tail in (b"\xc0", b"\xd3" + bytes(8)):  # the rank: 1 byte (the careful path) or 9 (the fast loop)
        for at in range(4):
            got = _same(_one_block(b"".join(tok if i == at else b"\x01" for i in range(4)), tail))
            assert (got is not None) == (_native is not None and 0 <= value < 2**32)


@pytest.mark.parametrize("p", [
    b"\x93\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff",  # 4G events claimed, none there
    b"\x93\xcb" + bytes(8) + b"\x91\xdf\xff\xff\xff\xff",  # a map of 4G keys
    b"\x93\xcb" + bytes(8) + b"\x91\x82\xa4type\xabBlockStored\xactoken_ids\xdd\x7f\xff\xff\xff\x00",
    b"\x93\xcb" + bytes(8) + b"\x91\x81\xdb\xff\xff\xff\xff",  # a key of 4 GB
    b"\x93\xcb" + bytes(8) + b"\x91" + b"\x91" * 100_000,  # deep nesting
    b"\x91" * 100_000,
    b"\x93\xcb" + bytes(8) + b"\x91\x82\xa4type\xabBlockStored\xacblock_hashes\xdc\xff",  # truncated header
    b"\x93\xcb" + bytes(8) + b"\x91\x81\xa4type\xc1",  # the never-used type byte
    b"\x93\xcb" + bytes(7),
    b"",
])
def test_hostile_lengths_and_nesting_never_crash(p):
    _same(p)


# ------------------------------------------------------------------------------------------- index state
def _state(idx: KvIndex) -> object:
    return ([dict(part) for part in idx._blocks],
            {w: [(k, list(s.engine.items()), dict(s.multi)) for k, s in idx._worker(w).slots.items()]
             for w in idx.workers()},
            {w: idx.stats(w) for w in idx.workers()})


@needs_native
def test_the_index_ends_in_the_same_state_on_both_paths(monkeypatch):
    rng = random.Random(11)
    batches = [_plain(rng, d) for d in ("vllm", "trtllm", "trtllm-int64") for _ in range(30)]
    batches += [pack_batch([stored_event([7, 8], None, [1] * 8, 4), stored_event([9, 7], None, [1] * 8, 4)])]

    def run() -> object:
        idx = KvIndex(default_block_size=4, max_blocks_per_worker=100)  # small: eviction runs too
        for i, p in enumerate(batches):
            idx.apply_batch(f"w{i % 3}", decode.decode_payload(p))
        return _state(idx)

    fast = run()
    monkeypatch.setattr(decode, "_native_decode", None)
    monkeypatch.setattr(kvindex_index, "chain_for_index", hashing.chain_blocks_py)
    assert run() == fast


def test_a_nan_ts_decodes_as_nan_on_both_paths():
    p = bytearray(pack_batch([cleared_event()], ts=1.0))
    p[2:10] = struct.pack(">d", float("nan"))
    got = _same(bytes(p))
    assert got is None if _native is None else got.ts != got.ts


def test_payload_bytes_are_not_modified():
    p = bytearray(_plain(random.Random(1), "vllm"))
    before = bytes(p)
    decode.decode_payload(p)
    assert bytes(p) == before
