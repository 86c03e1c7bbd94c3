"""`FileWatch`, the one file watcher: a change is loaded and swapped in; one that does not load is reported
once and the previous value kept; a Kubernetes-style `..data` symlink swap counts as a change."""

from __future__ import annotations

import os
from pathlib import Path

from epp_extproc.file_watch import FileWatch, file_stamp


class Sink:
    def __init__(self) -> None:
        self.values: list[str] = []
        self.errors: list[Exception] = []

    def apply(self, v: str) -> bool:
        self.values.append(v)
        return True


def _load(path: Path):  # noqa: ANN202
    def load() -> str:
        text = path.read_text()
        if text.startswith("bad"):
            raise ValueError("bad file")
        return text
    return load


def _watch(path: Path, sink: Sink, **kw: object) -> FileWatch[str]:
    return FileWatch([path], _load(path), sink.apply, on_error=sink.errors.append, **kw)  # type: ignore[arg-type]


def _rewrite(path: Path, text: str, t: int) -> None:
    path.write_text(text)
    os.utime(path, (t, t))  # a different mtime even within one clock tick


async def test_a_change_is_loaded_and_applied_once(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("one")
    sink = Sink()
    w = _watch(f, sink)
    assert await w.check() is True and await w.check() is False
    _rewrite(f, "two", 5)
    assert await w.check() is True
    assert sink.values == ["one", "two"]


async def test_a_change_that_does_not_load_is_reported_once_and_the_old_value_kept(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("one")
    sink = Sink()
    w = _watch(f, sink)
    await w.check()
    _rewrite(f, "bad", 6)
    assert await w.check() is False and await w.check() is False
    assert sink.values == ["one"] and len(sink.errors) == 1 and w.failures == 1


async def test_retry_failed_reads_a_refused_version_again_but_reports_it_once(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("bad")
    sink = Sink()
    w = _watch(f, sink, retry_failed=True)
    reads = []
    inner = w._load
    w._load = lambda: (reads.append(1), inner())[1]  # type: ignore[method-assign]
    await w.check()
    await w.check()
    assert len(reads) == 2 and len(sink.errors) == 1


async def test_a_missing_file_is_a_version_that_does_not_load(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("one")
    sink = Sink()
    w = _watch(f, sink)
    await w.check()
    f.unlink()
    assert await w.check() is False
    assert sink.values == ["one"] and isinstance(sink.errors[0], FileNotFoundError)


async def test_a_symlink_swap_of_the_data_dir_is_a_change(tmp_path: Path) -> None:
    """kubelet's Secret update: new files in a new folder, then `..data` is re-pointed (same size, same second)."""
    for name in ("v1", "v2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x").write_text(f"{name}!")
        os.utime(tmp_path / name / "x", (7, 7))
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "x").symlink_to("..data/x")
    sink = Sink()
    w = _watch(tmp_path / "x", sink)
    await w.check()
    (tmp_path / "..data_tmp").symlink_to("v2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert await w.check() is True
    assert sink.values == ["v1!", "v2!"]


async def test_a_file_changed_while_being_read_is_read_again_at_the_next_poll(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("one")
    sink = Sink()
    w = _watch(f, sink)
    inner = w._load
    rewrites = iter([lambda: _rewrite(f, "two", 9)])

    def racing() -> str:
        v = inner()
        next(rewrites, lambda: None)()  # a writer finishes just after our read
        return v

    w._load = racing  # type: ignore[method-assign]
    assert await w.check() is False and sink.values == []
    assert await w.check() is True and sink.values == ["two"]


def test_check_sync_reads_in_the_callers_thread(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("one")
    sink = Sink()
    assert _watch(f, sink).check_sync() is True and sink.values == ["one"]


def test_a_stamp_is_none_while_any_file_is_missing(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("a")
    assert file_stamp([tmp_path / "a"]) is not None
    assert file_stamp([tmp_path / "a", tmp_path / "b"]) is None
