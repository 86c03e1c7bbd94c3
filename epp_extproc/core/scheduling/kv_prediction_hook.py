"""Commit hook: the committed prompt's blocks are predicted where they will be computed, until the workers'
own KV events confirm or cancel them. An aggregated request's prediction follows its booking (queue
lifetime); a disaggregated one is predicted on the prefill worker, and on the decode worker only where the
engine keeps transferred blocks (core/engine.py), with the fixed ttl (its decode booking sees no prefill end
of its own)."""

from __future__ import annotations

from epp_extproc.core.contract import BookingHandle, KvLookup
from epp_extproc.core.decision import Stopwatch
from epp_extproc.core.engine import EngineProfile
from epp_extproc.core.proposal import Proposal


class KvPredictionHook:
    name = "kv-prediction"

    def __init__(self, kv: KvLookup, engine: EngineProfile | None) -> None:
        self.kv = kv
        self._decode_keeps = engine is not None and engine.decode_keeps_transferred_blocks

    def committed(self, p: Proposal, booking: BookingHandle) -> Stopwatch | None:
        prompt = p.plan.prompt
        if prompt is None:
            return None
        prefill = p.pd.address
        if prefill is not None:
            self.kv.predict(prefill, prompt)
        if prefill is None or self._decode_keeps:
            self.kv.predict(p.address, prompt, booking.id if prefill is None else None)
        return None
