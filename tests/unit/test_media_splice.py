"""core/body.set_content_part_member: a content part's `uuid` is set and every other byte is the client's."""

from __future__ import annotations

import json

import pytest

from epp_extproc.core.body import REMOVE, BodyError, parse_object, rewrite, set_content_part_member

RAW = (b'{ "model" : "m",\n "messages": [ {"role":"system","content":"caf\\u00e9 \\ud83d\\ude00"},\n'
       b'  {"role":"user", "content" : [ {"type":"text","text":"1.0e0 \\"q\\""} ,\n'
       b'    { "type" : "image_url", "image_url": {"url":"data:image/png;base64,QUJD"}  } ] } ],\t"top_p":1.00 }'
       )


def test_a_missing_uuid_is_appended_and_nothing_else_changes() -> None:
    out = set_content_part_member(parse_object(RAW), "uuid", {(1, 1): "sha256-ab"})
    assert out.raw == RAW.replace(b'base64,QUJD"}  }', b'base64,QUJD"}  ,"uuid":"sha256-ab"}')
    assert json.loads(out.raw)["messages"][1]["content"][1]["uuid"] == "sha256-ab"
    assert out.values["messages"][1]["content"][1]["uuid"] == "sha256-ab"


def test_an_existing_uuid_is_replaced_in_place() -> None:
    raw = b'{"messages":[{"role":"user","content":[{"type":"image_url","uuid" :  "theirs","image_url":{"url":"h"}}]}]}'
    out = set_content_part_member(parse_object(raw), "uuid", {(0, 0): "ours"})
    assert out.raw == raw.replace(b'"theirs"', b'"ours"')


@pytest.mark.parametrize(("part", "expected"), [
    (b'{"type":"image_url", "uuid" : "a" ,\n "image_url":"h"}', b'{"type":"image_url", "image_url":"h"}'),
    (b'{ "uuid":"a", "image_url":"h" }', b'{ "image_url":"h" }'),
    (b'{"image_url":"h","uuid":"a"}', b'{"image_url":"h"}'),
    (b'{"uuid":"a","uuid":"b", "image_url":"h","uuid":null}', b'{"image_url":"h"}'),
    (b'{ "uuid":"a" }', b'{  }'),
])
def test_a_removed_uuid_leaves_every_other_member_and_separator_as_sent(part: bytes, expected: bytes) -> None:
    raw = b'{"messages":[{"role":"user","content":[' + part + b']}], "x":1}'
    out = set_content_part_member(parse_object(raw), "uuid", {(0, 0): REMOVE})
    assert out.raw == b'{"messages":[{"role":"user","content":[' + expected + b']}], "x":1}'
    assert "uuid" not in json.loads(out.raw)["messages"][0]["content"][0]
    assert "uuid" not in out.values["messages"][0]["content"][0]


def test_every_duplicate_uuid_is_replaced() -> None:
    raw = b'{"messages":[{"role":"user","content":[{"uuid":"a","image_url":"h","uuid":"b"}]}]}'
    out = set_content_part_member(parse_object(raw), "uuid", {(0, 0): "x"})
    assert out.raw == b'{"messages":[{"role":"user","content":[{"uuid":"x","image_url":"h","uuid":"x"}]}]}'


def test_edits_in_several_messages_and_parts_land_on_their_parts() -> None:
    doc = {"messages": [{"role": "user", "content": [{"image_url": "a"}, {"type": "text", "text": "t"},
                                                     {"image_url": "b"}]},
                        {"role": "user", "content": [{"image_url": "c"}]}]}
    raw = json.dumps(doc).encode()
    out = set_content_part_member(parse_object(raw), "uuid", {(0, 0): "A", (0, 2): "B", (1, 0): "C"})
    got = json.loads(out.raw)
    assert [p.get("uuid") for m in got["messages"] for p in m["content"]] == ["A", None, "B", "C"]
    assert doc == json.loads(raw)  # the parsed values of the original are not changed
    assert out.values == got


def test_the_last_messages_member_is_the_one_edited() -> None:
    raw = b'{"messages":[],"messages":[{"role":"user","content":[{"image_url":"a"}]}]}'
    out = set_content_part_member(parse_object(raw), "uuid", {(0, 0): "A"})
    assert out.raw == b'{"messages":[],"messages":[{"role":"user","content":[{"image_url":"a","uuid":"A"}]}]}'


def test_an_edit_outside_the_body_is_an_error() -> None:
    raw = b'{"messages":[{"role":"user","content":"text"}]}'
    with pytest.raises(BodyError):
        set_content_part_member(parse_object(raw), "uuid", {(0, 0): "A"})
    with pytest.raises(BodyError):
        set_content_part_member(parse_object(b'{"messages":[]}'), "uuid", {(3, 0): "A"})


def test_no_edit_returns_the_same_body() -> None:
    parsed = parse_object(RAW)
    assert set_content_part_member(parsed, "uuid", {}) is parsed


def test_strings_with_escaped_quotes_and_backslashes_are_skipped_exactly() -> None:
    raw = (b'{"messages":[{"role":"user","content":[{"type":"text","text":"a\\\\\\"]}{\\\\"},'
           b'{"image_url":"x\\\\","note":"\\"}"}]}],"after":"\\\\"}')
    assert json.loads(raw)  # valid JSON
    out = set_content_part_member(parse_object(raw), "uuid", {(0, 1): "U"})
    assert json.loads(out.raw)["messages"][0]["content"] == [json.loads(raw)["messages"][0]["content"][0],
                                                            {"image_url": "x\\", "note": '"}', "uuid": "U"}]
    assert out.raw == raw.replace(b'"\\"}"}', b'"\\"}","uuid":"U"}')


def test_a_later_top_level_rewrite_of_the_edited_body_keeps_its_bytes() -> None:
    raw = b'{"nvext":{"a":[1]}, "messages":[{"role":"user","content":[{"image_url":"a"}]}] ,"top_p" : 1.0}'
    out = set_content_part_member(parse_object(raw), "uuid", {(0, 0): "A"})
    fresh = parse_object(out.raw)
    kw = {"drop": frozenset({"nvext"}), "set_members": {"cache_salt": "t", "top_p": 0.5}}
    assert rewrite(out, out.raw, **kw) == rewrite(fresh, out.raw, **kw)  # type: ignore[arg-type]
