"""The pickle-free state codec: JSON for structure, tensors by name, exact round trips."""

from __future__ import annotations

import enum
import json
import math
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from asymcheck import UnsupportedStateError
from asymcheck.state.encode import decode, encode, register_type
from asymstore.format.manifest import validate_meta, validate_name
from tests.support.asymcheck_train import equal_state


def roundtrip(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    tree = encode(value, "root", tensors)
    text = json.dumps(tree, allow_nan=False)  # strict JSON
    validate_meta({"tree": tree})
    for name in tensors:
        validate_name(name)
    return decode(json.loads(text), tensors), tensors


def test_optimizer_state_dict_roundtrips() -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), betas=(0.9, 0.99))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    back, tensors = roundtrip(sd)
    equal_state(sd, back)
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert set(back["state"]) == {0, 1}  # int keys survive
    assert any(t.data_ptr() == sd["state"][0]["exp_avg"].data_ptr() for t in tensors.values())  # by reference


def test_awkward_values_roundtrip() -> None:
    value = {
        "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "neg0": -0.0, "big": 2**80,
        "bytes": b"\x00\xff", "tuple": (1, (2, "x")), "none": None, "bool": True,
        "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "np": np.arange(6, dtype=np.int32).reshape(2, 3), "npscalar": np.float32(1.5),
        (1, 2): "tuple key", "$weird": 1, "a/b/../c": torch.ones(2),
    }
    back, tensors = roundtrip(value)
    assert math.isnan(back["nan"]) and back["inf"] == math.inf and back["-inf"] == -math.inf
    assert math.copysign(1.0, back["neg0"]) == -1.0
    assert back["big"] == 2**80 and back["bytes"] == b"\x00\xff" and back["tuple"] == (1, (2, "x"))
    assert back["dtype"] is torch.bfloat16 and back["device"] == torch.device("cpu")
    assert back["np"].dtype == np.int32 and (back["np"] == value["np"]).all()
    assert back["npscalar"] == np.float32(1.5) and isinstance(back["npscalar"], np.float32)
    assert back[(1, 2)] == "tuple key" and back["$weird"] == 1
    assert torch.equal(back["a/b/../c"], torch.ones(2))
    assert all(".." not in name.split("/") for name in tensors)


def test_tensor_names_are_unique() -> None:
    tensors: dict[str, torch.Tensor] = {}
    encode({"a b": torch.zeros(1), "a_b": torch.ones(1)}, "x", tensors)
    assert len(tensors) == 2


@pytest.mark.parametrize("value", [object(), {1, 2}, lambda: 0])
def test_values_that_need_pickle_are_refused(value: Any) -> None:
    with pytest.raises(UnsupportedStateError):
        encode({"v": value}, "root", {})


def test_decode_of_a_missing_tensor_is_a_typed_error() -> None:
    with pytest.raises(UnsupportedStateError):
        decode({"$tensor": "nope"}, {})


class _Scaler:
    def __init__(self, scale: float) -> None:
        self.cur_scale = scale
        self.window = (1, 2)


class _Stage(enum.IntEnum):
    weights = 3


def test_sizes_ordered_dicts_and_registered_types_roundtrip_exactly() -> None:
    register_type(_Scaler)
    register_type(_Stage)
    value = {"shapes": [OrderedDict([("b", torch.Size([2, 3])), ("a", torch.Size([]))])],
             "scaler": _Scaler(2.0**16), "stage": _Stage.weights, "t": torch.ones(2)}
    back, _ = roundtrip(value)
    shapes = back["shapes"][0]
    assert type(shapes) is OrderedDict and list(shapes) == ["b", "a"]
    assert type(shapes["b"]) is torch.Size and shapes["b"] == torch.Size([2, 3])
    assert type(back["scaler"]) is _Scaler and back["scaler"].cur_scale == 2.0**16 and back["scaler"].window == (1, 2)
    assert back["stage"] is _Stage.weights


def test_unregistered_types_are_refused_both_ways() -> None:
    class Other:
        pass

    with pytest.raises(UnsupportedStateError):
        encode({"v": Other()}, "root", {})
    with pytest.raises(UnsupportedStateError, match="not registered"):
        decode({"$object": "os.system", "state": {}}, {})
