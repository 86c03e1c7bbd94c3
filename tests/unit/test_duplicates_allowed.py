"""`.duplicates-allowed` is the house's list of repeated code kept on purpose: every entry must stay true.

CI has no `duplicates` command, so these tests check the file itself (each entry parses, names files and
classes/functions that exist, and gives one reason) and the rule that decides which listed pair an entry
covers. Where `duplicates` is installed, this module is also the coverage check:

    duplicates --most 100 --seconds 60 | .venv/bin/python -m tests.unit.test_duplicates_allowed

prints every listed pair that no entry covers and exits 1 when there is one.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = ROOT / ".duplicates-allowed"
REGENERATE = "duplicates --most 100 --seconds 60"
ROW = re.compile(r"^D\d+ (\S+):(\d+)-(\d+) ~ (\S+):(\d+)-(\d+)")
LINES = re.compile(r"^(\S+):(\d+)-(\d+)$")
NAMED = re.compile(r"^(\S+)::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")


@dataclass(frozen=True)
class Place:
    """A class or function by qualified name (survives line shifts), or a line range for module-level code."""

    path: str
    name: str | None = None
    lines: tuple[int, int] | None = None


@dataclass(frozen=True)
class Entry:
    a: Place
    b: Place
    reason: str
    line: int  # in the file, for messages


def parse_place(text: str) -> Place:
    if m := NAMED.match(text):
        return Place(m[1], name=m[2])
    if m := LINES.match(text):
        return Place(m[1], lines=(int(m[2]), int(m[3])))
    raise ValueError(f"not a place (path::Name or path:START-END): {text!r}")


def parse(text: str) -> list[Entry]:
    """Entries in file order; a line that is not `PLACE ~ PLACE | REASON` raises, naming its line."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        places, sep, reason = line.partition(" | ")
        a, tilde, b = places.partition(" ~ ")
        if not sep or not tilde or not reason.strip():
            raise ValueError(f"line {n}: expected 'PLACE ~ PLACE | REASON', got {line!r}")
        out.append(Entry(parse_place(a.strip()), parse_place(b.strip()), reason.strip(), n))
    return out


@cache
def _defs(file: Path) -> dict[str, tuple[int, int]]:
    """Every class and function of a Python file by qualified name -> (first line incl. decorators, last)."""
    found: dict[str, tuple[int, int]] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                first = min([ch.lineno] + [d.lineno for d in ch.decorator_list])
                found[prefix + ch.name] = (first, ch.end_lineno or ch.lineno)
                walk(ch, prefix + ch.name + ".")

    walk(ast.parse(file.read_text(), str(file)), "")
    return found


def span(place: Place, root: Path) -> tuple[int, int]:
    """The lines a place stands for now; LookupError when its name is no longer in its file."""
    if place.lines is not None:
        return place.lines
    assert place.name is not None
    try:
        return _defs(root / place.path)[place.name]
    except KeyError:
        raise LookupError(f"{place.path} defines no {place.name}") from None


def _overlaps(place: Place, side: tuple[str, int, int], root: Path) -> bool:
    path, start, end = side
    if place.path != path:
        return False
    first, last = span(place, root)
    return start <= last and first <= end


def covers(entry: Entry, a: tuple[str, int, int], b: tuple[str, int, int], root: Path) -> bool:
    """Each side of the pair overlaps one of the entry's places, in either order."""
    return ((_overlaps(entry.a, a, root) and _overlaps(entry.b, b, root))
            or (_overlaps(entry.a, b, root) and _overlaps(entry.b, a, root)))


def uncovered(report: str, entries: list[Entry], root: Path) -> list[str]:
    """The rows of a `duplicates` report that no entry covers."""
    out = []
    for row in report.splitlines():
        if m := ROW.match(row):
            a = (m[1], int(m[2]), int(m[3]))
            b = (m[4], int(m[5]), int(m[6]))
            if not any(covers(e, a, b, root) for e in entries):
                out.append(row)
    return out


# ---------------------------------------------------------------------------------------------- the file


@pytest.fixture(scope="module")
def entries() -> list[Entry]:
    return parse(ALLOWED.read_text())


def test_the_header_says_how_to_regenerate_the_list_and_the_rule() -> None:
    header = "\n".join(x for x in ALLOWED.read_text().splitlines() if x.startswith("#"))
    assert REGENERATE in header
    assert "Rule:" in header


def test_every_entry_parses_and_gives_a_reason(entries: list[Entry]) -> None:
    assert entries, "the file lists no entry"
    for e in entries:
        assert e.reason, f"line {e.line} gives no reason"


def test_every_entry_gives_one_reason(entries: list[Entry]) -> None:
    for e in entries:
        assert " | " not in e.reason, f"line {e.line} gives more than one reason"


def test_every_entry_names_files_that_exist(entries: list[Entry]) -> None:
    for e in entries:
        for p in (e.a, e.b):
            assert (ROOT / p.path).is_file(), f"line {e.line}: no file {p.path}"


def test_every_named_class_or_function_and_line_range_exists(entries: list[Entry]) -> None:
    for e in entries:
        for p in (e.a, e.b):
            first, last = span(p, ROOT)  # raises when the name is gone
            assert 1 <= first <= last <= len((ROOT / p.path).read_text().splitlines()), f"line {e.line}: {p}"


def test_no_pair_of_places_is_listed_twice(entries: list[Entry]) -> None:
    pairs = [frozenset((e.a, e.b)) for e in entries]
    assert len(pairs) == len(set(pairs))


# ---------------------------------------------------------------------------------------------- the rule

SOURCE = '''\
def one():
    x = 1
    return x


class Two:
    @staticmethod
    def three():
        return 3
'''


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "m.py").write_text(SOURCE)
    (tmp_path / "n.py").write_text(SOURCE)
    return tmp_path


def test_a_pair_is_covered_when_each_side_overlaps_a_named_place_in_either_order(tree: Path) -> None:
    [e] = parse("m.py::one ~ n.py::Two.three | reason\n")
    assert covers(e, ("m.py", 2, 3), ("n.py", 7, 9), tree)  # the decorator line counts as the method's
    assert covers(e, ("n.py", 8, 9), ("m.py", 1, 2), tree)


def test_a_pair_with_a_side_outside_both_places_is_not_covered(tree: Path) -> None:
    [e] = parse("m.py::one ~ n.py::Two.three | reason\n")
    assert not covers(e, ("m.py", 2, 3), ("n.py", 1, 3), tree)
    assert not covers(e, ("m.py", 2, 3), ("m.py", 8, 9), tree)


def test_a_line_range_place_covers_the_rows_it_overlaps(tree: Path) -> None:
    [e] = parse("m.py:1-3 ~ n.py:6-9 | reason\n")
    assert covers(e, ("m.py", 3, 5), ("n.py", 2, 6), tree)
    assert not covers(e, ("m.py", 4, 5), ("n.py", 2, 6), tree)


def test_only_the_report_rows_no_entry_covers_are_returned(tree: Path) -> None:
    report = ("2 pairs of places (2 files read)\n"
              "D1 m.py:1-3 ~ n.py:7-9 shape\n"
              "D2 m.py:6-9 ~ n.py:6-9 shape boilerplate\n"
              "left out: 1 run of 6 lines that stands in more than 8 places\n")
    entries = parse("m.py::one ~ n.py::Two | reason\n")
    assert uncovered(report, entries, tree) == ["D2 m.py:6-9 ~ n.py:6-9 shape boilerplate"]


@pytest.mark.parametrize("line", ["m.py::one ~ n.py::one", "m.py::one ~ n.py::one |  ", "m.py::one | reason",
                                  "m.py ~ n.py::one | reason"])
def test_an_entry_without_two_places_and_a_reason_is_refused(line: str) -> None:
    with pytest.raises(ValueError):
        parse(line + "\n")


def test_a_name_gone_from_its_file_is_reported(tree: Path) -> None:
    with pytest.raises(LookupError):
        span(Place("m.py", name="gone"), tree)


def main() -> int:
    rows = uncovered(sys.stdin.read(), parse(ALLOWED.read_text()), ROOT)
    for row in rows:
        print(row)
    print(f"{len(rows)} listed pairs not covered by {ALLOWED.name}")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
