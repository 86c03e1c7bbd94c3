"""h2grpc's HPACK decoder (`h2grpc.hpack_decode`): RFC 7541's Appendix C examples, `hpack.Decoder`'s results on
what `hpack.Encoder` writes (and on arbitrary bytes), and the errors a hostile peer's blocks must meet. The
connection turns any `hpack.HPACKError` into GOAWAY COMPRESSION_ERROR (tests/h2/test_bounds.py drives that)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import hpack
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2grpc import hpack_decode, native
from h2grpc.codec import HPACKError, header_decoder, hpack_int
from h2grpc.hpack_decode import Decoder, huffman_decode_py

HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
# the Huffman tests run on both paths: the pure one always, the C one (h2grpc._huffman) where it is built
HUFFMAN_DECODERS = [
    pytest.param(huffman_decode_py, id="pure"),
    pytest.param(native.MODULE.decode if native.MODULE is not None else None, id="c",
                 marks=pytest.mark.skipif(native.MODULE is None, reason="h2grpc._huffman is not built")),
]


def blocks(*hexes: str) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


# --- RFC 7541 Appendix C ------------------------------------------------------------------------------------

REQUESTS = [
    [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")],
    [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"),
     ("cache-control", "no-cache")],
    [(":method", "GET"), (":scheme", "https"), (":path", "/index.html"), (":authority", "www.example.com"),
     ("custom-key", "custom-value")],
]
REQUEST_TABLES = [  # (the dynamic table after each request, newest first; its size)
    ([(":authority", "www.example.com")], 57),
    ([("cache-control", "no-cache"), (":authority", "www.example.com")], 110),
    ([("custom-key", "custom-value"), ("cache-control", "no-cache"), (":authority", "www.example.com")], 164),
]
DATE1, DATE2 = "Mon, 21 Oct 2013 20:13:21 GMT", "Mon, 21 Oct 2013 20:13:22 GMT"
LOCATION, COOKIE = "https://www.example.com", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
RESPONSES = [
    [(":status", "302"), ("cache-control", "private"), ("date", DATE1), ("location", LOCATION)],
    [(":status", "307"), ("cache-control", "private"), ("date", DATE1), ("location", LOCATION)],
    [(":status", "200"), ("cache-control", "private"), ("date", DATE2), ("location", LOCATION),
     ("content-encoding", "gzip"), ("set-cookie", COOKIE)],
]
RESPONSE_TABLES = [  # at table size 256 the second and third responses evict
    ([("location", LOCATION), ("date", DATE1), ("cache-control", "private"), (":status", "302")], 222),
    ([(":status", "307"), ("location", LOCATION), ("date", DATE1), ("cache-control", "private")], 222),
    ([("set-cookie", COOKIE), ("content-encoding", "gzip"), ("date", DATE2)], 215),
]


def decode_in_sequence(decoder: Decoder, sequence: list[bytes]) -> list[tuple[list[tuple[str, str]],
                                                                               list[tuple[str, str]], int]]:
    return [(decoder.decode(b), decoder.dynamic_table, decoder.dynamic_table_octets) for b in sequence]


def expected(lists: list, tables: list) -> list:
    return [(fields, table, size) for fields, (table, size) in zip(lists, tables, strict=True)]


def test_rfc7541_c3_requests_without_huffman_decode_in_sequence() -> None:
    sequence = blocks("828684410f7777772e6578616d706c652e636f6d", "828684be58086e6f2d6361636865",
                      "828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565")
    assert decode_in_sequence(Decoder(), sequence) == expected(REQUESTS, REQUEST_TABLES)


def test_rfc7541_c4_requests_with_huffman_decode_in_sequence() -> None:
    sequence = blocks("828684418cf1e3c2e5f23a6ba0ab90f4ff", "828684be5886a8eb10649cbf",
                      "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf")
    assert decode_in_sequence(Decoder(), sequence) == expected(REQUESTS, REQUEST_TABLES)


def test_rfc7541_c5_responses_without_huffman_evict_at_table_size_256() -> None:
    decoder = Decoder(max_allowed_table_size=256)
    decoder.header_table_size = 256
    sequence = blocks(
        "4803333032580770726976617465611d4d6f6e2c203231204f637420323031332032303a31333a323120474d546e17687474"
        "70733a2f2f7777772e6578616d706c652e636f6d",
        "4803333037c1c0bf",
        "88c1611d4d6f6e2c203231204f637420323031332032303a31333a323220474d54c05a04677a69707738666f6f3d415344"
        "4a4b48514b425a584f5157454f50495541585157454f49553b206d61782d6167653d333630303b2076657273696f6e3d31")
    assert decode_in_sequence(decoder, sequence) == expected(RESPONSES, RESPONSE_TABLES)


def test_rfc7541_c6_responses_with_huffman_evict_at_table_size_256() -> None:
    decoder = Decoder(max_allowed_table_size=256)
    decoder.header_table_size = 256
    sequence = blocks(
        "488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff6e919d29ad171863c78f0b97c8e9ae"
        "82ae43d3",
        "4883640effc1c0bf",
        "88c16196d07abe941054d444a8200595040b8166e084a62d1bffc05a839bd9ab77ad94e7821dd7f2e6c7b335dfdfcd5b3960"
        "d5af27087f3672c1ab270fb5291f9587316065c003ed4ee5b1063d5007")
    assert decode_in_sequence(decoder, sequence) == expected(RESPONSES, RESPONSE_TABLES)


# --- the same results as hpack.Decoder ------------------------------------------------------------------

NAMES = st.one_of(st.sampled_from([":path", ":authority", "content-type", "te", "grpc-timeout", "traceparent",
                                   "user-agent", "x-request-id", "cookie", "set-cookie"]),
                  st.text(min_size=1, max_size=12))
VALUES = st.one_of(st.text(max_size=40), st.text(alphabet="0123456789abcdef-", max_size=60),
                   st.text(alphabet=st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, exclude_categories=("Cs",)), max_size=10))
FIELD = st.one_of(st.tuples(NAMES, VALUES), st.tuples(NAMES, VALUES, st.booleans()))  # bool: never indexed
BLOCK = st.tuples(st.just("block"), st.lists(FIELD, max_size=12), st.booleans())  # (.., fields, huffman)
RESIZE = st.tuples(st.just("resize"), st.integers(0, 4_096))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.one_of(BLOCK, BLOCK, BLOCK, RESIZE), min_size=1, max_size=30),
       allowed=st.sampled_from([256, 1_024, 4_096]))
def test_blocks_from_hpacks_encoder_decode_as_hpacks_decoder_decodes_them(steps: list, allowed: int) -> None:
    """Many blocks through one decoder of each kind, table size updates (several between two blocks, some to
    0) included: the same fields, in order, and the same dynamic table after each block."""
    encoder, ours, theirs = hpack.Encoder(), Decoder(65_536, allowed), hpack.Decoder(65_536)
    theirs.max_allowed_table_size = allowed
    if allowed < 4_096:  # our SETTINGS shrank the table: the peer's first block must say so
        encoder.header_table_size = allowed
    for step in steps:
        if step[0] == "resize":
            if min(step[1], allowed) != encoder.header_table_size:  # hpack's encoder forgets a pending update
                encoder.header_table_size = min(step[1], allowed)   # when set again to the same size
            continue
        block = encoder.encode(step[1], huffman=step[2])
        got = ours.decode(block)
        assert got == [tuple(h) for h in theirs.decode(block, raw=False)]
        assert got == [(str(f[0]), str(f[1])) for f in step[1]]
        assert ours.dynamic_table == [(n.decode(), v.decode()) for n, v in theirs.header_table.dynamic_entries]
        assert ours.header_table_size == theirs.header_table_size


def outcome(decode: object, block: bytes) -> object:
    try:
        return [tuple(h) for h in decode(block)]  # type: ignore[operator]
    except HPACKError:
        return "error"


MUTATIONS = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=3)


@settings(max_examples=500, deadline=None)
@given(fields=st.lists(st.tuples(NAMES, VALUES), max_size=6), huffman=st.booleans(), mutations=MUTATIONS,
       cut=st.integers(0, 300), junk=st.binary(max_size=12))
def test_mutated_and_cut_blocks_decode_or_fail_as_hpacks_decoder_does(fields: list, huffman: bool,
                                                                     mutations: list, cut: int,
                                                                     junk: bytes) -> None:
    """Hostile bytes: a valid block with octets overwritten, cut short, or followed by junk. Both decoders
    give the same fields or both raise an HPACKError (nothing else escapes ours), block after block."""
    block = bytearray(hpack.Encoder().encode(fields, huffman=huffman))
    for at, octet in mutations:
        if block:
            block[at % len(block)] = octet
    ours, theirs = Decoder(2_048, 4_096), hpack.Decoder(2_048)
    for attempt in (bytes(block[:cut]), bytes(block) + junk, junk):
        got = outcome(ours.decode, attempt)
        assert got == outcome(lambda b: theirs.decode(b, raw=False), attempt)
        if got == "error":
            break  # the connection ends at the first error: the tables are undefined after it


@pytest.mark.parametrize("huffman_decode", HUFFMAN_DECODERS)
@settings(max_examples=1_000, deadline=None)
@given(data=st.binary(max_size=24))
def test_any_bytes_huffman_decode_or_fail_as_hpacks_huffman_decoder_does(huffman_decode: Callable[[bytes], bytes], data: bytes) -> None:
    try:
        theirs: bytes | None = decode_huffman(data)
    except HPACKError:
        theirs = None
    try:
        ours: bytes | None = huffman_decode(data)
    except HPACKError:
        ours = None
    assert ours == theirs


@pytest.mark.parametrize("huffman_decode", HUFFMAN_DECODERS)
def test_every_octet_value_round_trips_through_huffman(huffman_decode: Callable[[bytes], bytes]) -> None:
    octets = bytes(range(256))
    assert huffman_decode(HUFFMAN.encode(octets)) == octets
    assert all(huffman_decode(HUFFMAN.encode(bytes((o,)) * 3)) == bytes((o,)) * 3 for o in range(256))


def test_a_never_indexed_field_is_not_added_to_the_table() -> None:
    decoder = Decoder()
    assert decoder.decode(hpack.Encoder().encode([("authorization", "secret", True)])) == \
        [("authorization", "secret")]
    assert decoder.dynamic_table == []


def test_an_entry_larger_than_the_table_empties_it() -> None:
    """RFC 7541 §4.4: not an error; the table ends empty and the field is still in the list."""
    decoder = Decoder(max_allowed_table_size=100)
    decoder.header_table_size = 100
    first = b"\x40" + hpack_int(1, 7) + b"a" + hpack_int(1, 7) + b"b"
    big = b"\x40" + hpack_int(1, 7) + b"c" + hpack_int(80, 7) + b"v" * 80
    assert decoder.decode(first + big) == [("a", "b"), ("c", "v" * 80)]
    assert decoder.dynamic_table == [] and decoder.dynamic_table_octets == 0


def test_a_memoryview_or_bytearray_block_decodes_as_bytes_do() -> None:
    block = bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff")
    assert Decoder().decode(memoryview(block)) == Decoder().decode(bytearray(block)) == REQUESTS[0]  # type: ignore[arg-type]


def test_header_decoder_gives_the_bounds_to_the_new_decoder() -> None:
    decoder = header_decoder(1_000, 2_048)
    assert isinstance(decoder, Decoder)
    assert (decoder.max_header_list_size, decoder.max_allowed_table_size) == (1_000, 2_048)


# --- what a hostile peer gets: an HPACKError, so GOAWAY COMPRESSION_ERROR ----------------------------------

LITERAL = b"\x40" + hpack_int(1, 7) + b"x" + hpack_int(4_000, 7) + b"v" * 4_000  # indexed: entry 62


@pytest.mark.parametrize("block", [b"\x40", b"\x40\x05ab", b"\x41\x05ab", b"\x00\x01", b"\x0f", b"\xff",
                                   b"\x3f", b"\x82\x84\x41"], ids=repr)
def test_a_truncated_block_is_an_error(block: bytes) -> None:
    with pytest.raises(hpack.HPACKDecodingError, match="truncated"):
        Decoder().decode(block)


def test_index_0_is_an_error() -> None:
    with pytest.raises(hpack.InvalidTableIndexError):
        Decoder().decode(b"\x80")


def test_an_index_past_the_table_is_an_error() -> None:
    decoder = Decoder()
    decoder.decode(b"\x40\x01a\x01b")  # one dynamic entry: 62
    assert decoder.decode(b"\xbe") == [("a", "b")]
    with pytest.raises(hpack.InvalidTableIndexError):
        decoder.decode(b"\xbf")


def test_a_name_index_past_the_table_is_an_error() -> None:
    with pytest.raises(hpack.InvalidTableIndexError):
        Decoder().decode(b"\x7e\x00")  # literal with incremental indexing, name at 62 of an empty table


def test_a_table_size_update_over_our_setting_is_an_error() -> None:
    decoder = Decoder(max_allowed_table_size=4_096)
    decoder.decode(hpack_int(4_096, 5, 0x20))
    with pytest.raises(hpack.InvalidTableSizeError):
        decoder.decode(hpack_int(4_097, 5, 0x20))


def test_a_table_size_update_after_a_field_is_an_error() -> None:
    with pytest.raises(hpack.HPACKDecodingError, match="after a field"):
        Decoder().decode(b"\x82" + hpack_int(0, 5, 0x20))


def test_a_table_left_over_our_setting_without_an_update_is_an_error() -> None:
    """Our SETTINGS allow 256 and the peer's table is still the protocol's 4,096: its first block must shrink it."""
    with pytest.raises(hpack.InvalidTableSizeError):
        Decoder(max_allowed_table_size=256).decode(b"\x82")
    assert Decoder(max_allowed_table_size=256).decode(hpack_int(256, 5, 0x20) + b"\x82") == [(":method", "GET")]


def test_a_header_list_over_the_limit_via_indexed_references_fails_at_the_field_that_crosses_it() -> None:
    """A block of small references to one large entry: the error comes at the 17th reference (17 x 4,033
    octets > 65,536), before the rest of the block is read (here an index 0, which would raise otherwise)."""
    with pytest.raises(hpack.OversizedHeaderListError):
        Decoder(65_536).decode(LITERAL + b"\xbe" * 16 + b"\x80")


def test_a_header_list_at_the_limit_is_decoded() -> None:
    assert len(Decoder(4_033 * 16).decode(LITERAL + b"\xbe" * 15)) == 16


@pytest.mark.parametrize("huffman_decode", HUFFMAN_DECODERS)
def test_huffman_padding_over_7_bits_is_an_error(huffman_decode: Callable[[bytes], bytes]) -> None:
    a = HUFFMAN.encode(b"a")  # 00011 + 111
    assert huffman_decode(a) == b"a"
    with pytest.raises(hpack.HPACKDecodingError, match="padding"):
        huffman_decode(a + b"\xff")


@pytest.mark.parametrize("huffman_decode", HUFFMAN_DECODERS)
def test_huffman_padding_not_all_ones_is_an_error(huffman_decode: Callable[[bytes], bytes]) -> None:
    with pytest.raises(hpack.HPACKDecodingError, match="padding"):
        huffman_decode(b"\x18")  # "a" (00011) + padding 000


@pytest.mark.parametrize("huffman_decode", HUFFMAN_DECODERS)
def test_an_eos_symbol_in_a_huffman_string_is_an_error(huffman_decode: Callable[[bytes], bytes]) -> None:
    with pytest.raises(hpack.HPACKDecodingError, match="EOS"):
        huffman_decode(b"\xff\xff\xff\xff")  # EOS (30 ones) + two ones of padding
    with pytest.raises(hpack.HPACKDecodingError, match="EOS"):
        huffman_decode(b"\x1f\xff\xff\xff\xfc" + HUFFMAN.encode(b"a"))  # "a", EOS, then more


@pytest.mark.parametrize("huffman_decode", HUFFMAN_DECODERS)
def test_bad_huffman_in_a_field_value_is_a_block_error(huffman_decode: Callable[[bytes], bytes],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hpack_decode, "huffman_decode", huffman_decode)
    with pytest.raises(hpack.HPACKDecodingError, match="padding"):
        Decoder().decode(b"\x04\x81\x18")  # literal, name :path, a Huffman value of one octet: "a" + 000


def test_an_integer_that_never_ends_is_an_error() -> None:
    with pytest.raises(hpack.HPACKDecodingError, match="continuation"):
        Decoder().decode(b"\xff" + b"\x80" * 1_000)


def test_an_integer_of_five_continuation_octets_is_decoded_as_hpack_bounds_it() -> None:
    """hpack's bound: 2^32 - 1 (a SETTINGS value's largest) takes five; a sixth is an error even if zero."""
    decoder = Decoder(max_allowed_table_size=2**32 - 1)
    update = hpack_int(2**32 - 1, 5, 0x20)
    assert len(update) == 6
    assert decoder.decode(update) == [] and decoder.header_table_size == 2**32 - 1
    with pytest.raises(hpack.HPACKDecodingError, match="continuation"):
        decoder.decode(b"\x3f\x80\x80\x80\x80\x80\x00")


def test_a_value_that_is_not_utf8_is_an_error_as_with_hpack() -> None:
    block = b"\x00\x01x\x02\xc3\x28"
    with pytest.raises(hpack.HPACKDecodingError):
        hpack.Decoder().decode(block, raw=False)
    with pytest.raises(hpack.HPACKDecodingError, match="UTF-8"):
        Decoder().decode(block)


def test_the_huffman_tables_hold_under_2_mib() -> None:
    """Built once per process, at the first Huffman string; measured in a fresh interpreter."""
    code = ("import tracemalloc; from h2grpc import hpack_decode as h; tracemalloc.start(); h.huffman_tables(); "
            "print(tracemalloc.get_traced_memory()[0])")
    held = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1 << 20 < held < 2 << 20


def test_a_transition_is_read_from_a_list_of_shared_ints_not_made_per_octet() -> None:
    """Reading an array of 16-bit states made a new int per octet of every Huffman string (~20 ns of a ~80 ns
    loop); the list hands back one of the 256 values the table holds, the same object each time."""
    next_states, _, _ = hpack_decode.huffman_tables()
    assert type(next_states) is list and len(next_states) == 65_536
    assert len({id(v) for v in next_states}) <= 256
    assert all(v & 0xFF == 0 and v >> 8 < 256 for v in next_states)


# --- values an encoder sends unindexed, again and again (Envoy's `:path`) -----------------------------------

def unindexed(name_index: int, value: str, first: int = 0x00) -> bytes:
    """A literal with a static name index (< 15) and a Huffman-coded value: without indexing (0x00, §6.2.2)
    or never indexed (0x10, §6.2.3)."""
    coded = HUFFMAN.encode(value.encode())
    return bytes((first | name_index,)) + hpack_int(len(coded), 7, 0x80) + coded


ENVOY_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def counting_huffman(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = hpack_decode.huffman_decode

    def counting(data: bytes) -> bytes:
        calls[0] += 1
        return real(data)

    monkeypatch.setattr(hpack_decode, "huffman_decode", counting)
    monkeypatch.setattr(hpack_decode, "_UNINDEXED", {})
    return calls


def test_a_huffman_value_sent_without_indexing_again_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Envoy's HTTP/2 codec never indexes `:path`: every ext_proc stream carries it as a Huffman literal."""
    calls = counting_huffman(monkeypatch)
    block = b"\x83" + unindexed(4, ENVOY_PATH)  # :method POST, :path literal without indexing
    for _ in range(3):  # a fresh decoder each time too: nothing of it is in a connection's table
        assert Decoder().decode(block) == hpack.Decoder().decode(block) == [(":method", "POST"), (":path", ENVOY_PATH)]
    assert calls[0] == 1


def test_never_indexed_and_indexed_values_are_not_kept_and_the_kept_ones_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting_huffman(monkeypatch)
    secret = unindexed(4, "/never-indexed", first=0x10)
    for _ in range(2):
        assert Decoder().decode(secret) == [(":path", "/never-indexed")]
    assert calls[0] == 2 and not hpack_decode._UNINDEXED
    for _ in range(2):  # with incremental indexing: the connection's table has it after the first block
        Decoder().decode(hpack.Encoder().encode([("traceparent", "00-1-2-01")]))
    assert not hpack_decode._UNINDEXED
    paths = [f"/p{i}" for i in range(hpack_decode.UNINDEXED_MAX_ENTRIES + 10)]
    for p in paths:
        assert Decoder().decode(unindexed(4, p)) == [(":path", p)]
    assert len(hpack_decode._UNINDEXED) == hpack_decode.UNINDEXED_MAX_ENTRIES
    long = "/" + "x" * 200  # over UNINDEXED_MAX_OCTETS coded: decoded every time, never kept
    assert Decoder().decode(unindexed(4, long)) == [(":path", long)]
    assert all(len(k) <= hpack_decode.UNINDEXED_MAX_OCTETS for k in hpack_decode._UNINDEXED)
