"""The contract between the decision and what it asks: lookups, predictions and bookings, typed once.

Four kinds of work reshape these (images, prefill/decode pools, ingest in another process, routing that
learns): they extend the types below instead of re-plumbing the pipeline. Read this file before changing how
a prompt is looked up, credited or booked; `docs/architecture.md` tells the same story with the request path.

Lookup
    A prompt is looked up as its token ids plus a `PromptIdentity`: everything other than the tokens that the
    engines hash into a block's key. Two prompts share a block only when both agree. Today that is the cache
    salt (vLLM: the first block's extra key; TensorRT-LLM: refused or routed by load, see core/salt.py) and the
    LoRA adapter (hashed by every engine; the KV side decides whether `model` names an adapter some worker
    serves). `media` carries the multimodal items the render reported (identity and placeholder span), for
    the index to key image blocks the way each engine does; an empty tuple means a text-only prompt.

    Media keying (kvindex/hashing.py; docs/multimodal-kv.md has the per-engine table). A block that media items
    overlap is keyed by its tokens AND the items' keys exactly as the engine keys it: the same image at the same
    place in the same prompt is the same block; another image, or the same image elsewhere, is not. Engines and
    versions key items differently (a "dialect": vLLM 0.32 `(identifier, offset)` pairs, older vLLM the bare
    identifier, TensorRT-LLM its `mm_keys`), so the request side keys a prompt per worker in that worker's
    dialect, learned from the worker's own events (`kvindex.index.KvIndex.media_dialect`; the default, vLLM's,
    until a worker published a media block, which is also when it first holds one). Candidates are grouped by
    (block size, dialect): one chain per group, O(prompt blocks + items) each, so a pool of one engine version
    costs one chain as before. The index stores nothing new per entry (a block is still one u64 key and one
    bitmask; a worker stores its dialect once). A prompt without media takes exactly the text-only path. The
    TensorRT-LLM dialect cannot be rebuilt from a request (its media blocks' token ids are engine-internal and
    its render refuses media): such a prompt's chain stops at its first media block, so the text before the
    image is credited and nothing after it.

    `KvLookup.prompt()` packs and hashes once per block size (`PromptKey`); `overlap()` answers, per
    candidate worker, how many leading blocks of that key the worker holds: stored blocks (confirmed by its
    own KV events) and predicted ones alike, because both mean "send it there and the prefix is reused".
    `credit()` splits the same figure into confirmed and predicted for `/debug/score` and metrics; it is not
    on the request path. Candidates come in already narrowed (subset hint, role): a lookup never widens them.
    Cost: O(prompt blocks) per distinct block size, stopping at the first block no candidate holds.

Prediction
    When a request is committed to a worker, the prompt's blocks are predicted there (`KvLookup.predict`): the
    index credits them to that worker as if stored, so a burst of requests sharing a prefix follows the first
    one instead of spreading over cold workers. A predicted block ends in exactly one of three ways:
      - confirmed: the worker's events store that block; from then on it is engine credit, and the worker's own
        removal event is what ends it;
      - cancelled: the worker's events remove that block, the worker is cleared (restart, replay rebuild) or
        leaves the pool;
      - expired: not confirmed within its lifetime: `--prediction-ttl-s` (`--prediction-lifetime fixed`), or,
        with `--prediction-lifetime queue`, as long as the booking named in `predict` has not finished its
        prefill on that worker, plus `--prediction-grace-s`, at most `--prediction-max-lifetime-s`
        (docs/predictions.md). Peers and predictions without a booking keep the fixed ttl.
    Replica sync shares predictions with the peers (`predict_listeners`), so replicas credit each other's.

Booking
    A committed request books load on its worker (`Bookings.book`) under a picker-minted id, which the edge
    hands to Envoy (`envoy.lb` metadata) and lean mode's signals name later. A booking holds prefill blocks
    (only what the request must compute: prompt blocks minus the credited overlap) and decode blocks. The
    prefill part ends at the first non-empty response chunk (`prefill_done`, or lean mode's first-chunk
    signal); the rest ends when the request's stream ends, however it ends (`free`, called exactly once by
    the exchange's `close`). `move` follows a gateway fallback to the endpoint that really served. A booking
    can never outlive its stream: `close()` is the exchange's single exit. Peers' bookings are held per peer
    and end when the peer reports them freed or is dropped.

Roles
    A worker serves `Role.BOTH` (aggregated, the default), `PREFILL` or `DECODE`. A pool with no prefill
    workers behaves as an aggregated one. A disaggregated decision holds one booking per leg: the prefill
    worker's holds only prefill blocks and ends when the context phase ends; the decode worker's holds the
    decode blocks and ends with the request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class Role(StrEnum):
    """What part of a request a worker serves."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One multimodal item of a prompt, as the engine keys the blocks it covers.

    `identifier` is the item's identity as the engine hashes it (a content digest or a trusted caller UUID,
    never a URL); `offset` and `length` are its placeholder tokens' span in the rendered prompt, as the render
    reported them (never guessed from a placeholder token: their count depends on the image's size).
    """

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class PromptIdentity:
    """Everything besides the token ids that makes two prompts' KV blocks the same blocks."""

    salt: str | None = None  # the request's cache salt (tenant isolation)
    model: str | None = None  # the request's `model`: a LoRA adapter is hashed in when a worker serves it
    media: tuple[MediaItem, ...] = ()  # multimodal items with their spans, in prompt order


NO_IDENTITY = PromptIdentity()  # a text-only prompt with no salt, for the base model


@dataclass(frozen=True, slots=True)
class Credit:
    """A worker's leading blocks of one prompt, split by where the knowledge came from."""

    confirmed: int  # blocks the worker's own KV events say it stores
    predicted: int  # further leading blocks credited because this picker (or a peer) sent the prompt there

    @property
    def blocks(self) -> int:
        return self.confirmed + self.predicted


def split_credit(total: Mapping[str, int], confirmed: Mapping[str, int]) -> dict[str, Credit]:
    """`KvLookup.credit` from two overlaps of one prompt: with predictions (`total`) and without (`confirmed`)."""
    return {w: Credit(confirmed.get(w, 0), n - confirmed.get(w, 0)) for w, n in total.items()}


class PromptKey(Protocol):
    """A rendered prompt, packed and hashed the way the engines hash it (once per block size)."""

    def __len__(self) -> int: ...

    def hashes(self, block_size: int, dialect: str | None = None) -> list[int]:
        """The chained block hashes in `block_size`; `dialect` (kvindex.hashing DIALECT_*, None: the default)
        only matters for a prompt with media, whose media blocks each engine version keys its own way."""
        ...


class KvLookup(Protocol):
    """What the decision asks of the KV index (implemented by adapters/kv_routing.KvRouting in this process and
    adapters/kv_remote.RemoteKv with ingest apart; both hash prompts with adapters/worker_facts.WorkerFacts)."""

    def prompt(self, tokens: Sequence[int], identity: PromptIdentity) -> PromptKey:
        """The prompt as the workers hash it: the identity decides the chain's seed and the media blocks."""
        ...

    def base_model_for(self, model: object) -> str | None:
        """The base model a LoRA adapter is rendered under (renderers know no adapters); None otherwise."""
        ...

    def block_size(self, worker: str) -> int: ...

    def overlap(self, prompt: PromptKey, workers: Sequence[str]) -> Mapping[str, int]:
        """Per candidate, its leading blocks of `prompt`, confirmed and predicted alike; 0s may be omitted."""
        ...

    def credit(self, prompt: PromptKey, workers: Sequence[str]) -> Mapping[str, Credit]:
        """`overlap` split into confirmed and predicted blocks (explanations and metrics, not the hot path)."""
        ...

    def held(self, worker: str) -> int:
        """The worker's predicted blocks kept alive only because a request is still waiting for its prefill
        there (`--prediction-lifetime queue`; 0 otherwise): why a prediction outlives the fixed ttl."""
        ...

    def predict(self, worker: str, prompt: PromptKey, booking: str | None = None) -> None:
        """The prompt was committed to `worker` under `booking` (its id; None: no booking to follow): credit its
        blocks there until events confirm or cancel them, or their lifetime ends."""
        ...


class BookingHandle(Protocol):
    """One request's load on one worker (core/load.Booking); every method is idempotent after `free`."""

    @property
    def id(self) -> str: ...

    @property
    def address(self) -> str: ...

    def prefill_done(self) -> None:
        """The first non-empty response chunk went by (or the context phase ended): prefill load ends."""

    def move(self, address: str) -> None:
        """The gateway served the request elsewhere: the load follows it."""

    def free(self) -> None:
        """The request ended: everything it held ends."""


class Bookings(Protocol):
    """Where bookings are made and found (core/load.LoadTracker)."""

    def book(self, address: str, prompt_blocks: float) -> BookingHandle: ...

    def booking(self, booking_id: str) -> BookingHandle | None:
        """A live booking by id (lean mode's signals name it); None once freed."""
        ...

    def first_chunk_elsewhere(self, booking_id: str) -> bool:
        """Lean mode's first chunk of a booking that is not ours (another replica made it): handed on to that
        replica; False when nobody could take it."""
        ...
