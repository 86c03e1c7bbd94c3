"""The one way the picker follows files it was pointed at (TLS key pairs, the endpoints file, the
objectives file): poll their stamps, and on a change load them off the event loop, then swap.

A stamp is each file's (mtime, size, inode) as `os.stat` sees it through symlinks: a renewed Kubernetes
Secret swaps its `..data` link, which changes the inode even when the size and second do not. A load that
fails (a file missing, half-written, not parseable, a key that is not the certificate's) is handed to the
owner's `on_error` once per file version and the previous value stays in service. A version that changed
again while it was being read is not trusted: it is read again at the next poll.

Two policies for a version that does not load: `retry_failed=True` (TLS: a Secret written file by file
completes a moment later, maybe within the same second and size) reads it again at every poll;
`retry_failed=False` (endpoints, objectives: a bad edit stays bad until the next edit) reads it once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
Stamp = tuple[tuple[float, int, int], ...]
UNSEEN: Stamp = ((-1.0, -1, -1),)  # differs from every real stamp and from "missing" (None)


def file_stamp(paths: Iterable[str | os.PathLike[str]]) -> Stamp | None:
    """(mtime, size, inode) of each file: a renewed Kubernetes Secret swaps its `..data` link, which changes
    the inode even when the size and second do not. None while any file is missing (mid-swap)."""
    try:
        return tuple((st.st_mtime, st.st_size, st.st_ino) for st in (os.stat(p) for p in paths))
    except OSError:
        return None


class FileWatch(Generic[T]):
    """Polls `paths`; on a change runs `load()` (blocking file reads and parsing: in a worker thread from
    `check`, in the caller's thread from `check_sync`), then `apply(value)` in the caller's context (the event
    loop), whose truth value `check` returns (e.g. "a new pair went into service").

    `load` raising is a version that does not load: `on_error(exc)` runs once per version, nothing is applied.
    `stamp` is the version already in service (taken when the owner loaded the files itself at start-up).
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], load: Callable[[], T],
                 apply: Callable[[T], object], *, on_error: Callable[[Exception], None],
                 interval_s: float = 1.0, retry_failed: bool = False, stamp: Stamp | None = UNSEEN) -> None:
        self.paths = tuple(paths)
        self.interval_s = interval_s
        self.retry_failed = retry_failed
        self.failures = 0  # versions that did not load (tests, /debug)
        self._load = load
        self._apply = apply
        self._on_error = on_error
        self._stamp = stamp  # the version in service (or refused, when retry_failed is off)
        self._refused: Stamp | None = UNSEEN  # the last version reported to on_error

    def stamp(self) -> Stamp | None:
        return file_stamp(self.paths)

    def _read(self, stamp: Stamp | None) -> tuple[bool, T | Exception | None]:
        """(stable, value or the load's error). Not stable: the files changed while being read."""
        try:
            value: T | Exception = self._load()
        except Exception as e:  # noqa: BLE001 - anything a hostile or half-written file causes
            value = e
        return file_stamp(self.paths) == stamp, value

    def _settle(self, stamp: Stamp | None, stable: bool, value: T | Exception | None) -> bool:
        if not stable:
            return False  # caught mid-write: the next poll reads the finished files
        if isinstance(value, Exception):
            if not self.retry_failed:
                self._stamp = stamp
            if stamp != self._refused:
                self._refused = stamp
                self.failures += 1
                self._on_error(value)
            return False
        self._stamp = stamp
        self._refused = UNSEEN
        try:
            return bool(self._apply(value))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - a value that loaded but cannot be put in service
            self.failures += 1
            self._on_error(e)
            return False

    async def check(self) -> bool:
        """Load and apply the files if they changed since the version in service; never raises (but a
        cancellation). Stat, read and parse run in a worker thread; only `apply` runs on the loop."""
        stamp = await asyncio.to_thread(file_stamp, self.paths)
        if stamp == self._stamp:
            return False
        stable, value = await asyncio.to_thread(self._read, stamp)
        return self._settle(stamp, stable, value)

    def check_sync(self) -> bool:
        """`check` in the caller's thread (start-up, tests)."""
        stamp = file_stamp(self.paths)
        if stamp == self._stamp:
            return False
        return self._settle(stamp, *self._read(stamp))

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)
