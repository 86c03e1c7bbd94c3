"""`/debug/score`: a proposal as a document. Scored, never committed, so its blocks are what the pick WOULD book
(`would_book_blocks`; `booked_blocks` is the same value under its old, misleading name, kept for one release).
Each plugin's per-row notes (predicted times, eviction figures) appear beside the row they explain."""

from __future__ import annotations

from typing import Any

from epp_extproc.core.contract import KvLookup
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.forward import Forwarder
from epp_extproc.core.proposal import Proposal
from epp_extproc.core.scheduling.table import CandidateTable

TIME_NOTE = "predicted-time-scorer"  # flattened into each row as predicted_ttft_ms / predicted_tpot_ms


class DebugView:
    def __init__(self, registry: EndpointRegistry, kv: KvLookup | None, forwarder: Forwarder, *,
                 cost_model: str, pd_threshold: int, default_block_size: int,
                 scheduling: dict[str, Any] | None = None) -> None:
        self.scheduling = scheduling or {}  # the handler and each profile's plugins, as the spec named them
        self.registry = registry
        self.kv = kv
        self.forwarder = forwarder
        self.cost_model = cost_model
        self.pd_threshold = pd_threshold
        self.default_block_size = default_block_size

    def _rows(self, table: CandidateTable) -> list[dict[str, Any]]:
        names = {ep.address: ep.name for ep in self.registry.all()}
        times = table.notes.get(TIME_NOTE)
        out = []
        for i, a in enumerate(table.addresses):
            load = table.loads[i]
            row = {"name": names.get(a), "address": a, "overlap_blocks": table.overlap[i],
                   "block_size": self.kv.block_size(a) if self.kv else None,
                   "prompt_blocks": round(table.prompt_blocks[i], 3), "inflight": load.inflight,
                   "prefill_blocks": round(load.prefill_blocks, 3), "decode_blocks": round(load.decode_blocks, 3),
                   "cost": round(table.cost[i], 4)}
            if times is not None:
                ttft, tpot = times[i]
                row["predicted_ttft_ms"] = round(ttft * 1000.0, 3)
                row["predicted_tpot_ms"] = round(tpot * 1000.0, 3)
            out.append(row)
        return out

    def explain(self, p: Proposal) -> dict[str, Any]:
        table = p.primary.table
        workers = self._rows(table)
        kv = self.kv
        credit = kv.credit(p.plan.prompt, list(table.addresses)) \
            if kv is not None and p.plan.prompt is not None else None
        # each plugin's per-row note under its own key (eviction figures, credit per tier, ...): a new plugin
        # is explained here without an edit
        notes = [(key, col) for key, col in table.notes.items() if key != TIME_NOTE]
        for i, w in enumerate(workers):
            for key, col in notes:
                note = col[i]
                w[key] = note.explain() if note is not None else None
            address = str(w["address"])
            if credit is not None:  # where each worker's overlap comes from: its events, or predictions
                c = credit.get(address)
                w["confirmed_blocks"], w["predicted_blocks"] = (c.confirmed, c.predicted) if c else (0, 0)
                # queue lifetime: the worker's predicted blocks alive because their request still waits there
                w["held_prediction_blocks"] = kv.held(address) if kv is not None else 0
            v = self.forwarder.passthrough(p.plan, p.parsed, address)
            if v is not None:
                w["prompt_passthrough"] = {"forwarded": v.forward, "reason": v.reason}
        v = p.passthrough
        injected = sorted({*p.plan.inject, *(v.inject if v is not None else ())})
        # what the picked worker would receive: the rendered prompt (`tokens`) or the original body
        forwarded = None if v is None else {"body": v.forward, "reason": v.reason, "members": sorted(v.inject)}
        return {"route": p.plan.route, "prompt_tokens": len(p.plan.tokens or []), "workers": workers,
                "pick": p.address, "would_book_blocks": round(p.booked_blocks, 3),
                "booked_blocks": round(p.booked_blocks, 3),  # deprecated: would_book_blocks
                "predicted_cached_tokens": p.predicted_cached_tokens, "injected_members": injected,
                "forwarded": forwarded,
                "model_rewrite": None if p.rewrite is None else {"rewrite": p.rewrite.resource,
                                                                 "model": p.rewrite.model,
                                                                 "target": p.rewrite.target},
                "session": p.session.value if p.session is not None else None,
                "cost_model": self.cost_model, "slo": p.slo, "scheduling": self.scheduling,
                "media": self._media(p),
                "pd": self._pd(p)}

    def _media(self, p: Proposal) -> dict[str, Any] | None:
        """Each item's identity and source, its span and the picked worker's blocks it keys (first..last)."""
        plan = p.plan
        if plan.media is None:
            return None
        scored, why = plan.media_outcome()
        bs = self.kv.block_size(p.address) if self.kv is not None else self.default_block_size
        spans = iter(plan.media_items)
        items = []
        for part in plan.media.parts:
            doc: dict[str, Any] = {"message": part.message, "part": part.part, "modality": part.modality,
                                   "origin": part.origin, "identity_source": part.source.value,
                                   "forwarded_uuid": part.forward_uuid}
            span = next(spans, None) if plan.media_items else None
            if span is not None:
                item = span[1]
                doc.update(identifier=item.identifier, offset=item.offset, length=item.length,
                           blocks=[item.offset // bs, (item.offset + item.length - 1) // bs], block_size=bs)
            items.append(doc)
        return {"scored": scored.value, "reason": why, "credited_tokens": len(plan.tokens or []),
                "prompt_tokens": plan.prompt_tokens or len(plan.tokens or []), "items": items}

    def _pd(self, p: Proposal) -> dict[str, Any]:
        """Both choices of a disaggregated pool and the decider's reason (`workers` above are the decode
        candidates; `prefill_workers` the prefill ones, scored only when the decider disaggregates)."""
        pd = p.pd
        return {"path": pd.path.value, "reason": pd.reason.value, "decode": p.address, "prefill": pd.address,
                "uncached_tokens": pd.uncached_tokens,
                "min_uncached_tokens": self.pd_threshold,
                "would_book_prefill_blocks": round(pd.prefill_blocks, 3) if pd.address else None,
                "prefill_workers": self._rows(pd.prefill.table) if pd.prefill is not None else []}
