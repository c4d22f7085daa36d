"""The replica claim of a shard and the coordinator's judgement of a version's claims (asymstore.format.replicas)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asymstore.format.replicas import REPLICAS_KEY, ReplicaClaim, claim_of, is_sliced, refusal

digests = st.text(alphabet="0123456789abcdef", min_size=1, max_size=16)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)


@given(world=st.integers(2, 1 << 20), digest=digests, full=st.booleans())
def test_a_claim_round_trips(world: int, digest: str, full: bool) -> None:
    claim = ReplicaClaim(world, digest, full)
    assert claim_of({REPLICAS_KEY: claim.to_json()}) == claim


@given(doc=json_values)
def test_a_malformed_claim_is_a_value_error_never_a_claim(doc: Any) -> None:
    try:
        claim = ReplicaClaim.from_json(doc)
    except ValueError:
        return
    assert {k: doc[k] for k in claim.to_json()} == claim.to_json()  # only a well-formed claim parses


@pytest.mark.parametrize("doc", [
    {"format": 1, "mode": "slices", "world": 1, "digest": "ab", "full": True},  # one rank: nothing to slice
    {"format": 1, "mode": "slices", "world": True, "digest": "ab", "full": True},
    {"format": 1, "mode": "slices", "world": 2, "digest": "AB", "full": True},
    {"format": 1, "mode": "slices", "world": 2, "digest": "ab", "full": 1},
    {"format": 2, "mode": "slices", "world": 2, "digest": "ab", "full": True},
    {"format": 1, "mode": "whole", "world": 2, "digest": "ab", "full": True},
])
def test_claims_out_of_the_format_are_refused(doc: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ReplicaClaim.from_json(doc)


@given(world=st.integers(2, 8), digest=digests, full=st.booleans(), data=st.data())
def test_refusal_publishes_only_whole_copies_or_slices_of_one_state(world: int, digest: str, full: bool,
                                                                    data: st.DataObject) -> None:
    same = {REPLICAS_KEY: ReplicaClaim(world, digest, full).to_json()}
    assert refusal([{}] * world, world) is None
    assert refusal([{}] * world, world, whole_only=True) is None
    assert refusal([same] * world, world) is None
    assert not is_sliced([{}] * world) and is_sliced([same] * world)
    assert refusal([same] * world, world, whole_only=True) is not None  # the job fell back: slices refused
    rank = data.draw(st.integers(0, world - 1))
    other = data.draw(digests.filter(lambda d: d != digest))
    differ = [same] * world
    differ[rank] = {REPLICAS_KEY: ReplicaClaim(world, other, full).to_json()}
    why = refusal(differ, world)
    assert why is not None and "differ" in why
    mixed = [same] * world
    mixed[rank] = {}
    assert refusal(mixed, world) is not None
    assert refusal([{REPLICAS_KEY: ReplicaClaim(world + 1, digest, full).to_json()}] * world, world) is not None
    bad = [same] * world
    bad[rank] = {REPLICAS_KEY: {"format": 1, "mode": "slices"}}
    assert refusal(bad, world) is not None and is_sliced(bad)
