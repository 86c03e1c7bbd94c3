"""Vision mode, pure functions: image sizes from real header bytes, and Qwen2/2.5-VL placeholder counts."""

from __future__ import annotations

import pytest

from tests.mock.test_mock_vision_support import jpeg, png
from trtllm_mock.image_size import NotAnImage, image_size
from trtllm_mock.vision import smart_resize, vision_grid


def test_png_size_comes_from_its_ihdr():
    assert image_size(png(37, 21)) == (37, 21)


def test_jpeg_size_comes_from_its_frame_header_after_other_segments():
    assert image_size(jpeg(300, 200)) == (300, 200)


def test_gif_size_comes_from_its_logical_screen():
    assert image_size(b"GIF89a" + (640).to_bytes(2, "little") + (480).to_bytes(2, "little") + b"\x00" * 8) == (
        640, 480)


@pytest.mark.parametrize("data", [b"", b"hello, not an image", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xd9",
                                  b"\xff\xd8\xff\xe0\x00\x01", png(1, 1)[:20]])
def test_bytes_that_are_not_a_sized_image_are_refused(data):
    with pytest.raises(NotAnImage):
        image_size(data)


# Expected values computed with transformers 5.19.0's own smart_resize (models/qwen2_vl/image_processing_qwen2_vl.py,
# factor 28, min_pixels 56*56, max_pixels 28*28*1280) when this test was written.
@pytest.mark.parametrize(("w", "h", "resized", "tokens"), [
    (28, 28, (56, 56), 4),  # below min_pixels: scaled up
    (224, 224, (224, 224), 64),
    (640, 480, (476, 644), 391),
    (1024, 1024, (980, 980), 1225),  # above max_pixels: scaled down
    (1920, 1080, (728, 1316), 1222),
    (3000, 40, (28, 2996), 107),
])
def test_placeholder_count_follows_qwen2_vl_smart_resize(w, h, resized, tokens):
    assert smart_resize(h, w) == resized
    assert vision_grid(w, h)[1] == tokens


def test_encoder_patches_are_four_per_placeholder_token():
    patches, tokens = vision_grid(640, 480)
    assert patches == 4 * tokens
