"""The torchft state record: nested state dicts flatten to tensors plus strict JSON and come back exactly."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asymstore.errors import HealCorruptError, HealProtocolError
from asymstore.torchft.state import MAX_DEPTH, flatten, tensor_name, unflatten

_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=True)
            | st.text(max_size=8))
_tensors = st.builds(lambda n, s: torch.randn(n, generator=torch.Generator().manual_seed(s)),
                     st.integers(0, 5), st.integers(0, 1000))
_keys = st.text(max_size=6) | st.integers(-5, 5)
_states = st.recursive(_scalars | _tensors, lambda kids: st.lists(kids, max_size=4)
                       | st.tuples(kids, kids) | st.dictionaries(_keys, kids, max_size=4), max_leaves=20)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float):
        return isinstance(b, float) and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None)
@given(_states)
def test_roundtrip_through_strict_json(state: Any) -> None:
    skeleton, tensors = flatten(state)
    text = json.dumps(skeleton, allow_nan=False)  # what the version's meta holds
    assert _same(unflatten(json.loads(text), tensors), state)


def test_optimizer_state_dict_roundtrip() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    skeleton, tensors = flatten(sd)
    back = unflatten(json.loads(json.dumps(skeleton, allow_nan=False)), tensors)
    assert back["optim"]["param_groups"] == sd["optim"]["param_groups"]
    assert set(back["optim"]["state"]) == {0, 1}
    opt.load_state_dict(back["optim"])


@pytest.mark.parametrize("value", [object(), torch.float32, {1.5: [b"x"]}, bytearray(b"x")])
def test_no_pickle_free_form_is_refused(value: object) -> None:
    with pytest.raises(HealProtocolError):
        flatten({"user": {"default": value}})


def _deep(n: int) -> Any:
    node: Any = 0
    for _ in range(n):
        node = [node]
    return node


@pytest.mark.parametrize(("skeleton", "names"), [
    ({"$t": 1}, [0]),  # a tensor the version lacks
    ([{"$t": 0}, {"$t": 0}], [0]),  # one tensor twice
    ({"a": 1}, [0]),  # a stored tensor left out
    ({"$t": True}, [0]),
    ({"$tuple": 5}, []),
    ({"$dict": [[[1], 2]]}, []),  # an unhashable key
    ({"$dict": [[{"$tuple": [[1]]}, 2]]}, []),  # a tuple key holding a list
    ({"$float": "1e3"}, []),
    ({"$evil": 1}, []),
    ({"$t": 0, "x": 1}, [0]),
    (_deep(MAX_DEPTH + 2), []),
])
def test_a_malformed_record_is_corrupt(skeleton: Any, names: list[int]) -> None:
    with pytest.raises(HealCorruptError):
        unflatten(skeleton, {tensor_name(i): torch.zeros(1) for i in names})
