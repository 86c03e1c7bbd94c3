"""The verdicts as a table for people or JSON for pipelines, and the exit status: non-zero iff a MUST failed
(a skipped MUST is reported, not failed: the checker could not create its condition)."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass

from epp_extproc.conformance.checks import Check, Verdict

__all__ = ["Row", "exit_code", "render_json", "render_table"]


@dataclass(frozen=True)
class Row:
    check: Check
    verdict: Verdict

    def as_dict(self) -> dict[str, str]:
        return {"check": self.check.name, "via": self.check.via or "ext_proc", "level": self.check.level, "text": self.check.text,
                "result": self.verdict.status, "why": self.verdict.why}


def exit_code(rows: list[Row]) -> int:
    return 1 if any(r.check.level == "MUST" and r.verdict.status == "fail" for r in rows) else 0


def render_json(target: str, rows: list[Row]) -> str:
    return json.dumps({"target": target, "ok": exit_code(rows) == 0, "checks": [r.as_dict() for r in rows]},
                      indent=2)


def render_table(target: str, rows: list[Row], width: int = 100) -> str:
    """One block per check: the verdict line, then the protocol text it enforces, then why."""
    name_w = max(len(r.check.label) for r in rows)
    out = [f"endpoint-picker protocol conformance: {target}", ""]
    out.append(f"{'result':<6}  {'level':<6}  {'check':<{name_w}}  why")
    out.append("-" * width)
    for r in rows:
        lead = f"{r.verdict.status.upper():<6}  {r.check.level:<6}  {r.check.label:<{name_w}}  "
        why = textwrap.wrap(r.verdict.why, max(width - len(lead), 30)) or [""]
        out.append(lead + why[0])
        out.extend(" " * len(lead) + w for w in why[1:])
        out.extend(textwrap.wrap(f'"{r.check.text}"', width, initial_indent=" " * len(lead),
                                 subsequent_indent=" " * len(lead)))
    counts = {s: sum(r.verdict.status == s for r in rows) for s in ("pass", "fail", "skip")}
    failed_must = [r.check.label for r in rows if r.check.level == "MUST" and r.verdict.status == "fail"]
    out.append("-" * width)
    out.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped; "
               + (f"MUST failed: {', '.join(failed_must)}" if failed_must else "every MUST checked passed"))
    return "\n".join(out)
