"""Width and height of a PNG, JPEG or GIF from its header bytes, without decoding a pixel.

Why hand-written instead of Pillow: the mock needs only the size (a Qwen-VL model's placeholder count depends on
nothing else), Pillow is not a dependency of this project, and reading a few header fields is bounded work on any
input (no decompression, no allocation that grows with the claimed size). The formats: PNG's first chunk is IHDR
(width, height as big-endian u32, PNG spec 11.2.2); a JPEG's size sits in its first SOFn segment (ITU T.81 B.2.2:
marker FFCn, length, precision, height, width); GIF's logical screen size follows the 6-byte signature
(little-endian u16s). Anything else is "not an image" — what PIL's ``Image.open`` says about bytes it cannot
identify, and so what both engines answer (they open media with PIL).
"""

from __future__ import annotations

import struct

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# SOFn markers that carry a frame header; C4 (DHT), C8 (JPG extension) and CC (DAC) are not frames
_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM and RSTn have no length field


class NotAnImage(ValueError):
    """The bytes are not a PNG, JPEG or GIF whose size could be read."""


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of the image in ``data``; raises :class:`NotAnImage` otherwise."""
    if data.startswith(PNG_SIGNATURE):
        return _png(data)
    if data.startswith(b"\xff\xd8"):
        return _jpeg(data)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack_from("<HH", data, 6)
        return _checked(w, h)
    raise NotAnImage("unknown image format")


def _checked(w: int, h: int) -> tuple[int, int]:
    if w <= 0 or h <= 0:
        raise NotAnImage("image has a zero dimension")
    return w, h


def _png(data: bytes) -> tuple[int, int]:
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise NotAnImage("PNG without an IHDR chunk")
    w, h = struct.unpack_from(">II", data, 16)
    return _checked(w, h)


def _jpeg(data: bytes) -> tuple[int, int]:
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            raise NotAnImage("JPEG segment without a marker")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            break
        (length,) = struct.unpack_from(">H", data, i + 2)
        if length < 2:
            raise NotAnImage("JPEG segment with a bad length")
        if marker in _SOF_MARKERS:
            if i + 9 > n:
                break
            h, w = struct.unpack_from(">HH", data, i + 5)
            return _checked(w, h)
        i += 2 + length  # every step moves forward: the loop ends within len(data) / 4 iterations
    raise NotAnImage("JPEG without a frame header")
