"""The same frame sequences fed to h2grpc and to the `h2` library's server-side H2Connection: the connection
error each ends with, the streams each resets, and every stream's state must agree, up to the first frame
where they differ; that frame must be one of the disagreements below, where RFC 9113 decides for h2grpc."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2grpc import codec as c
from tests.h2.peers import Event, Outcome, run_h2, run_h2grpc

SIDS = st.sampled_from([1, 1, 3, 3, 5, 7, 2])


@st.composite
def events(draw: st.DrawFn) -> Event:
    kind = draw(st.sampled_from(["headers", "split_headers", "data", "rst", "window_update", "ping", "settings",
                                 "priority", "unknown", "continuation"]))
    sid = draw(st.sampled_from([0]) if kind in ("ping", "settings") and draw(st.booleans()) else SIDS)
    value = {"data": st.sampled_from([0, 1, 10]), "rst": st.sampled_from([c.NO_ERROR, c.CANCEL]),
             "window_update": st.sampled_from([0, 1, 1000]), "ping": st.sampled_from([8, 8, 7]),
             "settings": st.sampled_from([65_535, 1 << 20, 1 << 31])}.get(kind, st.just(0))
    return Event(kind, sid, draw(st.booleans()), draw(value))


def _known(last: Event, before: list[Event], ours: Outcome, theirs: Outcome) -> str | None:
    """The documented disagreements: which RFC rule h2grpc follows where the h2 library does otherwise."""
    new_ours = [r for r in ours.resets if r not in theirs.resets]
    if last.kind == "continuation" and ours.connection_error == c.PROTOCOL_ERROR:
        # §6.10: a CONTINUATION not preceded by a HEADERS without END_HEADERS is a connection error of type
        # PROTOCOL_ERROR (h2: STREAM_CLOSED when its stream is closed)
        return "naked CONTINUATION"
    opened = max((e.sid for e in before if e.kind in ("headers", "split_headers") and e.sid & 1), default=0)
    if last.kind == "rst" and (not last.sid & 1 or last.sid > opened) and theirs.connection_error is None \
            and ours.connection_error == c.PROTOCOL_ERROR:
        # §6.4 and §5.1 "idle": RST_STREAM on an idle stream (an even id: the server opens none; an odd one
        # above every id opened) is a connection error PROTOCOL_ERROR (h2 ignores it once a stream is open)
        return "RST_STREAM on an idle stream"
    if last.kind == "window_update" and last.value == 0 and last.sid and theirs.connection_error == c.PROTOCOL_ERROR \
            and ours.connection_error is None and new_ours in ([], [(last.sid, c.PROTOCOL_ERROR)]):
        # §6.9: an increment of 0 on a stream is a stream error PROTOCOL_ERROR (h2: a connection error); on a
        # closed stream the frame is ignored (§5.1 "closed", §6.9)
        return "WINDOW_UPDATE of 0 on a stream"
    if last.kind in ("headers", "split_headers") and not last.flag and ours.connection_error is None \
            and theirs.connection_error == c.PROTOCOL_ERROR and new_ours == [(last.sid, c.PROTOCOL_ERROR)]:
        # §8.1: a second HEADERS without END_STREAM makes the request malformed; §8.1.1: a malformed request
        # is a stream error PROTOCOL_ERROR (h2: a connection error)
        return "trailers without END_STREAM"
    reset_before = {sid for sid, _ in ours.resets}
    extra = [r for r in theirs.resets if r not in ours.resets or theirs.resets.count(r) > ours.resets.count(r)]
    if ours.connection_error is None and theirs.connection_error is None and extra \
            and all(sid == last.sid and sid in reset_before for sid, _ in extra) and ours.states == theirs.states:
        # §5.1 "closed": an endpoint MUST ignore frames it receives on closed streams after it has sent a
        # RST_STREAM frame (h2 answers each with another RST_STREAM)
        return "frame on a stream we reset"
    return None


async def _compare(seq: list[Event]) -> str | None:
    for n in range(1, len(seq) + 1):
        ours, theirs = await run_h2grpc(seq[:n]), run_h2(seq[:n])
        if ours != theirs:
            why = _known(seq[n - 1], seq[:n - 1], ours, theirs)
            assert why is not None, f"after {seq[:n]}:\n  h2grpc {ours}\n  h2     {theirs}"
            return why
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events(), min_size=1, max_size=8))
def test_h2grpc_and_the_h2_library_agree_on_stream_states_and_errors_but_where_rfc_9113_decides(seq) -> None:  # noqa: ANN001
    asyncio.run(_compare(seq))


def _run(*seq: Event) -> tuple[Outcome, Outcome]:
    async def both() -> tuple[Outcome, Outcome]:
        return await run_h2grpc(list(seq)), run_h2(list(seq))
    return asyncio.run(both())


def test_both_answer_data_after_end_stream_with_stream_closed() -> None:
    ours, theirs = _run(Event("headers", 1, True), Event("data", 1, False, 1))
    assert ours == theirs and ours.resets == [(1, c.STREAM_CLOSED)] and ours.states == {1: "closed"}


def test_both_refuse_a_stream_id_lower_than_one_opened_with_protocol_error() -> None:
    ours, theirs = _run(Event("headers", 5), Event("headers", 3))
    assert ours.connection_error == theirs.connection_error == c.PROTOCOL_ERROR


def test_every_documented_disagreement_is_reached() -> None:
    """The table above is not dead: each entry is produced by a sequence that shows it."""
    cases = {
        "naked CONTINUATION": [Event("headers", 3), Event("continuation", 1)],
        "RST_STREAM on an idle stream": [Event("headers", 1), Event("rst", 3)],
        "WINDOW_UPDATE of 0 on a stream": [Event("headers", 1), Event("window_update", 1, False, 0)],
        "trailers without END_STREAM": [Event("headers", 1), Event("headers", 1)],
        "frame on a stream we reset": [Event("headers", 1, True), Event("data", 1, False, 1),
                                       Event("data", 1, False, 1)],
    }
    for why, seq in cases.items():
        assert asyncio.run(_compare(seq)) == why
