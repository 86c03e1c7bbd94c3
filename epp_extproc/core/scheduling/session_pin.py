"""Session affinity (`--session-affinity-keys-file`): a valid sealed token sends the request back to the
worker it names, over the picker's choice, while that worker is a candidate (healthy, inside the subset) and
not saturated; anything else keeps the picker's choice. The outcome (honoured, unavailable, expired, ...) is
counted once, at commit (core/session.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest
from epp_extproc.core.session import SESSION_HEADER, SessionOutcome, SessionTokens


class SessionPin:
    name = "session-pin"

    def __init__(self, sessions: SessionTokens, saturated: Callable[[str], bool] | None) -> None:
        self.sessions = sessions
        self._saturated = saturated  # flow control's detector: a saturated worker is not pinned to

    def pin(self, req: SchedulingRequest, table: CandidateTable, chosen: int, outcome: dict[str, Any]) -> int:
        tokens = req.ctx.headers.get(SESSION_HEADER)
        if not tokens:
            return chosen
        result, address = self.sessions.open(tokens[0])
        outcome["session"] = result
        if result is not SessionOutcome.HONOURED or address is None:
            return chosen
        row = table.row(address)
        if row is None or (self._saturated is not None and self._saturated(address)):
            outcome["session"] = SessionOutcome.UNAVAILABLE
            return chosen
        return row
