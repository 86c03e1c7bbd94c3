"""The two image flags: defaults, the flag, and the Dynamo-style env var."""

from __future__ import annotations

import pytest

from epp_extproc.cli import load_config
from epp_extproc.config import MediaCredit


def test_images_are_credited_exactly_and_caller_uuids_not_trusted_by_default() -> None:
    c = load_config([], env={})
    assert (c.media_credit, c.trust_media_uuids) == (MediaCredit.EXACT, False)


def test_the_flags_set_text_prefix_credit_and_trusted_uuids() -> None:
    c = load_config(["--media-credit", "text-prefix", "--trust-media-uuids", "true"], env={})
    assert (c.media_credit, c.trust_media_uuids) == (MediaCredit.TEXT_PREFIX, True)


def test_the_env_vars_set_them_too() -> None:
    c = load_config([], env={"DYN_EPP_MEDIA_CREDIT": "text-prefix", "DYN_EPP_TRUST_MEDIA_UUIDS": "1"})
    assert (c.media_credit, c.trust_media_uuids) == (MediaCredit.TEXT_PREFIX, True)


def test_an_unknown_media_credit_is_refused() -> None:
    with pytest.raises(SystemExit):
        load_config(["--media-credit", "guess"], env={})
