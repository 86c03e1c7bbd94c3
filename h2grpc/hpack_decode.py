"""An HPACK decoder (RFC 7541) for the request header blocks h2grpc reads, at a fraction of `hpack`'s cost.

Every ext_proc stream from Envoy opens with one header block, so its decode is paid on every request: `hpack`'s
pure-Python decoder spends ~15 us on Envoy's usual block (eight fields, all indexed after the first stream) and
~26 us when tracing adds a fresh Huffman-coded `traceparent`, 4-6% of the picker's CPU per request. Most of that
is per-field overhead this decoder does not have: a debug log call and a `HeaderTuple` per field, a memoryview
slice per field, and a Huffman decoder that walks a nibble table with two tuple unpacks and flag checks per
nibble. Here an indexed field is one table read (the table holds ready `(name, value)` str tuples and their RFC
sizes), and Huffman strings are decoded a byte at a time through a 256-wide transition table per state.

The contract is `hpack.Decoder.decode(block, raw=False)`'s, checked by a differential test against it:

- fields come back as `(name, value)` str tuples in block order, decoded from UTF-8; a name or value that is not
  UTF-8 is an `HPACKDecodingError`, as with `hpack` (Envoy's gRPC headers are ASCII; a peer that sends other
  bytes is broken or hostile, and the connection handles the error as a COMPRESSION_ERROR);
- errors are `hpack`'s exception classes (all `hpack.HPACKError`, what the connection catches): an index of 0
  or past the table (`InvalidTableIndexError`), a decoded list over `max_header_list_size` counted as it decodes
  in RFC 7541 §4.1 sizes (`OversizedHeaderListError`, raised at the field that crosses it, so a small block of
  indexed references to one large entry cannot expand first), a dynamic table size update over
  `max_allowed_table_size` (what our SETTINGS allow) or a table left larger than it at the block's end
  (`InvalidTableSizeError`), and `HPACKDecodingError` for the rest: a truncated block, a size update after a
  field, an integer of more than five continuation octets (as `hpack`: enough for any 32-bit value), a Huffman
  string with an EOS symbol or with padding that is over 7 bits or not all ones (RFC 7541 §5.2).

Huffman strings are decoded by the optional C accelerator `h2grpc._huffman` where it is built (h2grpc/native.py;
`EPP_H2GRPC_PURE=1` turns it off), else by `huffman_decode_py`; the two give the same octets and the same errors
(tests/unit/test_h2grpc_native.py).

One difference, on purpose: a never-indexed field (RFC 7541 §6.2.3) comes back as a plain tuple, where `hpack`
gives a `NeverIndexedHeaderTuple` (a tuple subclass that compares equal). The flag only matters to an
intermediary that re-encodes the field; h2grpc never forwards request headers.

After an error the decoder's table is in an undefined state: the connection must end (it sends GOAWAY
COMPRESSION_ERROR), as with `hpack`.
"""

from __future__ import annotations

from collections import deque

from hpack.exceptions import (
    HPACKDecodingError,
    InvalidTableIndexError,
    InvalidTableSizeError,
    OversizedHeaderListError,
)
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.table import HeaderTable

from h2grpc import native

DEFAULT_TABLE_SIZE = 4_096  # RFC 9113 §6.5.2: the dynamic table's size until the peer sends an update
ENTRY_OVERHEAD = 32  # RFC 7541 §4.1: an entry's size is its name's and value's octets plus 32
MAX_CONTINUATION_OCTETS = 5  # hpack's bound (VARINT_MAX_LENGTH): 4 x 7 bits + a final octet covers 2^32

# (header, its RFC 7541 §4.1 size, its name's octet count) for a table index; index 0 is not a field
_Entry = tuple[tuple[str, str], int, int]


def _entry(name: bytes, value: bytes) -> _Entry:
    return (name.decode(), value.decode()), len(name) + len(value) + ENTRY_OVERHEAD, len(name)


STATIC: tuple[_Entry, ...] = tuple(_entry(n, v) for n, v in HeaderTable.STATIC_TABLE)
STATIC_LEN = len(STATIC)  # 61: dynamic entries start at index 62


class Decoder:
    """One connection's HPACK decoding context: the peer's dynamic table and the bounds it is held to.

    `max_header_list_size` bounds the decoded list of one block (RFC 7541 §4.1 sizes); `max_allowed_table_size`
    is the largest dynamic table our SETTINGS_HEADER_TABLE_SIZE lets the peer choose.
    """

    __slots__ = ("max_header_list_size", "max_allowed_table_size", "_dynamic", "_used", "_max")

    def __init__(self, max_header_list_size: int = 65_536, max_allowed_table_size: int = DEFAULT_TABLE_SIZE) -> None:
        self.max_header_list_size = max_header_list_size
        self.max_allowed_table_size = max_allowed_table_size
        self._dynamic: deque[_Entry] = deque()  # newest first: index 62 is _dynamic[0]
        self._used = 0  # the dynamic table's size in RFC 7541 §4.1 octets
        self._max = DEFAULT_TABLE_SIZE  # its current maximum, moved by the peer's size updates

    @property
    def header_table_size(self) -> int:
        """The dynamic table's current maximum size, as the peer last set it (4,096 until it does)."""
        return self._max

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        """Set the maximum as if the peer had (RFC 7541's examples start at 256), evicting what no longer fits."""
        self._resize(value)

    @property
    def dynamic_table(self) -> list[tuple[str, str]]:
        """The dynamic table's fields, newest (index 62) first: for tests and debugging."""
        return [header for header, _, _ in self._dynamic]

    @property
    def dynamic_table_octets(self) -> int:
        """The dynamic table's size in RFC 7541 §4.1 octets."""
        return self._used

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The fields of one complete header block, in order; the dynamic table takes its insertions.

        One loop with the common representations inline: an indexed field whose index fits the first octet
        (every field of Envoy's usual block after its first stream) costs a table read, an append and a
        size check.
        """
        if type(block) is not bytes:  # hpack took any bytes-like block; slices of a memoryview cannot .decode()
            block = bytes(block)
        out: list[tuple[str, str]] = []
        limit = self.max_header_list_size
        dynamic = self._dynamic
        size = 0
        pos = 0
        end = len(block)
        try:
            while pos < end:
                b = block[pos]
                if b & 0x80:  # indexed field (§6.1)
                    if b != 0xFF:
                        index = b & 0x7F
                        pos += 1
                    else:
                        index, pos = _integer(block, pos, 0x7F)
                    if index <= STATIC_LEN:
                        if not index:
                            raise InvalidTableIndexError("index 0 in an indexed field")
                        header, entry_size, _ = STATIC[index - 1]
                    elif index - STATIC_LEN <= len(dynamic):
                        header, entry_size, _ = dynamic[index - STATIC_LEN - 1]
                    else:
                        raise InvalidTableIndexError(f"index {index} past the table ({len(dynamic)} dynamic entries)")
                    out.append(header)
                    size += entry_size
                    if size > limit:
                        raise OversizedHeaderListError(f"a header list over {limit} octets")
                    continue
                if b & 0x40:  # literal with incremental indexing (§6.2.1)
                    mask = 0x3F
                    indexing = True
                elif b & 0x20:  # dynamic table size update (§6.3): only before the block's first field
                    if out:
                        raise HPACKDecodingError("a table size update after a field")
                    if b & 0x1F == 0x1F:
                        new_max, pos = _integer(block, pos, 0x1F)
                    else:
                        new_max = b & 0x1F
                        pos += 1
                    if new_max > self.max_allowed_table_size:
                        raise InvalidTableSizeError(
                            f"table size update to {new_max}, over our {self.max_allowed_table_size}")
                    self._resize(new_max)
                    continue
                else:  # literal without indexing or never indexed (§6.2.2, §6.2.3)
                    mask = 0x0F
                    indexing = False
                name_index = b & mask
                if name_index == mask:
                    name_index, pos = _integer(block, pos, mask)
                else:
                    pos += 1
                if name_index:
                    if name_index <= STATIC_LEN:
                        (name, _), _, name_octets = STATIC[name_index - 1]
                    elif name_index - STATIC_LEN <= len(dynamic):
                        (name, _), _, name_octets = dynamic[name_index - STATIC_LEN - 1]
                    else:
                        raise InvalidTableIndexError(
                            f"name index {name_index} past the table ({len(dynamic)} dynamic entries)")
                else:
                    raw, pos = _string(block, pos, end)
                    name = raw.decode()
                    name_octets = len(raw)
                if b & 0xF0 or block[pos] & 0x80 == 0:  # indexed, never indexed, or not Huffman-coded
                    raw, pos = _string(block, pos, end)
                else:
                    raw, pos = _unindexed_huffman(block, pos, end)
                header = (name, raw.decode())
                entry_size = name_octets + len(raw) + ENTRY_OVERHEAD
                out.append(header)
                size += entry_size
                if size > limit:
                    raise OversizedHeaderListError(f"a header list over {limit} octets")
                if indexing:
                    self._add((header, entry_size, name_octets))
        except IndexError:  # block[pos] past the end: a representation cut short
            raise HPACKDecodingError("truncated header block") from None
        except UnicodeDecodeError:
            raise HPACKDecodingError("a header name or value that is not UTF-8") from None
        if self._max > self.max_allowed_table_size:  # our SETTINGS shrank the table and the peer did not follow
            raise InvalidTableSizeError(f"dynamic table of {self._max}, over our {self.max_allowed_table_size}")
        return out

    def _add(self, entry: _Entry) -> None:
        """Insert at the front, evicting from the back (§4.4); an entry larger than the table empties it."""
        entry_size = entry[1]
        if entry_size > self._max:
            self._dynamic.clear()
            self._used = 0
            return
        self._dynamic.appendleft(entry)
        self._used += entry_size
        while self._used > self._max:
            self._used -= self._dynamic.pop()[1]

    def _resize(self, new_max: int) -> None:
        self._max = new_max
        while self._used > new_max:
            self._used -= self._dynamic.pop()[1]


def _integer(block: bytes, pos: int, cap: int) -> tuple[int, int]:
    """An integer whose prefix at `block[pos]` is all ones (`cap`) and continues (§5.1): (value, next pos).

    At most `MAX_CONTINUATION_OCTETS` octets follow the prefix: an integer that never ends, or one padded
    with zero continuations, is an error before it can grow (RFC 7541 §5.1 lets a decoder bound both).
    """
    value = cap
    shift = 0
    for at in range(pos + 1, pos + 1 + MAX_CONTINUATION_OCTETS):
        b = block[at]
        value += (b & 0x7F) << shift
        if b < 0x80:
            return value, at + 1
        shift += 7
    raise HPACKDecodingError(f"an integer of more than {MAX_CONTINUATION_OCTETS} continuation octets")


def _string(block: bytes, pos: int, end: int) -> tuple[bytes, int]:
    """A string literal at `block[pos]` (§5.2): its octets, Huffman-decoded if flagged, and the next pos."""
    b = block[pos]
    length = b & 0x7F
    if length == 0x7F:
        length, pos = _integer(block, pos, 0x7F)
    else:
        pos += 1
    stop = pos + length
    if stop > end:
        raise HPACKDecodingError("truncated header block: a string past its end")
    if b & 0x80:
        return huffman_decode(block[pos:stop]), stop
    return block[pos:stop], stop


# Huffman-coded values of literals without indexing (§6.2.2), decoded once: an encoder sends that way what it
# will not put in its table but may well send again, such as Envoy's `:path` on every ext_proc stream (its
# HTTP/2 codec never indexes `:path`): ~1.5 us of Huffman decoding per stream, for a dict lookup. Bounded in
# entries and octets, first come first kept; never-indexed values (§6.2.3, what an encoder marks sensitive) are
# not kept, nor values it indexes (those come back as table reads after their first block).
_UNINDEXED: dict[bytes, bytes] = {}
UNINDEXED_MAX_ENTRIES = 64
UNINDEXED_MAX_OCTETS = 128


def _unindexed_huffman(block: bytes, pos: int, end: int) -> tuple[bytes, int]:
    """`_string` for the Huffman-coded value of a literal without indexing, through `_UNINDEXED`."""
    length = block[pos] & 0x7F
    if length == 0x7F or length > UNINDEXED_MAX_OCTETS:
        return _string(block, pos, end)
    stop = pos + 1 + length
    if stop > end:
        raise HPACKDecodingError("truncated header block: a string past its end")
    coded = block[pos + 1:stop]
    decoded = _UNINDEXED.get(coded)
    if decoded is None:
        decoded = huffman_decode(coded)
        if len(_UNINDEXED) < UNINDEXED_MAX_ENTRIES:
            _UNINDEXED[coded] = decoded
    return decoded, stop


# --- Huffman (RFC 7541 §5.2, Appendix B) ------------------------------------------------------------------
#
# The code is a complete binary tree of 257 leaves (256 octets and EOS), so 256 internal nodes: a decoder's
# state between input octets is the internal node the bits read so far lead to (the root when they ended on a
# symbol). For each state and input octet, `_NEXT[state << 8 | octet]` is the next state (shifted left by 8,
# ready to be or-ed with the next octet) and `_EMIT[state << 8 | octet]` the octets decoded on the way (0 to 2:
# the shortest code is 5 bits), or None where the path reaches EOS, which makes the join fail. Both are built
# once, at the first Huffman string, from the RFC's code table (hpack.huffman_constants).

_NEXT: list[int] | None = None
_EMIT: list[bytes | None] = []
_ACCEPT: frozenset[int] = frozenset()  # end states whose partial code is all ones and at most 7 bits (padding)


def huffman_tables() -> tuple[list[int], list[bytes | None], frozenset[int]]:
    """The transition tables, built at the first call (15-30 ms), ~1.7 MiB in all (`bench/bench_hpack.py`
    measures it; a test holds it under 2 MiB): 65,536 transitions as a list (512 KiB of references to 256
    shared ints: reading a list hands back an existing int where an array of 16-bit states made a new one per
    octet, ~20 ns, a quarter of the loop: ~0.8 us a fresh `traceparent`, and Envoy's `:path`, which its
    encoder never indexes, on every stream), a list of emissions (512 KiB of references) and the ~17,400
    two-octet bytes objects it shares (~700 KiB; b"" and one-octet bytes are the interpreter's singletons). A
    table of (state, emission) tuples would take over 4 MiB; bytes-only tables (a count and two symbol
    columns) would save most of the 700 KiB at the cost of more work per octet."""
    global _NEXT, _EMIT, _ACCEPT
    if _NEXT is not None:
        return _NEXT, _EMIT, _ACCEPT
    # the tree: children[node] = [child for bit 0, child for bit 1]; a child >= 0 is an internal node, a
    # child < 0 the leaf of symbol -child - 1 (256: EOS)
    children: list[list[int]] = [[0, 0]]
    for symbol, (code, bits) in enumerate(zip(REQUEST_CODES, REQUEST_CODES_LENGTH, strict=True)):
        node = 0
        for k in range(bits - 1, 0, -1):
            bit = code >> k & 1
            if not children[node][bit]:
                children.append([0, 0])
                children[node][bit] = len(children) - 1
            node = children[node][bit]
        children[node][code & 1] = -symbol - 1
    assert len(children) == 256, "the Huffman code is complete: 257 leaves, 256 internal nodes"
    # per state and nibble: (next state, octets decoded, or None past EOS), then octets as two nibbles
    nibbles: list[list[tuple[int, bytes | None]]] = []
    for state in range(256):
        row = []
        for nibble in range(16):
            node, emitted = state, b""
            for k in (3, 2, 1, 0):
                child = children[node][nibble >> k & 1]
                if child >= 0:
                    node = child
                    continue
                node = 0
                if emitted is not None:
                    emitted = None if child == -257 else emitted + bytes((-child - 1,))
            row.append((node, emitted))
        nibbles.append(row)
    shared: dict[bytes, bytes] = {}
    shifted = [node << 8 for node in range(256)]  # the 256 values a transition holds, shared
    next_states: list[int] = [0] * 65_536
    emits: list[bytes | None] = [None] * 65_536
    for state in range(256):
        for high, (middle, first) in enumerate(nibbles[state]):
            base = state << 8 | high << 4
            for low, (node, second) in enumerate(nibbles[middle]):
                next_states[base | low] = shifted[node]
                if first is not None and second is not None:
                    both = first + second
                    emits[base | low] = shared.setdefault(both, both)
    accept, node = set(), 0
    for _ in range(8):  # the root, then the all-ones path 1 to 7 bits deep
        accept.add(node << 8)
        node = children[node][1]
    _NEXT, _EMIT, _ACCEPT = next_states, emits, frozenset(accept)
    return _NEXT, _EMIT, _ACCEPT


def huffman_decode_py(data: bytes) -> bytes:
    """The octets a Huffman string encodes; an EOS symbol in it, or padding over 7 bits or not all ones at its
    end, is an `HPACKDecodingError` (RFC 7541 §5.2). The pure-Python path: `huffman_decode` is the C one where
    it is built."""
    next_states, emits, accept = huffman_tables() if _NEXT is None else (_NEXT, _EMIT, _ACCEPT)
    state = 0
    out = []
    append = out.append
    for octet in data:
        i = state | octet
        append(emits[i])
        state = next_states[i]
    try:
        decoded = b"".join(out)  # type: ignore[arg-type]  # a None (past EOS) raises the TypeError below
    except TypeError:
        raise HPACKDecodingError("an EOS symbol in a Huffman string") from None
    if state not in accept:
        raise HPACKDecodingError("Huffman padding over 7 bits or not all ones")
    return decoded


# `huffman_decode(data) -> bytes`: the C decoder (h2grpc/_csrc/huffman.c: a nibble-wide table of 16 KiB, built
# at import) where it is built, else the pure path above; `_string` and `_unindexed_huffman` look it up here.
huffman_decode = native.MODULE.decode if native.MODULE is not None else huffman_decode_py


def warm() -> None:
    """Build what the Huffman decoder needs before the first request that carries a Huffman string: the pure
    path's tables (15-30 ms, ~1.7 MiB); nothing for the C decoder, whose 16 KiB table is built at import."""
    if huffman_decode is huffman_decode_py:
        huffman_tables()
