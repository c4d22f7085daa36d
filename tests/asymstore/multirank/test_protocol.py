"""The multi-rank protocol's payloads and rounds (asymstore.multirank.protocol).

Every payload round-trips through its wire JSON; the wire stays what the hand-written keys and
JSON were (a job of the previous release and this one read each other's values); anything a peer
puts that is not a payload (not JSON, too large, another shape or type) raises the typed
CoordinationProtocolError within bounded time; and through real RankStores over a c10d HashStore,
a hostile peer's report fails the global commit on every rank, typed, leaving the previous version.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asymstore.dist.kv import KV, MemoryStore
from asymstore.errors import (
    CoordinationProtocolError,
    CorruptVersionError,
    GlobalCommitError,
    GlobalVersionDroppedError,
    NoCheckpointError,
)
from asymstore.format.globalmanifest import GlobalManifest, ShardInfo
from asymstore.format.placement import RankPlacement, TierPlace
from asymstore.multirank import protocol
from asymstore.multirank.globaldir import list_global_steps
from asymstore.multirank.protocol import (
    Agreement,
    CommitRound,
    Fit,
    Flushed,
    GlobalAnswer,
    Go,
    Have,
    LoadResult,
    NodeCandidate,
    Relayed,
    RestoreRound,
    RetainSet,
    ShardReport,
    TryMsg,
    Verdict,
    Wire,
    decode,
    encode,
)
from tests.support.ranks import run_ranks, store

steps = st.integers(min_value=0, max_value=2**62)
text = st.text(max_size=40)
json_leaf = (st.none() | st.booleans() | st.integers(-2**53, 2**53)
             | st.floats(allow_nan=False, allow_infinity=False) | text)
json_value = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(text, kids, max_size=4),
                          max_leaves=12)
summaries = st.dictionaries(text, json_value, max_size=3)
infos = st.builds(ShardInfo, rank=st.integers(0, 4096), step=steps, digest=st.text("0123456789abcdef", min_size=1),
                  nbytes=steps, tensors=st.integers(0, 10**6), summary=summaries)
placements = st.builds(RankPlacement, rank=st.integers(0, 4096), host=st.text(max_size=30),
                       tiers=st.lists(st.builds(TierPlace, name=st.text(min_size=1, max_size=10),
                                                kind=st.sampled_from(["memory", "local"]),
                                                location=st.none() | st.just("/nvme/job/rank-00001"),
                                                holds=st.integers(0, 4096)), max_size=3).map(tuple))
relays = st.builds(Relayed, error=st.sampled_from(["NoCheckpointError", "CorruptVersionError", "KeyError"]),
                   message=text)


@st.composite
def manifests(draw: st.DrawFn) -> GlobalManifest:
    world = draw(st.integers(1, 4))
    shards = tuple(ShardInfo(r, draw(steps), "ab" * 8, 10, 1, {}) for r in range(world))
    return GlobalManifest(draw(steps), world, shards, draw(summaries), 1.5, draw(st.none() | st.just("0" * 16)))


@st.composite
def node_candidates(draw: st.DrawFn) -> NodeCandidate:
    world = draw(st.integers(1, 64))
    first = draw(st.integers(0, world - 1))
    last = draw(st.integers(first, world - 1))
    shards = tuple(ShardInfo(r, draw(steps), "ab" * 8, draw(steps), draw(st.integers(0, 10**6)), draw(summaries))
                   for r in range(first, last + 1))
    return NodeCandidate(draw(steps), world, draw(st.text("0123456789abcdef", min_size=16, max_size=16)), shards)


PAYLOADS: dict[type[Any], st.SearchStrategy[Any]] = {
    Relayed: relays,
    Agreement: st.builds(Agreement, step=steps, floor=st.integers(-1, 2**62), nonce=st.integers(1, 2**62)),
    ShardReport: st.builds(ShardReport, info=infos, placement=st.none() | placements)
    | st.builds(ShardReport, failed=text) | st.builds(ShardReport, dropped=st.text(max_size=protocol.REASON_CHARS)),
    GlobalAnswer: st.builds(GlobalAnswer, step=steps) | st.builds(GlobalAnswer, failed=text, dropped=st.booleans()),
    Flushed: st.builds(Flushed, st.builds(GlobalAnswer, step=steps) | st.builds(GlobalAnswer, failed=text)),
    Have: st.builds(Have, st.lists(steps, max_size=8).map(tuple)),
    TryMsg: st.builds(TryMsg, candidate=manifests()) | st.builds(TryMsg, node=node_candidates())
    | st.builds(TryMsg, error=relays)
    | st.builds(TryMsg, done=steps, notes=st.lists(text, max_size=3).map(tuple)),
    Fit: st.builds(Fit, ok=st.booleans(), reason=text),
    Go: st.builds(Go, error=st.none() | relays),
    LoadResult: st.builds(LoadResult, ok=st.booleans(), reason=text, refused=st.booleans()),
    Verdict: st.builds(Verdict, pending=st.booleans(), found=text, newest=st.none() | steps,
                       error=st.none() | st.tuples(text, text)),
    RetainSet: st.builds(RetainSet, st.dictionaries(st.integers(0, 4096), st.lists(steps, min_size=1, max_size=4)
                                                    .map(tuple), max_size=4)),
}


def test_every_payload_of_the_protocol_has_a_strategy_here() -> None:
    assert set(PAYLOADS) == set(protocol.PAYLOADS)


@pytest.mark.parametrize("kind", list(PAYLOADS), ids=lambda k: k.__name__)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_payload_round_trips_through_its_wire_json(kind: type[Any], data: st.DataObject) -> None:
    payload = data.draw(PAYLOADS[kind])
    wire = encode(payload)
    assert decode(wire, kind, "k") == payload
    assert decode(wire.encode(), kind, "k") == payload  # bytes, as the c10d store returns them


@pytest.mark.parametrize("kind", list(PAYLOADS), ids=lambda k: k.__name__)
@settings(max_examples=150, deadline=None)
@given(doc=json_value)
def test_any_json_a_peer_puts_is_a_payload_or_the_typed_error(kind: type[Any], doc: Any) -> None:
    try:
        got = decode(json.dumps(doc), kind, "s1/some/key")
    except CoordinationProtocolError as exc:
        assert "s1/some/key" in str(exc)
    else:  # whatever it accepted, it writes back as a payload of its kind
        assert isinstance(got, kind)
        assert decode(encode(got), kind, "k") == got


def test_the_wire_is_the_json_of_the_previous_release() -> None:
    info = ShardInfo(1, 7, "ab", 10, 2, {"files": ["a"]})
    assert json.loads(encode(ShardReport(info))) == {"rank": 1, "step": 7, "digest": "ab", "nbytes": 10,
                                                      "tensors": 2, "summary": {"files": ["a"]}}
    assert json.loads(encode(ShardReport(dropped="x" * 900))) == {"dropped": "x" * 500}
    assert json.loads(encode(GlobalAnswer(failed="f", dropped=True))) == {"failed": "f", "dropped": True}
    assert json.loads(encode(GlobalAnswer(step=3))) == {"step": 3}
    assert json.loads(encode(Go())) == {"go": True}
    assert json.loads(encode(LoadResult(False, "r", True))) == {"ok": False, "reason": "r", "refused": True}
    assert json.loads(encode(LoadResult(True))) == {"ok": True, "reason": ""}
    assert json.loads(encode(Have((3, 5)))) == [3, 5]
    assert json.loads(encode(RetainSet({0: (1, 2), 1: ()}))) == {"ranks": {"0": [1, 2]}}
    rnd = CommitRound.of(KV(MemoryStore()), 2, protocol.commit_tag(5, 9), 3)
    assert (rnd.report_key(1), rnd.answer_key, rnd.flushed_key(2)) == \
        ("s2/commit/5.9/rank/1", "s2/commit/5.9/global", "s2/commit/5.9/flushed/2")
    restore = RestoreRound.of(KV(MemoryStore()), protocol.round_key(2, "restore", 0), 3)
    assert restore.key("fit", 4, 1) == "s2/restore/0/fit/4/1"
    assert protocol.layout_key(2) == "s2/layout" and protocol.session_counter(1) == "session/1"


@pytest.mark.parametrize(("kind", "raw"), [
    (ShardReport, b"\xff\xfe not utf-8"),
    (ShardReport, b'{"rank": 1, "step": NaN, "digest": "a"}'),
    (ShardReport, b'{"rank": "1", "step": 3, "digest": "a"}'),
    (ShardReport, b'{"rank": 1, "step": 3.5, "digest": "a"}'),
    (ShardReport, b'{"rank": 1, "step": 3, "digest": 4}'),
    (ShardReport, b'{"rank": 1, "step": 3, "digest": "a", "summary": "files"}'),
    (ShardReport, b'{"rank": -1, "step": 3, "digest": "a"}'),
    (ShardReport, b'{"dropped": 7}'),
    (ShardReport, b'[1, 2]'),
    (GlobalAnswer, b'{"step": true}'),
    (GlobalAnswer, b'{}'),
    (Agreement, b'{"step": 1, "floor": -2, "nonce": 1}'),
    (Have, b'[1, "2"]'),
    (Fit, b'{"ok": "yes", "reason": ""}'),
    (Go, b'{"go": false}'),
    (TryMsg, b'{"global": "{\\"format\\": \\"nope\\"}"}'),
    (TryMsg, b'{"done": 3, "notes": "not a list"}'),
    # a node's candidate: strictly typed, consecutive ranks within its world, a digest of 16 hex digits
    (TryMsg, b'{"node": {"step": 3, "world_size": 4, "digest": "0123456789abcdef", "shards": []}}'),
    (TryMsg, b'{"node": {"step": 3, "world_size": 4, "digest": "0123456789abcdef", "shards": {}}}'),
    (TryMsg, b'{"node": {"step": 3, "world_size": 4, "digest": "0123456789abcdef", "shards": ['
             b'{"rank": 0, "step": 3, "digest": "a"}, {"rank": 2, "step": 3, "digest": "a"}]}}'),
    (TryMsg, b'{"node": {"step": 3, "world_size": 2, "digest": "0123456789abcdef", "shards": ['
             b'{"rank": 1, "step": 3, "digest": "a"}, {"rank": 2, "step": 3, "digest": "a"}]}}'),
    (TryMsg, b'{"node": {"step": 3, "world_size": 4, "digest": "0123456789abcdef", "shards": ['
             b'{"rank": "1", "step": 3, "digest": "a"}]}}'),
    (TryMsg, b'{"node": {"step": 3, "world_size": 4, "digest": "0123456789abcdef", "shards": ['
             b'{"rank": 1, "step": true, "digest": "a"}]}}'),
    (TryMsg, b'{"node": {"step": 3, "world_size": 4, "digest": "0123456789abcdef", "shards": ['
             b'{"rank": 1, "step": 3, "digest": "a", "nbytes": 1.5}]}}'),
    (TryMsg, b'{"node": {"step": 3, "world_size": 4, "digest": "0123456789ABCDEF", "shards": ['
             b'{"rank": 1, "step": 3, "digest": "a"}]}}'),
    (TryMsg, b'{"node": {"step": 3, "world_size": 0, "digest": "0123456789abcdef", "shards": ['
             b'{"rank": 0, "step": 3, "digest": "a"}]}}'),
    (TryMsg, b'{"node": {"step": -3, "world_size": 4, "digest": "0123456789abcdef", "shards": ['
             b'{"rank": 0, "step": 3, "digest": "a"}]}}'),
    (TryMsg, b'{"node": {"step": 3, "world_size": 4, "digest": "0123456789abcdef", "shards": ['
             b'{"rank": 0, "step": NaN, "digest": "a"}]}}'),
    (TryMsg, b'{"node": [1, 2]}'),
    (Verdict, b'{"pending": true, "found": "x", "newest": null, "error": ["only one"]}'),
    (RetainSet, b'{"ranks": {"zero": [1]}}'),
    (LoadResult, b'{"ok": true, "reason": "", "refused": 1}'),
])
def test_a_malformed_payload_from_a_peer_is_the_typed_error(kind: type[Any], raw: bytes) -> None:
    with pytest.raises(CoordinationProtocolError, match="s1/k"):
        decode(raw, kind, "s1/k")


def test_an_oversized_or_deeply_nested_payload_is_refused_in_bounded_time() -> None:
    big = b'{"failed": "' + b"x" * protocol.MAX_PAYLOAD_BYTES + b'"}'
    started = time.monotonic()
    with pytest.raises(CoordinationProtocolError, match="exceeds"):
        decode(big, GlobalAnswer, "k")
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(CoordinationProtocolError, match="not strict JSON"):
        decode(deep, Have, "k")
    assert time.monotonic() - started < 30  # refused before parsing, or by the parser's own depth bound


def test_a_malformed_placement_is_not_recorded_but_the_report_reads() -> None:
    doc = ShardReport(ShardInfo(0, 1, "ab")).to_json() | {"placement": {"rank": "zero", "tiers": []}}
    got = decode(json.dumps(doc), ShardReport, "k")
    assert got.info == ShardInfo(0, 1, "ab") and got.placement is None and got.placement_error


def test_a_payload_that_is_not_one_kind_is_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        ShardReport()
    with pytest.raises(ValueError):
        GlobalAnswer(step=1, failed="x")
    with pytest.raises(ValueError):
        TryMsg()


def test_a_dropped_answer_raises_the_dropped_error_and_a_failed_one_the_commit_error() -> None:
    with pytest.raises(GlobalVersionDroppedError, match="gone"):
        GlobalAnswer(failed="gone", dropped=True).raise_failure()
    with pytest.raises(GlobalCommitError, match="bad") as info:
        GlobalAnswer(failed="bad").raise_failure()
    assert not isinstance(info.value, GlobalVersionDroppedError)
    GlobalAnswer(step=1).raise_failure()  # published: nothing


def value(step: int, rank: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + 10 * step + rank


def test_a_hostile_peer_report_fails_the_global_commit_on_every_rank_typed(tmp_path: Path) -> None:
    """Rank 1 puts garbage where its shard report goes: the coordinator raises the typed error at once,
    tells the waiting ranks (GlobalCommitError, not a timeout), and the previous global version stays."""
    kv = dist.HashStore()

    async def good(rank: int) -> None:
        async with store(tmp_path, rank, 2, kv) as s:
            await s.put_many(0, {"w": value(0, rank)})
            await s.commit(0)

    assert all(v is None for v in run_ranks(2, good).values())
    assert list_global_steps(str(tmp_path / "global")) == [0]

    async def second(rank: int) -> Any:
        async with store(tmp_path, rank, 2, kv, timeout_s=20.0) as s:
            await s.put_many(1, {"w": value(1, rank)})
            if rank == 1:  # hostile: its report is no payload (and it waits for the answer as a peer would)
                rnd = CommitRound.of(s.kv, s._session, protocol.commit_tag(1), 2)
                kv.set(rnd.report_key(1), b'{"rank": 1, "step": "1", "digest": 5}')
                started = time.monotonic()
                answer = await asyncio.to_thread(rnd.wait_answer, 20.0, "the answer")
                return answer, time.monotonic() - started
            started = time.monotonic()
            try:
                await s.commit(1)
            except Exception as exc:
                return exc, time.monotonic() - started
            return None, time.monotonic() - started

    out = run_ranks(2, second)
    exc, took = out[0]
    assert isinstance(exc, CoordinationProtocolError), out
    assert "rank/1" in str(exc) and took < 15  # no waiting for the 20 s timeout
    answer, _ = out[1]
    assert answer.failed is not None and "not published" in answer.failed
    with pytest.raises(GlobalCommitError):
        answer.raise_failure()
    assert list_global_steps(str(tmp_path / "global")) == [0]

    async def again(rank: int) -> Any:
        async with store(tmp_path, rank, 2, kv) as s:
            return (await s.restore()).step

    assert run_ranks(2, again) == {0: 0, 1: 0}


def test_a_hostile_coordinator_message_fails_a_followers_restore_typed(tmp_path: Path) -> None:
    """A follower reads a malformed ``try`` (no global manifest in it): the typed error, not a KeyError."""
    kv = KV(MemoryStore())
    rnd = RestoreRound.of(kv, protocol.round_key(1, "restore", 0), 2)
    kv.store.set(rnd.key("try", 0), '{"global": "{not json"}')
    with pytest.raises(CoordinationProtocolError, match="try/0"):
        rnd.wait_try(0, 1.0)
    Wire(kv).put(rnd.key("try", 1), TryMsg(error=Relayed("NoCheckpointError", "none")))
    relayed = rnd.wait_try(1, 1.0).error
    assert relayed is not None and isinstance(relayed.exception(CorruptVersionError), NoCheckpointError)
