"""Session tokens: a client can neither read the worker from its token nor make one that names another."""

from __future__ import annotations

import base64
import os

import pytest

from epp_extproc.adapters.session_keys import read_keys_file
from epp_extproc.core.session import (
    MAX_TOKEN_CHARS,
    SessionKeyError,
    SessionOutcome,
    SessionTokens,
    parse_keys,
)
from tests.clock import Clock

K1, K2 = os.urandom(32), os.urandom(32)


def test_a_sealed_token_opens_to_the_worker_it_names() -> None:
    t = SessionTokens([K1], 60)
    assert t.open(t.seal("10.0.0.7:8000")) == (SessionOutcome.HONOURED, "10.0.0.7:8000")


def test_the_token_does_not_show_the_address_and_two_tokens_for_one_worker_differ() -> None:
    t = SessionTokens([K1], 60)
    a, b = t.seal("10.0.0.7:8000"), t.seal("10.0.0.7:8000")
    assert a != b  # a fresh nonce each time
    raw = base64.urlsafe_b64decode(a + "=" * (-len(a) % 4))
    assert b"10.0.0.7" not in raw and b"8000" not in raw


def test_every_single_byte_change_is_refused_as_tampered() -> None:
    t = SessionTokens([K1], 60)
    token = t.seal("10.0.0.7:8000")
    raw = bytearray(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        forged = base64.urlsafe_b64encode(bytes(bad)).rstrip(b"=").decode()
        assert t.open(forged) == (SessionOutcome.TAMPERED, None), i


def test_a_cut_or_garbage_token_is_tampered() -> None:
    t = SessionTokens([K1], 60)
    token = t.seal("10.0.0.7:8000")
    for bad in (token[:10], token[:-3], "!!!!", "AAAA", base64.urlsafe_b64encode(b"10.0.0.7:8000").decode()):
        assert t.open(bad)[0] is SessionOutcome.TAMPERED, bad


def test_a_token_sealed_with_another_deployments_key_is_tampered() -> None:
    assert SessionTokens([K2], 60).open(SessionTokens([K1], 60).seal("10.0.0.7:8000"))[0] is SessionOutcome.TAMPERED


def test_a_token_expires_after_the_ttl() -> None:
    clock = Clock(1_800_000_000.0)
    t = SessionTokens([K1], 60, clock=clock)
    token = t.seal("10.0.0.7:8000")
    clock.now += 59
    assert t.open(token)[0] is SessionOutcome.HONOURED
    clock.now += 2
    assert t.open(token) == (SessionOutcome.EXPIRED, None)


def test_rotation_seals_with_the_first_key_and_still_opens_tokens_of_the_old_one() -> None:
    t = SessionTokens([K1], 60)
    old = t.seal("10.0.0.7:8000")
    t.set_keys([K2, K1])
    new = t.seal("10.0.0.8:8000")
    assert t.open(old)[1] == "10.0.0.7:8000" and t.open(new)[1] == "10.0.0.8:8000"
    assert SessionTokens([K2], 60).open(new)[0] is SessionOutcome.HONOURED
    t.set_keys([K2])  # the old key retired: its tokens are refused
    assert t.open(old)[0] is SessionOutcome.TAMPERED


def test_an_oversized_token_is_refused_before_any_decoding() -> None:
    assert SessionTokens([K1], 60).open("A" * (MAX_TOKEN_CHARS + 1)) == (SessionOutcome.OVERSIZED, None)
    assert len(SessionTokens([K1], 60).seal("w" * 255)) <= MAX_TOKEN_CHARS


@pytest.mark.parametrize("placeholder", ["", "new", "NEW", " 1 ", "true"])
def test_an_opt_in_placeholder_asks_for_a_new_token(placeholder: str) -> None:
    assert SessionTokens([K1], 60).open(placeholder) == (SessionOutcome.NEW, None)


def test_keys_are_read_in_base64_urlsafe_base64_and_hex_with_comments() -> None:
    text = f"# current\n{base64.b64encode(K1).decode()}\n\n{base64.urlsafe_b64encode(K2).decode()}  # old\n" \
           f"{os.urandom(32).hex()}\n"
    keys = parse_keys(text)
    assert keys[:2] == [K1, K2] and len(keys) == 3


@pytest.mark.parametrize("text,why", [
    ("", "no key"),
    ("# only a comment\n", "no key"),
    (base64.b64encode(os.urandom(16)).decode(), "line 1"),
    ("not a key at all", "line 1"),
    (f"{K1.hex()}\n{base64.b64encode(K1).decode()}", "twice"),
])
def test_a_bad_key_list_is_refused_naming_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(SessionKeyError, match=why):
        parse_keys(text)


def test_a_missing_key_file_is_a_value_error_naming_the_path(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="cannot read .*nope"):
        read_keys_file(str(tmp_path / "nope"))
