"""The optional C accelerator of the KV-event ingest (kvindex/_csrc/native.c, see kvindex/native.py).

Everything else about the package is in pyproject.toml.  The extension is ``optional``: where it cannot be
compiled (no C compiler, no Python headers) setuptools prints "building extension kvindex._native failed" and
the install goes on; the package then runs its pure-Python path, which logs that it does (kvindex/native.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvindex._native",
            sources=["kvindex/_csrc/native.c"],
            depends=["kvindex/_csrc/xxhash.h", "kvindex/_csrc/walk.h"],
            optional=True,
        )
    ]
)
