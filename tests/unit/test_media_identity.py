"""Which identity each media item is forwarded with (core/media.inspect), and what counts as a media part."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from epp_extproc.core.media import (
    DIGEST_PREFIX,
    Source,
    data_uri_digest,
    has_content_parts,
    inspect,
    part_kind,
    salted_uuid,
)

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(200))
DATA = "data:image/png;base64," + base64.b64encode(PNG).decode()


def img(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def body(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]}


def one(*parts: dict[str, Any], trust: bool = False, salt: str | None = None, derive: bool = True):
    return inspect(body(*parts), trust_uuids=trust, salt=salt, derive=derive)


def test_a_data_uri_is_identified_by_the_sha256_of_its_decoded_bytes() -> None:
    m = one(img(DATA))
    (p,) = m.parts
    assert p.forward_uuid == DIGEST_PREFIX + hashlib.sha256(PNG).hexdigest()
    assert (p.source, p.rewrite, p.message, p.part) == (Source.DIGEST, True, 1, 1)


def test_the_same_bytes_get_the_same_identity_and_other_bytes_another() -> None:
    other = "data:image/png;base64," + base64.b64encode(PNG + b"x").decode()
    a, b, c = one(img(DATA)).parts[0], one(img(DATA)).parts[0], one(img(other)).parts[0]
    assert a.forward_uuid == b.forward_uuid != c.forward_uuid


def test_an_untrusted_caller_uuid_on_a_data_uri_is_replaced_by_the_digest() -> None:
    (p,) = one(img(DATA, uuid="someone-elses-image")).parts
    assert p.forward_uuid == DIGEST_PREFIX + hashlib.sha256(PNG).hexdigest() and p.rewrite


def test_a_trusted_caller_uuid_is_forwarded_as_sent() -> None:
    (p,) = one(img(DATA, uuid="mine"), trust=True).parts
    assert (p.source, p.forward_uuid, p.rewrite) == (Source.TRUSTED_UUID, "mine", False)


def test_an_untrusted_caller_uuid_under_a_salt_is_namespaced_by_the_tenant() -> None:
    (a,) = one(img(DATA, uuid="u1"), salt="tenant-a").parts
    (b,) = one(img(DATA, uuid="u1"), salt="tenant-b").parts
    assert a.source is Source.SALTED_UUID and a.rewrite
    assert a.forward_uuid == salted_uuid("tenant-a", "u1") != b.forward_uuid


def test_an_http_url_is_never_an_identity_and_an_untrusted_uuid_on_it_is_removed() -> None:
    (plain,) = one(img("https://example.com/cat.png")).parts
    assert (plain.source, plain.forward_uuid, plain.rewrite) == (Source.ENGINE, None, False)
    (tagged,) = one(img("http://example.com/cat.png", uuid="cat")).parts
    assert (tagged.source, tagged.forward_uuid, tagged.rewrite) == (Source.DROPPED_UUID, None, True)


def test_an_untrusted_uuid_only_reference_is_refused() -> None:
    m = one({"type": "image_url", "image_url": None, "uuid": "someone-elses-image"})
    assert m.refused is not None and "--trust-media-uuids" in m.refused


def test_a_uuid_only_reference_is_allowed_when_trusted_or_namespaced() -> None:
    ref = {"type": "image_url", "image_url": None, "uuid": "mine"}
    assert one(ref, trust=True).refused is None
    assert one(ref, salt="t").refused is None


def test_without_derivation_a_data_uri_keeps_no_uuid() -> None:
    (p,) = one(img(DATA), derive=False).parts
    assert (p.source, p.forward_uuid, p.rewrite) == (Source.ENGINE, None, False)


def test_a_non_base64_or_undecodable_data_uri_gets_no_derived_identity() -> None:
    assert data_uri_digest("data:image/png,abc") is None
    assert data_uri_digest("data:image/png;base64,@@@") is None
    assert one(img("data:image/png;base64,@@@")).parts[0].source is Source.ENGINE


def test_parts_are_in_prompt_order_across_messages() -> None:
    b = body(img(DATA))
    b["messages"].append({"role": "user", "content": [img("https://x/y.png"), {"type": "text", "text": "t"}]})
    m = inspect(b, trust_uuids=False, salt=None)
    assert [(p.message, p.part) for p in m.parts] == [(1, 1), (2, 0)]
    assert m.first_message == 1


def test_media_parts_are_classified_as_vllm_does() -> None:
    assert part_kind({"type": "image_url", "image_url": {"url": "x"}}) == "image_url"
    assert part_kind({"image_url": "https://x"}) == "image_url"  # no type: the simple form
    assert part_kind({"type": "input_image", "image_url": "x"}) == "input_image"
    assert part_kind({"type": "text", "text": "image_url"}) is None
    assert part_kind({"type": "text", "text": "t", "image_url": "x", "uuid": "u"}) == "image_url"  # uuid branch
    assert part_kind({"type": "video_url", "video_url": {"url": "x"}}) == "video_url"
    assert part_kind({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}) == "input_audio"
    assert part_kind({"type": "image_embeds", "image_embeds": "abc"}) == "image_embeds"


def test_video_audio_and_embeddings_make_a_request_load_only() -> None:
    assert one({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}).load_only_reason == "video"
    assert one({"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}}).load_only_reason == "audio"
    assert one({"type": "image_embeds", "image_embeds": "AAAA"}).load_only_reason == "embeds"
    assert one(img(DATA)).load_only_reason is None


def test_caller_uuids_on_video_are_held_to_the_same_rule() -> None:
    (p,) = one({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}, "uuid": "v"}).parts
    assert (p.source, p.rewrite, p.forward_uuid) == (Source.DROPPED_UUID, True, None)


def test_text_only_requests_have_no_media() -> None:
    assert inspect({"messages": [{"role": "user", "content": "hi"}]}, trust_uuids=False, salt=None).parts == []
    assert inspect({"prompt": "x"}, trust_uuids=False, salt=None).parts == []


def test_only_a_chat_with_list_contents_can_carry_media() -> None:
    assert not has_content_parts({"messages": [{"role": "user", "content": "hi"}]})
    assert not has_content_parts({"prompt": "hi"})
    assert has_content_parts({"messages": [{"role": "user", "content": "hi"},
                                           {"role": "user", "content": [{"type": "text", "text": "x"}]}]})
