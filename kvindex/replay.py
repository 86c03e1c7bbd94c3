"""The replay protocol of a KV-event subscription: asking a publisher's replay (ROUTER) endpoint for its
buffered batches over a DEALER socket, the rounds a replay takes, the rule that says it is complete, and the
rebuild (rewarm) after a failed one.

* **warm-up** (`warm_up`): rebuild the rank from everything the buffer holds, from seq 0;
* **recover** (`recover`): after a gap, replay from the last applied batch itself, so the first reply proves
  (same payload digest) that the publisher still has the history applied;
* **verify** (`verify`): after the SUB socket was recreated (its peer went away), replay from the last applied
  batch: the same payload proves the same process, anything else is a restart (clear and warm up again);
* **rounds** (`replay`): the stream must be contiguous up to the end marker. A hole (frames dropped at the
  publisher's send high-water mark) is asked again from there on a fresh socket while each round makes
  progress (at most :data:`MAX_REPLAY_ROUNDS`); a missing end marker without progress is a timeout, never a
  success;
* **completion**: a replay is complete when a round answers a bare end marker (nothing at or after the seq
  asked), or when its last seq reaches the first live seq minus one (the live stream carries on from there).
  An end marker after batches proves nothing (the send HWM drops the tail of a burst and can let the end
  marker through), so it is followed by another round from the next seq, as many as make progress;
* **waiting**: a reply already in the DEALER socket is read before a timeout is declared (a stalled event loop
  fires the timer late, with the answer long there);
* **rewarm**: a failed replay (not one over its budget) schedules a rebuild from 0 after a delay on the
  house's :class:`~kvindex.backoff.Backoff` (each subscription carries its own); the subscriber's receive
  loop runs it when the timer is due, or at the first live message after it.

The live stream's state changes (apply a batch, clear the rank, note a publisher restart) belong to the
subscriber (`kvindex/subscriber.py`), which hands them in as callables: this module imports no subscriber.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import xxhash
import zmq
import zmq.asyncio

from kvindex.decode import REPLAY_END_SEQ, encode_seq, split_replay_frames
from kvindex.index import KvIndex
from kvindex.subscription import Reset, Subscription

log = logging.getLogger("kvindex.subscriber")  # one logger for the whole subscriber, as operators know it

MAX_REPLAY_ROUNDS = 256  # replays re-asked from a hole (each must make progress) before giving up
# Kept for importers: confirmation rounds are no longer capped by a count (a tail-dropping publisher answers
# every round with batches and an end marker); a replay ends at a bare end marker or at the first live seq.
MAX_REPLAY_CONFIRMS = 8
MAX_REPLAY_GARBAGE = 16  # malformed replay replies tolerated in one replay
REWARM_MIN_S = 1.0  # after a failed replay the rank is rebuilt from 0 again after this long, doubling per failure
REWARM_MAX_S = 60.0


class _ReplayFailed(Exception):
    """Internal: a replay timed out, overran its budget or kept sending garbage.  ``retry``: worth asking
    again later (a budget overrun is not: the buffer would overrun it again)."""

    def __init__(self, why: str, retry: bool = True) -> None:
        super().__init__(why)
        self.retry = retry


class Replayer:
    """Runs replays for the subscriptions of one manager (their DEALER sockets come from its context)."""

    def __init__(self, ctx: zmq.asyncio.Context, idx: KvIndex, *,
                 apply: Callable[[Subscription, int, bytes], None], clear: Callable[[Subscription], None],
                 restart: Callable[[Subscription, str, int | None], None], replay_timeout_s: float, replay_max_batches: int,
                 max_batch_bytes: int, max_replay_bytes: int, turn_budget_s: float,
                 peek: Callable[[Subscription], int | None] | None = None) -> None:
        """``peek(sub)``: the seq of the next live message, if one is there (read and kept for the receive
        loop), so a replay knows where the live stream starts; None: a replay never learns it that way."""
        self._ctx = ctx
        self._idx = idx
        self._apply = apply
        self._clear = clear
        self._restart = restart
        self._peek = peek or (lambda _sub: None)
        self.replay_timeout_s = replay_timeout_s
        self.replay_max_batches = replay_max_batches
        self.max_batch_bytes = max_batch_bytes
        self.max_replay_bytes = max_replay_bytes
        self.turn_budget_s = turn_budget_s

    async def recover(self, sub: Subscription, applied: int, live: int | None = None) -> None:
        """Gap after ``applied``: replay from ``applied`` itself, so the first reply proves (same digest) that
        the publisher still has the history we applied; otherwise the rank lost state and is warmed again.
        ``live``: the seq of the live message that showed the gap (the replay must reach the one before it)."""
        digest = sub.digest
        first: list[int] = []

        def check(seq: int, payload: bytes) -> bool:
            if not first:
                first.append(seq)
                if seq == applied:
                    if xxhash.xxh3_64_intdigest(payload) != digest:
                        raise _Restarted
                    return False  # already applied: only the proof
                if seq > applied + 1:
                    sub.stats.replay_lost += 1
                    log.warning("kv replay from %s starts at %d: batches %d..%d are gone, rank cleared",
                                sub.label, seq, applied + 1, seq - 1)
                    self._clear(sub)
                    sub.applied = seq - 1
            return True

        try:
            ok = await self.replay(sub, applied, check, until=live)
        except _Restarted:
            self._restart(sub, f"replayed batch {applied} differs from the one applied", live)
            await self.warm_up(sub)
            return
        if not ok:
            self._clear(sub)
        elif not first:
            sub.stats.replay_lost += 1
            self._clear(sub)

    async def verify(self, sub: Subscription) -> None:
        """The SUB socket was recreated (its peer went away): a restarted engine's first batches may have been
        lost meanwhile, and an idle one sends nothing more, so ask the replay endpoint from the last applied
        batch.  The same payload at that seq proves the same process (the rest fills what the reconnect lost);
        anything else (another payload, a buffer that no longer starts there) means the history applied is a
        dead process's: clear it and rebuild from 0.  No answer: the rebuild on the rewarm timer replaces it."""
        applied = sub.applied
        if applied is None:
            return
        digest = sub.digest
        same: list[bool] = []

        def check(seq: int, payload: bytes) -> bool:
            if seq != applied or xxhash.xxh3_64_intdigest(payload) != digest:
                raise _Restarted
            same.append(True)
            return False

        try:
            if not await self.replay(sub, applied, check) and sub.rewarm_at is not None:
                return  # no answer (an engine still starting): the rebuild from 0 on the rewarm timer decides
        except _Restarted:
            pass
        else:
            if same:
                return
        # the receive loop warms the rank up from 0 next (the reset asks for it)
        # no live seq of the new process is in hand: the dead one's is no bound for the next restart check
        self._restart(sub, f"after a reconnect the replay no longer holds batch {applied} as applied", None)

    async def warm_up(self, sub: Subscription, recheck: bool = True, keep: bool = False,
                      live: int | None = None) -> None:
        """Rebuild the rank from everything the publisher's replay buffer still holds: on connect, restart or
        reset (the rank is empty), or after an earlier replay failed (``keep``: what the rank holds stays
        until the publisher answers, which may still be down; its first reply clears it, then the whole
        buffer is applied in order and the live stream goes on from its end).

        A warm-up that applies nothing (a fresh engine's empty buffer, or a replay that failed) is asked once
        more at the first live message (``recheck``): ZeroMQ registers a SUB at the PUB asynchronously, so a
        batch published just after the warm-up's answer can be lost on the wire with no gap to show it.
        ``live``: the seq of a live message in hand (the replay must reach the one before it).  A rebuild that
        kept the rank and is answered with an empty buffer clears it: the publisher holds no history."""
        sub.need_warm = False
        sub.recheck = False
        sub.rewarm_at = None  # a failure below schedules the next one
        cleared = not keep
        if not keep:
            sub.applied = None

        def accept(seq: int, payload: bytes) -> bool:
            nonlocal cleared
            if not cleared:
                cleared = True
                self._clear(sub)
                sub.applied = None
            return True

        if await self.replay(sub, 0, accept, until=live):
            sub.rewarm.succeeded()
            if not cleared:
                self._clear(sub)
                sub.applied = None
        elif cleared:
            self._clear(sub)  # none or part of the buffer came: the live stream starts the history again
            sub.applied = None
        sub.recheck = recheck and sub.applied is None

    async def replay(self, sub: Subscription, start: int, accept: Callable[[int, bytes], bool],
                     until: int | None = None) -> bool:
        """Ask for every buffered batch with seq >= ``start`` and apply them as they arrive, contiguously.

        A hole (frames dropped at the publisher's send HWM), or a timeout after progress (the end marker is
        dropped too), stops applying and the replay is asked again from there on a fresh socket, as long as each
        round makes progress, at most :data:`MAX_REPLAY_ROUNDS` times, within one batch/byte budget.  ``accept(seq, payload)`` sees each
        first reply (False: do not apply it).  ``until``: the first live seq, if known (otherwise the SUB is
        peeked for one between rounds).  True when the stream is contiguous up to a bare end marker or up to
        ``until - 1``; False
        after a failure (counted), with whatever contiguous prefix was applied kept.  Raises :class:`Reset` if
        the subscription was reset meanwhile."""
        st = sub.stats
        gen = sub.gen
        ask = start
        spent = [0, 0]  # batches and bytes received over every round: the budget is per replay
        for rnd in range(MAX_REPLAY_ROUNDS):
            st.replays += 1
            try:
                hole = await self._round(sub, ask, rnd == 0, accept, gen, spent)
            except _ReplayFailed as exc:
                st.replay_failures += 1
                log.warning("kv replay from %s (%s) failed: %s%s", sub.label, sub.source.replay_endpoint, exc,
                            self.schedule_rewarm(sub) if exc.retry else "")
                return False
            if hole is None:
                st.replay_ok += 1
                return True
            if isinstance(hole, _Confirm):
                # the end marker came after batches: a tail dropped at the send HWM looks just like that, so
                # the replay is complete only once it reaches the live stream (its first seq minus one), or
                # when a round from the next seq answers a bare end marker.  A publisher busy enough to answer
                # every round with new batches publishes them live too: the live stream takes over.
                if until is None:
                    until = self._peek(sub)
                if int(hole) == ask or (until is not None and int(hole) >= until):
                    st.replay_ok += 1
                    return True
                ask = int(hole)
                continue
            if rnd and hole == ask:
                st.replay_failures += 1
                log.warning("kv replay from %s made no progress past seq %d: rank cleared%s", sub.label, hole,
                            self.schedule_rewarm(sub))
                return False
            st.replay_holes += 1
            (log.warning if rnd == 0 else log.debug)(
                "kv replay from %s has a hole at seq %d (frames dropped by the publisher): asking again from "
                "there", sub.label, hole)
            ask = hole
        st.replay_failures += 1
        log.warning("kv replay from %s still had holes after %d rounds: rank cleared%s", sub.label,
                    MAX_REPLAY_ROUNDS, self.schedule_rewarm(sub))
        return False

    def schedule_rewarm(self, sub: Subscription) -> str:
        """A replay failed, so the rank misses whatever it was to bring: rebuild it from 0 later, backing off
        (a dead replay endpoint stalls the subscription ``replay_timeout_s`` per attempt).  Returns the words
        for the log line."""
        delay = sub.rewarm.failed()
        sub.rewarm_at = time.monotonic() + delay
        return f"; rebuilding from the replay buffer again in {delay:.1f}s"

    async def _round(
        self, sub: Subscription, ask: int, initial: bool, accept: Callable[[int, bytes], bool], gen: int, spent: list[int]
    ) -> int | None:
        """One replay request; returns the seq of the first hole, a :class:`_Confirm` of the next seq when the
        end marker followed batches (the tail may have been dropped), or None for a bare end marker.
        The first round lets ``accept`` judge its first reply (where the buffer starts); a round re-asked from
        a hole must start exactly there."""
        expected = ask
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_batch_bytes + 4096)
        first_reply = True
        garbage = 0
        received = 0
        turn = time.perf_counter()
        try:
            dealer.connect(sub.source.replay_endpoint)  # type: ignore[arg-type]
            await dealer.send_multipart([b"", encode_seq(ask)])
            while True:
                try:
                    frames = await self._recv_reply(dealer)
                except zmq.ZMQError as exc:
                    raise _ReplayFailed(repr(exc)) from None
                if frames is None:
                    if sub.gen != gen:
                        raise Reset
                    if received:
                        # the end marker is the frame a full send HWM drops first: ask again from where the
                        # contiguous part ended (a re-ask past the newest batch answers the end marker alone)
                        return expected
                    raise _ReplayFailed("no end marker within the timeout")
                if sub.gen != gen:
                    raise Reset
                parsed = split_replay_frames(frames)
                if parsed is None:
                    self._idx.count_garbage_frames(sub.worker_id)
                    garbage += 1
                    if garbage > MAX_REPLAY_GARBAGE:
                        raise _ReplayFailed("too many malformed replies")
                    continue
                seq, payload = parsed
                if seq == REPLAY_END_SEQ:
                    return _Confirm(expected) if received else None
                received += 1
                spent[0] += 1
                spent[1] += len(payload)
                if spent[0] > self.replay_max_batches or spent[1] > self.max_replay_bytes:
                    sub.stats.oversized += 1
                    raise _ReplayFailed("replay over its batch/byte budget", retry=False)
                if first_reply:
                    first_reply = False
                    if initial:
                        expected = seq + 1
                        if not accept(seq, payload):
                            continue
                    elif seq != expected:
                        # a send-HWM drop never takes the first frame of a burst: the batch is gone for good
                        sub.stats.replay_lost += 1
                        log.warning("kv replay from %s no longer holds batch %d: rank cleared", sub.label, expected)
                        self._clear(sub)
                        sub.applied = seq - 1
                elif seq < expected:
                    continue  # a duplicate
                elif seq > expected:
                    return expected  # a hole: ask again from it on a fresh socket (the rest goes nowhere)
                expected = seq + 1
                if sub.applied is None or seq > sub.applied:
                    self._apply(sub, seq, payload)
                now = time.perf_counter()
                if now - turn > self.turn_budget_s:
                    await asyncio.sleep(0)
                    turn = time.perf_counter()
                    if sub.gen != gen:
                        raise Reset
        finally:
            dealer.close(linger=0)

    async def _recv_reply(self, dealer: zmq.asyncio.Socket) -> list[bytes] | None:
        """The next reply, or None after ``replay_timeout_s`` without one.  What is already in the socket is
        read first, before any deadline is looked at: an event loop stalled past the timeout (a flood, a long
        decision, a slow file parse) wakes with the timer due and the answer long there.  Waiting is a poll,
        never a cancelled receive, so a timeout cannot swallow a reply that arrived in the same instant."""
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            try:
                return await dealer.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await dealer.poll(timeout=max(1, int(left * 1000)), flags=zmq.POLLIN)


class _Confirm(int):
    """Internal: the seq to ask from to prove that a replay's end marker was not preceded by a dropped tail."""


class _Restarted(Exception):
    """Internal: the replayed history differs from the one applied (another process)."""
