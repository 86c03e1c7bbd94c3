"""The model rewrite's splice: only the value of the top-level `model` member changes, byte for byte."""

from __future__ import annotations

import json

import pytest

from epp_extproc.core.body import BodyError, parse_object, replace_string_value


def replaced(raw: bytes, value: str) -> bytes:
    return replace_string_value(parse_object(raw), "model", value).raw


def test_only_the_model_value_changes_and_every_other_byte_stays() -> None:
    raw = b'{ "messages" : [{"role":"user","content":"hi"}] ,\n "model"  :\t"base" , "temperature": 1.0e0 }'
    assert replaced(raw, "base-lora-v2") == raw.replace(b'"base"', b'"base-lora-v2"')


def test_the_new_name_is_json_escaped() -> None:
    out = replaced(b'{"model":"a","x":1}', 'quote"back\\slash\nline\x01')
    assert out == b'{"model":"quote\\"back\\\\slash\\nline\\u0001","x":1}'
    assert json.loads(out)["model"] == 'quote"back\\slash\nline\x01'


def test_unicode_names_and_unicode_elsewhere_in_the_body_keep_their_bytes() -> None:
    raw = '{"messages":[{"content":"héllo \\u00e9 🙂"}],"model":"\\u00e9t\\u00e9"}'.encode()
    out = replaced(raw, "été-lora-🙂")
    assert out == '{"messages":[{"content":"héllo \\u00e9 🙂"}],"model":"été-lora-🙂"}'.encode()


def test_a_model_key_spelled_with_escapes_is_found_and_keeps_its_spelling() -> None:
    raw = b'{"mod\\u0065l":"a"}'
    assert replaced(raw, "b") == b'{"mod\\u0065l":"b"}'


def test_every_duplicate_model_member_is_replaced_so_first_and_last_wins_parsers_agree() -> None:
    raw = b'{"model":"a","x":2,"model":"a"}'
    assert replaced(raw, "b") == b'{"model":"b","x":2,"model":"b"}'


def test_a_nested_model_member_is_not_touched() -> None:
    raw = b'{"meta":{"model":"a"},"model":"a"}'
    assert replaced(raw, "b") == b'{"meta":{"model":"a"},"model":"b"}'


def test_the_parsed_values_carry_the_new_model_and_the_rest_unchanged() -> None:
    body = replace_string_value(parse_object(b'{"model":"a","n":[1,2]}'), "model", "b")
    assert body.values == {"model": "b", "n": [1, 2]}
    assert [m.key for m in body.members] == ["model", "n"]


def test_a_body_without_the_member_is_returned_unchanged() -> None:
    body = parse_object(b'{"x":1}')
    assert replace_string_value(body, "model", "b") is body


def test_a_name_that_is_not_valid_unicode_is_a_body_error_not_a_crash() -> None:
    with pytest.raises(BodyError):
        replaced(b'{"model":"a"}', "bad\ud800")
