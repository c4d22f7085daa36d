"""``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` through asymstore.dcp in one process: a GPT-2 with AdamW state
(``get_state_dict``) round-trips bit-exact on every kind of tier, explicit steps, what is refused, and a custom
planner's data (refused unless pickling it was allowed on both sides).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from asymstore import AsymStore, LocalTier, NoCheckpointError, NVMeTier, RemoteTier, StepOrderError, host_tier
from asymstore.dcp import StorageReader, StorageWriter, parse_step
from asymstore.errors import DCPStorageError, StepCommittedError
from tests.support import dcp_train as t

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]


def trained(steps: int = 2, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = t.gpt2(seed)
    opt = t.optimizer(model)
    for step in range(steps):
        t.train_step(model, opt, step)
    return model, opt


def fresh_state(seed: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = t.gpt2(seed)
    opt = t.optimizer(model)
    return model, opt, t.app_state(model, opt, -1)


def failures(exc: CheckpointException) -> list[BaseException]:
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


def test_gpt2_adamw_round_trip_bit_exact(tmp_path: Path) -> None:
    model, opt = trained(3)
    root = tmp_path / "ckpt"
    with StorageWriter(root) as writer:
        dcp.save(t.app_state(model, opt, 2), storage_writer=writer)
        assert writer.last_step == 0
        t.train_step(model, opt, 3)
        saved = t.app_state(model, opt, 3)
        want = t.digests({"model": model.state_dict(), "optim": opt.state_dict(), "rng": saved["rng"]})
        dcp.save(saved, storage_writer=writer)
        assert writer.last_step == 1
        assert writer.store.versions() == {f"local:{root}": [0, 1]}
        t.train_step(model, opt, 4)  # the live objects move on: the saved version must not

    model2, opt2, state = fresh_state()
    with StorageReader(root) as reader:
        assert reader.steps() == [1, 0]
        dcp.load(state, storage_reader=reader)
        assert reader.step == 1 and reader.fallbacks == []
    t.apply_state(model2, opt2, state)
    assert state["step"] == 3
    assert t.digests({"model": model2.state_dict(), "optim": opt2.state_dict(), "rng": state["rng"]}) == want

    done = t.fsck(root, "--deep")
    assert done.returncode == 0 and "verdict: OK" in done.stdout, done.stdout + done.stderr


def test_async_save_and_resume_in_the_same_process(tmp_path: Path) -> None:
    model, opt = trained(1)
    with StorageWriter(tmp_path / "ckpt", keep_last=2) as writer:
        future = None
        wants = {}
        for step in range(1, 4):
            t.train_step(model, opt, step)
            state = t.app_state(model, opt, step)
            wants[step] = t.digests({"model": model.state_dict(), "optim": opt.state_dict()})
            if future is not None:
                future.result()
            future = dcp.async_save(state, storage_writer=writer, checkpoint_id=f"step-{step}")
        assert future is not None
        future.result()
        assert writer.last_step == 3 and writer.store.versions()[writer.store.tiers[0].name] == [2, 3]

        model2, opt2, state = fresh_state()  # resume from the writer's own store, the writer still open
        reader = StorageReader(writer)
        dcp.load(state, storage_reader=reader)
        t.apply_state(model2, opt2, state)
        assert reader.step == 3 and state["step"] == 3
        assert t.digests({"model": model2.state_dict(), "optim": opt2.state_dict()}) == wants[3]
        dcp.load(state, storage_reader=reader, checkpoint_id="2")
        t.apply_state(model2, opt2, state)
        assert reader.step == 2 and state["step"] == 2
        assert t.digests({"model": model2.state_dict(), "optim": opt2.state_dict()}) == wants[2]
        reader.close()
        t.train_step(model2, opt2, 3)  # and saving goes on after the load
        dcp.save(t.app_state(model2, opt2, 4), storage_writer=writer)
        assert writer.last_step == 4


TIERS = {
    "host+local": lambda p: [host_tier(capacity_bytes=64 << 20), LocalTier(p / "local")],
    "remote-file": lambda p: [RemoteTier(f"file://{p / 'remote'}")],
    "nvme": lambda p: [NVMeTier(p / "nvme")],
    "local+remote": lambda p: [LocalTier(p / "local"), RemoteTier(f"file://{p / 'remote'}")],
}


def small_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g).half()},
            "step": seed, "rng": torch.randint(0, 255, (100,), dtype=torch.uint8, generator=g)}


@pytest.mark.parametrize("kind", sorted(TIERS))
def test_every_tier(tmp_path: Path, kind: str) -> None:
    state = small_state(7)
    with StorageWriter(TIERS[kind](tmp_path), compression="always", segment_bytes=1 << 20) as writer:
        dcp.save(state, storage_writer=writer, checkpoint_id=7)
        back = small_state(0)
        dcp.load(back, storage_reader=StorageReader(writer))  # the fastest tier
        assert t.digests(back) == t.digests(state)
    with StorageReader([TIERS[kind](tmp_path)[-1]]) as reader:  # the slowest tier alone, after close flushed it
        back = small_state(1)
        dcp.load(back, storage_reader=reader)
        assert reader.step == 7
    assert t.digests(back) == t.digests(state)


def test_explicit_steps_and_what_is_refused(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": 5}
    with StorageWriter(tmp_path / "ckpt", keep_last=None) as writer:
        dcp.save(state, storage_writer=writer, checkpoint_id=5)
        dcp.save({**state, "n": 7}, storage_writer=writer, checkpoint_id="run/step_7")
        with pytest.raises(CheckpointException) as info:
            dcp.save(state, storage_writer=writer, checkpoint_id=6)
        assert any(isinstance(f, StepOrderError) for f in failures(info.value))
        with pytest.raises(CheckpointException) as info:
            dcp.save(state, storage_writer=writer, checkpoint_id=7)
        assert any(isinstance(f, StepCommittedError) for f in failures(info.value))
        with pytest.raises(DCPStorageError, match="names no step"):
            dcp.save(state, storage_writer=writer, checkpoint_id="latest")
        with pytest.raises(DCPStorageError, match="use_collectives"):
            dcp.save(state, storage_writer=writer, use_collectives=False)
        dcp.save({**state, "n": 8}, storage_writer=writer)  # after the failures, the next step is 8
        assert writer.last_step == 8
    with StorageReader(tmp_path / "ckpt", step=5) as reader:
        back = {"w": torch.zeros(2, 3), "n": 0}
        dcp.load(back, storage_reader=reader)
        assert back["n"] == 5 and reader.step == 5
        dcp.load(back, storage_reader=reader, checkpoint_id=7)
        assert back["n"] == 7 and torch.equal(back["w"], state["w"])
        with pytest.raises(CheckpointException, match="step 6 is not in"):
            dcp.load(back, storage_reader=reader, checkpoint_id=6)
    assert [parse_step(x) for x in (3, "3", "step-3", "/a/b/step_3/", "step3")] == [3] * 5
    for bad in (-1, True, "x3y", "", None, 1.5):
        with pytest.raises(DCPStorageError):
            parse_step(bad)
    with pytest.raises(DCPStorageError, match="store options"):
        StorageWriter(AsymStore([LocalTier(tmp_path / "x")]), compression="never")


def test_a_root_without_dcp_versions(tmp_path: Path) -> None:
    import asyncio

    async def plain() -> None:
        async with AsymStore([LocalTier(tmp_path / "ckpt")]) as store:
            await store.put(0, "w", torch.ones(3))
            await store.commit(0)
    asyncio.run(plain())
    with StorageReader(tmp_path / "ckpt") as reader:
        with pytest.raises(CheckpointException, match="not a DCP version"):
            dcp.load({"w": torch.zeros(3)}, storage_reader=reader)
        assert isinstance(reader.error, NoCheckpointError)  # DCP keeps only the message: the reader the error


@dataclasses.dataclass(frozen=True)
class Opaque:
    note: str


class OpaquePlanner(DefaultSavePlanner):
    """A custom planner whose planner data is no flattening map (strict JSON cannot hold it)."""

    def create_global_plan(self, all_plans: Any) -> Any:
        plans, metadata = super().create_global_plan(all_plans)
        return plans, dataclasses.replace(metadata, planner_data={"mappings": metadata.planner_data,
                                                                  "note": Opaque("custom")})


def test_custom_planner_data_is_pickled_only_when_allowed(tmp_path: Path) -> None:
    state = {"w": torch.arange(4.0)}
    with StorageWriter(tmp_path / "a") as writer, pytest.raises(CheckpointException) as info:
        dcp.save(state, storage_writer=writer, planner=OpaquePlanner())
    assert any(isinstance(f, DCPStorageError) and "pickle_planner_data" in str(f) for f in failures(info.value))
    with StorageWriter(tmp_path / "a", pickle_planner_data=True) as writer:
        dcp.save(state, storage_writer=writer, planner=OpaquePlanner())
    with StorageReader(tmp_path / "a") as reader, pytest.raises(CheckpointException, match="allow_pickle"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=reader)
    with StorageReader(tmp_path / "a", allow_pickle=True) as reader:
        metadata = reader.read_metadata()
        assert metadata.planner_data["note"] == Opaque("custom")
        back = {"w": torch.zeros(4)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(back, storage_reader=reader)
        assert torch.equal(back["w"], state["w"])
