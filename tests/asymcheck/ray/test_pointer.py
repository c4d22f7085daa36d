"""asymcheck.ray without a Ray cluster: the pointer file as untrusted input, the refusals, and Ray Train's local mode.

A Ray checkpoint of ``RayCheckpointer`` holds one small JSON file naming a published version. It is read
back as any file on disk is: strict JSON of one exact shape, a regular file of bounded size, every other
input a ``RayPointerError``. Ray Train's local mode (``ScalingConfig(num_workers=0)``: the training function
runs in this process, Ray's ``report`` and ``get_checkpoint`` are real) shows what ``report`` attaches: each
newly published version once, in order, with the numbers reported at its step.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("ray.train")

import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from asymcheck.errors import RayPointerError, UnsupportedRayConfigError
from asymcheck.ray import POINTER_FILE, STEP_METRIC, RayCheckpointer, VersionPointer, read_pointer

numbers = st.floats(allow_nan=False, allow_infinity=False, width=64)
pointers = st.builds(VersionPointer, root=st.text(st.characters(blacklist_characters="\0"), max_size=40).map(
    lambda t: "/" + t), step=st.integers(0, 2**53), world_size=st.integers(1, 2**20),
    metrics=st.dictionaries(st.text(max_size=12), numbers, max_size=4))


@settings(max_examples=50, deadline=None)
@given(pointers)
def test_a_pointer_reads_back_as_written(pointer: VersionPointer) -> None:
    assert VersionPointer.parse(pointer.to_json().encode(), "p") == pointer


GOOD: dict[str, Any] = {"format": 1, "root": "/shared/ckpt", "step": 7, "world_size": 2, "metrics": {"loss": 0.5}}


@pytest.mark.parametrize("raw", [
    b"", b"\xff\xfe", b"[]", b"{", b'{"format": 1}',
    json.dumps({**GOOD, "extra": 1}).encode(),
    json.dumps({**GOOD, "format": 2}).encode(),
    json.dumps({**GOOD, "root": "relative/ckpt"}).encode(),
    json.dumps({**GOOD, "root": "/a\u0000b"}).encode(),
    json.dumps({**GOOD, "step": -1}).encode(),
    json.dumps({**GOOD, "step": True}).encode(),
    json.dumps({**GOOD, "step": 1.5}).encode(),
    json.dumps({**GOOD, "world_size": 0}).encode(),
    json.dumps({**GOOD, "metrics": {"loss": "low"}}).encode(),
    json.dumps({**GOOD, "metrics": [1]}).encode(),
    json.dumps({**GOOD, "metrics": {"loss": math.inf}}).encode(),  # Infinity: not strict JSON
    b'{"format": 1, "root": "/r", "step": NaN, "world_size": 1, "metrics": {}}',
    b"[" * 100_000,  # nesting deeper than the parser goes
])
def test_anything_but_a_pointer_is_refused_typed(raw: bytes) -> None:
    with pytest.raises(RayPointerError, match="not an asymcheck pointer"):
        VersionPointer.parse(raw, "p")


def test_a_pointer_file_is_a_small_regular_file(tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / POINTER_FILE).write_text(json.dumps(GOOD))
    assert read_pointer(tmp_path / "ok") == VersionPointer("/shared/ckpt", 7, 2, {"loss": 0.5})
    with pytest.raises(RayPointerError, match="holds no asymcheck pointer"):
        read_pointer(tmp_path / "missing")
    (tmp_path / "link").mkdir()
    os.symlink(tmp_path / "ok" / POINTER_FILE, tmp_path / "link" / POINTER_FILE)
    with pytest.raises(RayPointerError, match="holds no asymcheck pointer"):  # never followed
        read_pointer(tmp_path / "link")
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / POINTER_FILE).write_bytes(b" " * (64 * 1024 + 1))
    with pytest.raises(RayPointerError, match="at most"):
        read_pointer(tmp_path / "big")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / POINTER_FILE)  # never blocks on it
    with pytest.raises(RayPointerError, match="not a regular file"):
        read_pointer(tmp_path / "fifo")


def test_refused_outside_a_ray_train_worker_before_anything_is_written(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedRayConfigError, match="outside a Ray Train worker"):
        RayCheckpointer(model, optimizer, tmp_path / "ckpt")
    with pytest.raises(UnsupportedRayConfigError, match=r"root 's3://bucket/ckpt' \(a multi-rank root is a directory") \
            as caught:
        RayCheckpointer(model, optimizer, "s3://bucket/ckpt")
    assert "outside a Ray Train worker" in str(caught.value)  # every refused setting at once
    assert not (tmp_path / "ckpt").exists()


def _train(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = config["seen"]
    with RayCheckpointer(model, optimizer, config["root"]) as ckpt:
        seen.append(("resumed", ckpt.resume()))
        for step in range(ckpt.step, config["steps"]):
            model(torch.full((2, 4), float(step))).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            attached = ckpt.report({"loss": float(step + 1), "note": "text goes to Ray only"})
            assert ckpt.check_preemption() is None  # local mode: no preemption watcher
            latest = ray.train.get_checkpoint()
            seen.append(("report", step + 1, attached, None if latest is None else read_pointer(latest)))
    latest = ray.train.get_checkpoint()
    seen.append(("closed", ckpt.step, None if latest is None else read_pointer(latest)))


def test_report_attaches_each_published_version_once_in_local_mode(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    seen: list[Any] = []
    for steps in (4, 6):  # a second run resumes from the store (local mode's Ray holds no checkpoint across runs)
        TorchTrainer(_train, train_loop_config={"root": root, "steps": steps, "seen": seen},
                     scaling_config=ScalingConfig(num_workers=0),
                     run_config=RunConfig(storage_path=str(tmp_path / "ray"), name=f"run{steps}")).fit()
    assert [s for s in seen if s[0] == "resumed"] == [("resumed", None), ("resumed", 4)]
    reports = [s for s in seen if s[0] == "report"]
    attached = [s[2] for s in reports if s[2] is not None]
    assert attached == sorted(set(attached)) and attached, reports  # each once, in order
    for _, step, got, pointer in reports:
        if got is not None:  # what Ray's get_checkpoint now gives: the version attached, its own metrics
            assert got < step and pointer == VersionPointer(root, got, 1, {"loss": float(got)})
    closed = [s for s in seen if s[0] == "closed"]
    assert [(c[1], c[2].step if c[2] else None) for c in closed] == [(4, 4), (6, 6)]  # close reports the final one
    assert closed[1][2].metrics == {"loss": 6.0} and STEP_METRIC == "asymcheck_step"
