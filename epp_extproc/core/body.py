"""Reading and rewriting request bodies without re-serialising them.

The picker must forward exactly what the client sent, minus the members it consumed (`nvext`), plus the
members it injects (`cache_salt`). Re-encoding the whole body would change number formatting, escapes and
key order, which breaks byte-exact clients and costs time on multi-megabyte prompts. So one pass over the
top level records each member's byte span, and a rewrite splices spans.

The common case (nothing to strip or inject) never needs spans: values come from orjson in one C call and the
original bytes are forwarded as they are. Spans are computed only when a rewrite needs them, or when orjson
refuses a body the standard library accepts (NaN, lone surrogate escapes, integers beyond 64 bits), by walking
the top level with the C JSON scanner (`raw_decode`) for each value, so nested data is never touched by Python
code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

import orjson

_decoder = json.JSONDecoder()


def _int_or_float(digits: str) -> int | float:
    try:
        return int(digits)
    except ValueError:  # longer than sys.get_int_max_str_digits(): keep its magnitude, never fail the body
        return float(digits)


# Only for a value the fast decoder refused with a plain ValueError: an integer of more than 4300 digits is
# valid JSON, the worker decides what it means, and the picker forwards its bytes untouched anyway.
_tolerant_decoder = json.JSONDecoder(parse_int=_int_or_float)
_WS_RUN = re.compile(r"[ \t\n\r]*")


class BodyError(ValueError):
    """The body is not something the picker can route: answered with HTTP 400."""


@dataclass(slots=True)
class Member:
    key: str
    start: int  # index of the opening quote of the key
    end: int  # index just past the value


@dataclass(slots=True)
class ParsedBody:
    """A JSON object body; `members` (spans in `text` character indices) are computed on first use."""

    raw: bytes
    values: dict[str, Any] = field(default_factory=dict)  # last occurrence wins, as in json.loads
    _text: str | None = None
    _members: list[Member] | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self.raw.decode("utf-8")
        return self._text

    @property
    def members(self) -> list[Member]:
        if self._members is None:
            self._text, self._members, _ = _walk(self.raw)
        return self._members


def _skip_ws(s: str, i: int) -> int:
    """Past JSON whitespace at `i`, in C: a body padded with 30 MB of spaces must not cost a Python loop."""
    return _WS_RUN.match(s, i).end()  # type: ignore[union-attr]  (the pattern matches the empty string)


def parse_object(raw: bytes) -> ParsedBody:
    """Parse a body that must be one JSON object; raise BodyError with a short reason otherwise."""
    try:
        values = orjson.loads(raw)
    except orjson.JSONDecodeError:
        values = None  # the walker gives the verdict (and the reason) for what orjson refuses
    if isinstance(values, dict):
        return ParsedBody(raw, values)
    if values is not None:
        raise BodyError("request body must be a JSON object")
    text, members, values = _walk(raw)
    return ParsedBody(raw, values, text, members)


def _walk(raw: bytes) -> tuple[str, list[Member], dict[str, Any]]:
    """The top-level members of a JSON object body with their spans; BodyError when it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not valid UTF-8 (byte {e.start})") from None
    if text.startswith("\ufeff"):
        raise BodyError("request body starts with a byte-order mark")
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "{":
        raise BodyError("request body must be a JSON object")
    members: list[Member] = []
    values: dict[str, Any] = {}
    i = _skip_ws(text, i + 1)
    try:
        if i < len(text) and text[i] == "}":
            i += 1
        else:
            while True:
                if i >= len(text) or text[i] != '"':
                    raise BodyError(f"malformed JSON: expected a member name at character {i}")
                key, j = scanstring(text, i + 1, True)
                j = _skip_ws(text, j)
                if j >= len(text) or text[j] != ":":
                    raise BodyError(f"malformed JSON: expected ':' at character {j}")
                j = _skip_ws(text, j + 1)
                try:
                    value, end = _decoder.raw_decode(text, j)
                except json.JSONDecodeError:
                    raise
                except ValueError:
                    value, end = _tolerant_decoder.raw_decode(text, j)
                members.append(Member(key, i, end))
                values[key] = value
                i = _skip_ws(text, end)
                if i < len(text) and text[i] == ",":
                    i = _skip_ws(text, i + 1)
                    continue
                if i < len(text) and text[i] == "}":
                    i += 1
                    break
                raise BodyError(f"malformed JSON: expected ',' or '}}' at character {i}")
    except json.JSONDecodeError as e:
        raise BodyError(f"malformed JSON: {e.msg} at character {e.pos}") from None
    except RecursionError:
        raise BodyError("malformed JSON: nesting too deep") from None
    if _skip_ws(text, i) != len(text):
        raise BodyError("malformed JSON: trailing data after the object")
    return text, members, values


def rewrite(body: ParsedBody, raw: bytes, *, drop: frozenset[str] = frozenset(),
            set_members: dict[str, Any] | None = None) -> bytes:
    """Return the forwarded body: `drop` members removed, `set_members` replaced in place or appended.

    Every untouched member keeps its exact bytes, its position and the separator that followed it; with
    nothing to change the original bytes object itself is returned.
    """
    set_members = set_members or {}
    if not set_members and drop.isdisjoint(body.values):
        return raw
    members = body.members
    text = body.text
    pending = dict(set_members)
    kept: list[tuple[int, str]] = []  # (original index, member text)
    for i, m in enumerate(members):
        if m.key in drop:
            continue
        if m.key in set_members:
            if m.key not in pending:  # a later duplicate of a replaced key goes
                continue
            kept.append((i, _member(m.key, pending.pop(m.key))))
        else:
            kept.append((i, text[m.start:m.end]))
    if members:
        prefix, suffix = text[:members[0].start], text[members[-1].end:]
    else:
        close = text.rindex("}")
        prefix, suffix = text[:close], text[close:]
    out = [prefix]
    for j, (i, member) in enumerate(kept):
        out.append(member)
        if j < len(kept) - 1:
            out.append(text[members[i].end:members[i + 1].start])  # the original ", " after this member
    for key, value in pending.items():
        out.append(("," if len(out) > 1 else "") + _member(key, value))
    out.append(suffix)
    return "".join(out).encode("utf-8")


def replace_string_value(body: ParsedBody, key: str, value: str) -> ParsedBody:
    """`body` with the value of every top-level `key` member replaced by the JSON string `value`, and nothing
    else changed: the key's spelling, the whitespace around its colon, every other member and the separators
    keep their exact bytes (a model rewrite must not reformat a multi-megabyte prompt, nor change what a
    byte-exact client signed). Every duplicate of `key` is replaced, so a parser that keeps the first
    occurrence sees the new value as much as one that keeps the last. Raises BodyError when the body cannot
    be walked (e.g. nested too deep) or `value` is not encodable (a lone surrogate)."""
    members = body.members
    text = body.text
    try:
        encoded = json.dumps(value, ensure_ascii=False)
        encoded.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(f"cannot write {key!r}: the new value is not valid Unicode") from None
    out: list[str] = []
    pos = 0
    for m in members:
        if m.key != key:
            continue
        _, j = scanstring(text, m.start + 1, True)  # past the key's closing quote
        j = _skip_ws(text, j) + 1  # past the ':' (the walker checked it is there)
        start = _skip_ws(text, j)
        out += (text[pos:start], encoded)
        pos = m.end
    if not out:
        return body
    out.append(text[pos:])
    new_text = "".join(out)
    return ParsedBody(new_text.encode("utf-8"), {**body.values, key: value}, new_text)


def _member(key: str, value: Any) -> str:
    return json.dumps(key, ensure_ascii=False) + ":" + json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------- nested members
# Editing a member inside `messages` must not decode the megabytes of base64 around it: these helpers skip a
# value by its structure alone (str.find for strings, a regex jump between structural characters for
# containers), never building it. They run only over bodies the parser has already accepted as JSON.
_STRUCTURAL = re.compile(r'["\[\]{}]')
_SCALAR_END = re.compile(r"[ \t\n\r,\]}]")


def _string_end(text: str, i: int) -> int:
    """Index past the JSON string whose opening quote is at `i`."""
    j = i + 1
    while True:
        k = text.find('"', j)
        if k < 0:
            raise BodyError("malformed JSON: unterminated string")
        b = k
        while text[b - 1] == "\\":  # stops at the opening quote at the latest
            b -= 1
        if (k - b) % 2 == 0:  # an even run of backslashes: the quote is not escaped
            return k + 1
        j = k + 1


def _skip(text: str, i: int) -> int:
    """Index past the JSON value starting at `i`, without building it."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c not in "[{":
        m = _SCALAR_END.search(text, i)
        return m.start() if m else len(text)
    depth, pos = 0, i
    while True:
        m = _STRUCTURAL.search(text, pos)
        if m is None:
            raise BodyError("malformed JSON: unterminated value")
        ch, p = m.group(), m.start()
        if ch == '"':
            pos = _string_end(text, p)
            continue
        depth += 1 if ch in "[{" else -1
        pos = p + 1
        if depth == 0:
            return pos


@dataclass(slots=True)
class _Span:
    key: str
    start: int  # the key's opening quote
    value_start: int
    value_end: int


def _object_spans(text: str, i: int) -> tuple[list[_Span], int]:
    """The members of the JSON object at `text[i]` ('{') with their spans, and the index past it."""
    spans: list[_Span] = []
    i = _skip_ws(text, i + 1)
    if text[i] == "}":
        return spans, i + 1
    while True:
        key, j = scanstring(text, i + 1, True)
        j = _skip_ws(text, _skip_ws(text, j) + 1)  # past ':'
        end = _skip(text, j)
        spans.append(_Span(key, i, j, end))
        i = _skip_ws(text, end)
        if text[i] == "}":
            return spans, i + 1
        i = _skip_ws(text, i + 1)  # past ','


def _array_items(text: str, i: int, wanted: set[int]) -> dict[int, int]:
    """Start index of each `wanted` item of the JSON array at `text[i]` ('['); the others are skipped."""
    found: dict[int, int] = {}
    i = _skip_ws(text, i + 1)
    n = 0
    while i < len(text) and text[i] != "]" and len(found) < len(wanted):
        if n in wanted:
            found[n] = i
        i = _skip_ws(text, _skip(text, i))
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
        n += 1
    return found


REMOVE = object()  # an edit value: the member is removed


def _without(text: str, start: int, end: int, spans: list[_Span], key: str) -> str:
    """The object `text[start:end]` without its `key` members; the kept members and the separators after them
    keep their bytes (the top-level `rewrite` rule, one level down)."""
    kept = [i for i, s in enumerate(spans) if s.key != key]
    out = [text[start:spans[0].start]]
    for j, i in enumerate(kept):
        out.append(text[spans[i].start:spans[i].value_end])
        if j < len(kept) - 1:
            out.append(text[spans[i].value_end:spans[i + 1].start])
    out.append(text[spans[-1].value_end:end])
    return "".join(out)


def set_content_part_member(body: ParsedBody, key: str, edits: dict[tuple[int, int], Any]) -> ParsedBody:
    """`body` with member `key` of content part `messages[m].content[p]` set to `edits[(m, p)]` (a JSON value,
    or REMOVE) for each edit, and nothing else changed: every other byte (whitespace, escapes, number spelling,
    member order, the rest of each part) is kept. An existing member's value is replaced (every duplicate of it,
    so first-wins and last-wins parsers agree); a missing one is appended before the part's closing brace. The
    `messages` edited is the last top-level one and each message's last `content`, as JSON parsers keep.
    Cost: proportional to the body's structure, not its bytes (base64 is skipped with str.find). Raises
    BodyError when an edit's path is not an object in the body."""
    if not edits:
        return body
    text = body.text
    try:
        top, _ = _object_spans(text, _skip_ws(text, 0))
        msgs = [s for s in top if s.key == "messages"]
        if not msgs or text[msgs[-1].value_start] != "[":
            raise BodyError("no `messages` array to edit")
        by_message: dict[int, dict[int, Any]] = {}
        for (mi, pi), v in edits.items():
            by_message.setdefault(mi, {})[pi] = v
        splices: list[tuple[int, int, str]] = []  # (start, end, replacement), non-overlapping
        found = _array_items(text, msgs[-1].value_start, set(by_message))
        if len(found) != len(by_message):
            raise BodyError("an edited message is not in the body")
        for mi, m_start in found.items():
            if text[m_start] != "{":
                raise BodyError(f"messages[{mi}] is not an object")
            spans, _ = _object_spans(text, m_start)
            content = [s for s in spans if s.key == "content"]
            if not content or text[content[-1].value_start] != "[":
                raise BodyError(f"messages[{mi}].content is not an array")
            parts = _array_items(text, content[-1].value_start, set(by_message[mi]))
            if len(parts) != len(by_message[mi]):
                raise BodyError(f"messages[{mi}].content has fewer parts than edited")
            for pi, p_start in parts.items():
                if text[p_start] != "{":
                    raise BodyError(f"messages[{mi}].content[{pi}] is not an object")
                value = by_message[mi][pi]
                pspans, p_end = _object_spans(text, p_start)
                same = [s for s in pspans if s.key == key]
                if value is REMOVE:
                    if same:
                        splices.append((p_start, p_end, _without(text, p_start, p_end, pspans, key)))
                    continue
                for s in same:
                    splices.append((s.value_start, s.value_end, json.dumps(value, ensure_ascii=False)))
                if not same:
                    splices.append((p_end - 1, p_end - 1, ("," if pspans else "") + _member(key, value)))
    except (json.JSONDecodeError, IndexError):
        raise BodyError("malformed JSON inside `messages`") from None
    splices.sort()
    out: list[str] = []
    pos = 0
    for s, e, r in splices:
        out += (text[pos:s], r)
        pos = e
    out.append(text[pos:])
    new_text = "".join(out)
    try:
        raw = new_text.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(f"cannot write {key!r}: the new value is not valid Unicode") from None
    delta = len(new_text) - len(text)
    at = msgs[-1].start  # every splice is inside the last `messages`: it grows, the members after it move
    members = [Member(s.key, s.start + (delta if s.start > at else 0), s.value_end + (delta if s.start >= at else 0))
               for s in top]
    return ParsedBody(raw, _with_part_members(body.values, key, edits), new_text, members)


def _with_part_members(values: dict[str, Any], key: str, edits: dict[tuple[int, int], Any]) -> dict[str, Any]:
    """`values` with the same edits, copying only the containers on each edited path (the rest is shared)."""
    out = dict(values)
    messages = list(out["messages"])
    out["messages"] = messages
    for (mi, pi), v in edits.items():
        msg = messages[mi] = dict(messages[mi])
        content = msg["content"] = list(msg["content"])
        content[pi] = {k: x for k, x in content[pi].items() if k != key} if v is REMOVE else {**content[pi], key: v}
    return out
