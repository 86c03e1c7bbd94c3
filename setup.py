"""The optional C accelerators: the KV-event ingest's (kvindex/_csrc/native.c, see kvindex/native.py) and
h2grpc's HPACK Huffman decoder (h2grpc/_csrc/huffman.c, see h2grpc/native.py).

Everything else about the package is in pyproject.toml.  Both extensions are ``optional``: where one cannot be
compiled (no C compiler, no Python headers) setuptools prints "building extension ... failed" and the install
goes on; the package then runs its pure-Python path, which logs that it does.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvindex._native",
            sources=["kvindex/_csrc/native.c"],
            depends=["kvindex/_csrc/xxhash.h", "kvindex/_csrc/walk.h"],
            optional=True,
        ),
        Extension(
            "h2grpc._huffman",
            sources=["h2grpc/_csrc/huffman.c"],
            optional=True,
        ),
    ]
)
