"""Helpers for the vision-mode tests (no tests here): tiny real images built byte by byte, and image requests."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any


def png(width: int, height: int, shade: int = 0) -> bytes:
    """A real, decodable RGB PNG (signature, IHDR, one zlib IDAT, IEND, every CRC right); ``shade`` changes
    the pixels, so two images of one size differ in content."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + bytes([shade & 0xFF, 0, 0]) * width
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(row * height))
            + chunk(b"IEND", b""))


def jpeg(width: int, height: int) -> bytes:
    """A minimal baseline JPEG header: SOI, JFIF APP0, one quantisation table, the SOF0 frame header (the size),
    then EOI. Enough for any reader that sizes a JPEG from its frame header, as PIL's ``Image.open`` does."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    dqt = b"\xff\xdb" + struct.pack(">H", 67) + b"\x00" + bytes([1] * 64)
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x01\x22\x00\x02\x11\x00\x03\x11\x00"
    return b"\xff\xd8" + app0 + dqt + sof0 + b"\xff\xd9"


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, uuid: str | None = None) -> dict[str, Any]:
    """vLLM's content part: ``uuid`` sits on the part, beside ``image_url`` (vllm/renderers/chat_utils.py)."""
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def image_body(*parts: Any, before: str = "Describe", after: str = "please.", **extra: Any) -> dict[str, Any]:
    """A chat request: a system prompt, then one user message of text, the given image parts, more text."""
    content = [{"type": "text", "text": before}, *parts, {"type": "text", "text": after}]
    return {"model": "mock-model", "max_tokens": 2, "messages": [
        {"role": "system", "content": "You are a careful assistant who looks at pictures."},
        {"role": "user", "content": content}], **extra}
