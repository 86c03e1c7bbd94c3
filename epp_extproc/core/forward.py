"""The body stage: what the chosen worker receives, once the worker is known. `nvext` is dropped (TensorRT-LLM
refuses it), the plan's injections are set (a salt the engine keys on), and, where the engine skips its own
render when handed ids (core/engine.py `passthrough`), the rendered prompt rides along if the rules allow it
(core/passthrough.py). Pure: the body is built, nothing is sent."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from epp_extproc.core.body import BodyError, ParsedBody, rewrite
from epp_extproc.core.engine import EngineProfile
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.passthrough import ORIGINAL, FingerprintId, Verdict, decide
from epp_extproc.core.plan import DROP_MEMBERS, Plan


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    prompt_passthrough: str = "auto"
    max_body_bytes: int = 32 * 1024 * 1024


class Forwarder:
    def __init__(self, settings: ForwardSettings, engine: EngineProfile | None,
                 fingerprint_of: Callable[[str], FingerprintId | None] | None) -> None:
        self.settings = settings
        self.engine = engine
        self.fingerprint_of = fingerprint_of  # a worker's render fingerprint, for prompt passthrough

    def passthrough(self, plan: Plan, parsed: ParsedBody | None, address: str) -> Verdict | None:
        """May the body sent to `address` carry the rendered prompt (core/passthrough.py)? None when the
        question does not arise: the engine renders itself, or not an inference request with a body."""
        if plan.kind is None or parsed is None or self.engine is None or not self.engine.passthrough:
            return None
        worker = self.fingerprint_of(address) if self.fingerprint_of is not None else None
        return decide(self.settings.prompt_passthrough, plan.kind, parsed.values, plan.rendered,
                      salted_load_only=plan.salted_load_only, worker=worker, has_media=plan.media is not None)

    def body(self, plan: Plan, parsed: ParsedBody | None, body: bytes | None,
             address: str) -> tuple[bytes | None, Verdict | None]:
        """The forwarded body and the passthrough verdict behind it; raises PickError (400) for a body the
        byte-preserving rewrite cannot edit."""
        verdict = self.passthrough(plan, parsed, address)
        if parsed is None or body is None:
            return body, verdict
        inject = {**plan.inject, **verdict.inject} if verdict is not None and verdict.inject else plan.inject
        try:
            forwarded = rewrite(parsed, body, drop=DROP_MEMBERS, set_members=inject)
            if verdict is not None and verdict.inject and len(forwarded) > self.settings.max_body_bytes:
                # the ids would push the body past the size every hop is sized for: send the original
                verdict = Verdict(ORIGINAL, "too_large")
                forwarded = rewrite(parsed, body, drop=DROP_MEMBERS, set_members=plan.inject)
        except BodyError as e:
            raise PickError(Problem.BAD_REQUEST, str(e)) from None
        return forwarded, verdict
