"""The optional C Huffman decoder (h2grpc._huffman, h2grpc/native.py) against the pure-Python path it shadows.

Both must give the same octets for every string and the same exception, with the same message, for every
string they refuse (an EOS symbol, padding over 7 bits or not all ones: the connection answers either with
GOAWAY COMPRESSION_ERROR). The differential tests feed both random bytes, strings `hpack`'s encoder wrote, and
hostile strings; tests/unit/test_hpack_decode.py runs its Huffman tests on both paths, and the h2 suites pass
with ``EPP_H2GRPC_PURE=1`` (the pure path alone).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import hpack
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hypothesis import given, settings
from hypothesis import strategies as st

from h2grpc import hpack_decode, native
from h2grpc.hpack_decode import Decoder, huffman_decode_py

ROOT = Path(__file__).resolve().parents[2]
HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
_native = native.MODULE
needs_native = pytest.mark.skipif(_native is None, reason="h2grpc._huffman is not built or EPP_H2GRPC_PURE is set")
EOS_CODE = (1 << 30) - 1  # RFC 7541 Appendix B: EOS is 30 ones


def c_decode(data: bytes) -> bytes:
    assert _native is not None
    return _native.decode(data)  # type: ignore[no-any-return]


def outcome(decode: Callable[[bytes], bytes], data: bytes) -> bytes | tuple[type, str]:
    try:
        return decode(data)
    except Exception as exc:  # noqa: BLE001 - the exception itself is what is compared
        return type(exc), str(exc)


def bits_to_bytes(bits: str) -> bytes:
    """A bit string, padded with ones to whole octets (as an encoder pads)."""
    bits += "1" * (-len(bits) % 8)
    return int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""


def code_bits(octets: bytes) -> str:
    return "".join(format(REQUEST_CODES[o], f"0{REQUEST_CODES_LENGTH[o]}b") for o in octets)


# --- the build and the loader -------------------------------------------------------------------------------

def test_the_accelerator_is_built_where_a_c_compiler_is_present() -> None:
    """`pip install` (or `python setup.py build_ext --inplace`) builds it wherever gcc/cc is found."""
    if os.environ.get(native.PURE_ENV, "") not in ("", "0"):
        pytest.skip("the pure path is forced")
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert _native is not None, "h2grpc._huffman is not built: run `python setup.py build_ext --inplace`"


@needs_native
def test_the_decoder_uses_the_accelerator_when_it_is_built() -> None:
    assert hpack_decode.huffman_decode is _native.decode  # type: ignore[union-attr]


def test_pure_env_turns_the_accelerator_off() -> None:
    code = ("import h2grpc.native as n, h2grpc.hpack_decode as h;"
            "assert n.MODULE is None and h.huffman_decode is h.huffman_decode_py")
    env = {**os.environ, native.PURE_ENV: "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT, timeout=60)


def test_a_missing_build_falls_back_to_pure_python_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "h2grpc._huffman", None)  # makes the import fail
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="h2grpc.native"):
        assert native._load() is None
    assert "not built" in caplog.text and "pure Python" in caplog.text


def test_a_failed_compile_does_not_fail_the_build(tmp_path: Path) -> None:
    """The extension is optional: with a compiler that fails, the build says so and succeeds."""
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    for package in ("kvindex", "h2grpc"):
        shutil.copytree(ROOT / package / "_csrc", tmp_path / package / "_csrc")
        (tmp_path / package / "__init__.py").write_text("")
    env = {**os.environ, "CC": "false", "LDSHARED": "false"}
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "h2grpc._huffman" in proc.stdout + proc.stderr and "failed" in (proc.stdout + proc.stderr).lower()
    assert not list((tmp_path / "h2grpc").glob("_huffman*"))


# --- the same octets ----------------------------------------------------------------------------------------

@needs_native
@settings(max_examples=3_000, deadline=None)
@given(data=st.binary(max_size=64))
def test_any_bytes_decode_or_fail_the_same_on_both_paths(data: bytes) -> None:
    assert outcome(c_decode, data) == outcome(huffman_decode_py, data)


@needs_native
@settings(max_examples=1_000, deadline=None)
@given(octets=st.binary(max_size=2_000))
def test_what_hpacks_encoder_writes_round_trips(octets: bytes) -> None:
    assert c_decode(HUFFMAN.encode(octets)) == octets


@needs_native
@settings(max_examples=500, deadline=None)
@given(text=st.text(max_size=300))
def test_encoded_utf8_text_decodes_the_same_on_both_paths(text: str) -> None:
    coded = HUFFMAN.encode(text.encode())
    assert c_decode(coded) == huffman_decode_py(coded) == text.encode()


@needs_native
def test_every_octet_value_round_trips() -> None:
    assert all(c_decode(HUFFMAN.encode(bytes((o,)) * 3)) == bytes((o,)) * 3 for o in range(256))


@needs_native
def test_the_empty_string_decodes_to_no_octets() -> None:
    assert c_decode(b"") == b""


@needs_native
def test_a_string_longer_than_the_stack_buffer_decodes() -> None:
    octets = bytes(range(256)) * 400  # 102,400 octets, ~300 KB coded: the heap path
    assert c_decode(HUFFMAN.encode(octets)) == octets


@needs_native
def test_a_string_of_5_bit_codes_fills_the_output_bound() -> None:
    """Eight 5-bit codes in five octets: the output is 8/5 of the input, the most there can be."""
    coded = HUFFMAN.encode(b"0" * 8 * 200)  # '0' is 00000: 1,000 octets, 1,600 out
    assert len(coded) == 1_000
    assert c_decode(coded) == b"0" * 1_600 == huffman_decode_py(coded)


@needs_native
def test_bytearray_and_memoryview_decode_as_bytes() -> None:
    coded = HUFFMAN.encode(b"traceparent")
    assert c_decode(bytearray(coded)) == c_decode(memoryview(coded)) == b"traceparent"  # type: ignore[arg-type]


@needs_native
def test_a_fresh_traceparent_decodes_the_same_on_both_paths() -> None:
    coded = HUFFMAN.encode(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    assert c_decode(coded) == huffman_decode_py(coded)


# --- the same errors ----------------------------------------------------------------------------------------

@needs_native
def test_an_eos_symbol_alone_is_the_pure_paths_error() -> None:
    data = bits_to_bytes("1" * 30)  # EOS + two ones of padding
    assert outcome(c_decode, data) == outcome(huffman_decode_py, data) == \
        (hpack.HPACKDecodingError, "an EOS symbol in a Huffman string")


@needs_native
def test_an_eos_symbol_between_symbols_is_the_pure_paths_error() -> None:
    data = bits_to_bytes(code_bits(b"a") + "1" * 30 + code_bits(b"bc"))
    assert outcome(c_decode, data) == outcome(huffman_decode_py, data)
    assert outcome(c_decode, data)[0] is hpack.HPACKDecodingError


@needs_native
@pytest.mark.parametrize("lead", range(8))
def test_an_eos_symbol_at_every_bit_offset_is_an_error(lead: int) -> None:
    data = bits_to_bytes(code_bits(b"0") * lead + "1" * 30)  # 5-bit codes move EOS across octet boundaries
    with pytest.raises(hpack.HPACKDecodingError, match="EOS"):
        c_decode(data)


@needs_native
def test_padding_of_eight_ones_is_the_pure_paths_error() -> None:
    data = HUFFMAN.encode(b"a") + b"\xff"  # 00011 111 + 11111111: 11 bits of padding
    assert outcome(c_decode, data) == outcome(huffman_decode_py, data) == \
        (hpack.HPACKDecodingError, "Huffman padding over 7 bits or not all ones")


@needs_native
def test_padding_not_all_ones_is_the_pure_paths_error() -> None:
    data = b"\x18"  # "a" (00011) + padding 000
    assert outcome(c_decode, data) == outcome(huffman_decode_py, data) == \
        (hpack.HPACKDecodingError, "Huffman padding over 7 bits or not all ones")


@needs_native
@pytest.mark.parametrize("ones", range(1, 8))
def test_padding_of_up_to_seven_ones_is_accepted(ones: int) -> None:
    count = (8 - ones) * 5 % 8  # '0' codes (5 bits each) that leave exactly `ones` bits to pad
    bits = code_bits(b"0") * count + "1" * ones
    assert len(bits) % 8 == 0
    data = bits_to_bytes(bits)
    assert c_decode(data) == huffman_decode_py(data) == b"0" * count


@needs_native
def test_a_long_run_of_ones_under_eos_is_a_padding_error_not_eos() -> None:
    data = b"\xff\xff\xff"  # 24 ones: inside EOS's code, short of it
    assert outcome(c_decode, data) == outcome(huffman_decode_py, data)
    assert "padding" in str(outcome(c_decode, data)[1])


@needs_native
def test_a_str_is_refused_as_the_pure_path_refuses_it() -> None:
    with pytest.raises(TypeError):
        c_decode("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        huffman_decode_py("abc")  # type: ignore[arg-type]


# --- through the header block decoder -----------------------------------------------------------------------

def traced_blocks(n: int) -> list[bytes]:
    """One connection's blocks: Envoy's `:path`, a fresh `traceparent` and request id each, `hpack`'s encoder."""
    rng, enc = random.Random(7), hpack.Encoder()
    return [enc.encode([(":method", "POST"), (":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
                        ("traceparent", f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"),
                        ("x-request-id", f"{rng.getrandbits(64):x}")]) for _ in range(n)]


@needs_native
def test_a_connections_traced_blocks_decode_the_same_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    sequence = traced_blocks(200)
    decoder = Decoder()
    with_c = [decoder.decode(b) for b in sequence]
    monkeypatch.setattr(hpack_decode, "huffman_decode", huffman_decode_py)
    monkeypatch.setattr(hpack_decode, "_UNINDEXED", {})
    decoder = Decoder()
    assert [decoder.decode(b) for b in sequence] == with_c


@needs_native
def test_bad_huffman_in_a_block_is_the_same_error_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    block = b"\x04\x81\x18"  # literal, name :path, a Huffman value of one octet: "a" + 000
    got_c = outcome(Decoder().decode, block)  # type: ignore[arg-type]
    monkeypatch.setattr(hpack_decode, "huffman_decode", huffman_decode_py)
    assert got_c == outcome(Decoder().decode, block) == \
        (hpack.HPACKDecodingError, "Huffman padding over 7 bits or not all ones")  # type: ignore[arg-type]
