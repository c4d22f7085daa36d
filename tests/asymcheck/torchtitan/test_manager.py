"""``AsymCheckManager`` in one process, built as TorchTitan's trainer builds it: refusals, the loader's position, steps.

The manager is built from its ``Config`` with TorchTitan's own ``OptimizersContainer``,
``LRSchedulersContainer`` and ``ParallelAwareDataloader`` over a small model (tests/support/titan_parts.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.titan_parts import ACCUM, BATCH, TinyLM, TokenStream, TrainState

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is not installed")

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, default_adamw
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from asymcheck.errors import (
    CheckpointerStateError,
    StateMismatchError,
    UnsupportedTorchTitanConfigError,
)
from asymcheck.torchtitan import AsymCheckManager, unsupported_settings
from asymstore import AsymStore, LocalTier


class Job:
    """The trainer's objects and a manager built from ``config`` over them (TorchTitan's ``build`` call)."""

    def __init__(self, dump: Path, *, dp: tuple[int, int] = (0, 1), steps: int = 4, **config: Any) -> None:
        torch.manual_seed(0)
        self.model = TinyLM()
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=self.optimizers,
                                                                               training_steps=steps)
        self.dataset = TokenStream()
        self.dataloader = ParallelAwareDataloader(self.dataset, dp_rank=dp[0], dp_world_size=dp[1], batch_size=BATCH)
        self.train_state = TrainState()
        self.config = AsymCheckManager.Config(enable=True, interval=1, folder="ckpt", **config)
        self.manager = self.config.build(dataloader=self.dataloader, model_parts=[self.model],
                                         optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                                         states={"train_state": self.train_state}, sd_adapter=None,
                                         base_folder=str(dump))
        self.batches = iter(self.dataloader)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.train_state.step += 1
            self.optimizers.zero_grad()
            for _ in range(ACCUM):
                inputs, labels = next(self.batches)
                pred = self.model(inputs["input"])
                torch.nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten()).backward()
            self.manager.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.manager.save(self.train_state.step)


def newest(root: Path) -> tuple[int, dict[str, Any]]:
    async def read() -> tuple[int, dict[str, Any]]:
        async with AsymStore([LocalTier(root)], keep_last=None) as store:
            ckpt = await store.restore()
            return ckpt.step, ckpt.meta

    return asyncio.run(read())


def two_optimizers() -> OptimizersContainer:
    config = OptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=r"^output\.", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-3}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})])
    return config.build(model_parts=[TinyLM()])


@pytest.mark.parametrize(("config", "parts", "optimizers", "names"), [
    ({"load_step": 3}, 1, "one", "checkpoint.load_step=3"),
    ({"initial_load_path": "/some/where"}, 1, "one", "checkpoint.initial_load_path"),
    ({"load_only": True}, 1, "one", "checkpoint.load_only"),
    ({"exclude_from_loading": ["optimizer"]}, 1, "one", "checkpoint.exclude_from_loading=['optimizer']"),
    ({"exclude_from_loading": ["train_state"]}, 1, "one", "checkpoint.exclude_from_loading=['train_state']"),
    ({}, 2, "one", "2 model parts"),
    ({}, 1, "two", "2 optimizers in the OptimizersContainer"),
], ids=["load_step", "initial_load_path", "load_only", "exclude-optimizer", "exclude-train-state", "pipeline",
                  "two-optimizers"])
def test_refused_settings_name_themselves_before_anything_is_hooked(
        tmp_path: Path, config: dict[str, Any], parts: int, optimizers: str, names: str) -> None:
    model_parts = [TinyLM() for _ in range(parts)]
    opt = default_adamw().build(model_parts=model_parts) if optimizers == "one" else two_optimizers()
    with pytest.raises(UnsupportedTorchTitanConfigError, match="does not capture this job correctly") as info:
        AsymCheckManager.Config(enable=True, **config).build(
            dataloader=None, model_parts=model_parts, optimizers=opt, lr_schedulers=None, states={},
            sd_adapter=None, base_folder=str(tmp_path))
    assert names in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no store was opened
    assert all(not p._post_accumulate_grad_hooks for m in model_parts for p in m.parameters())  # type: ignore[attr-defined]


def test_untested_torchtitan_version_is_refused() -> None:
    model = TinyLM()
    lines = unsupported_settings(AsymCheckManager.Config(enable=True), model_parts=[model],
                                 optimizers=default_adamw().build(model_parts=[model]), version="0.4.0")
    assert lines == ["torchtitan 0.4.0: only 0.3.x is tested"]


def test_disabled_manager_saves_and_loads_nothing(tmp_path: Path) -> None:
    model = TinyLM()
    manager = AsymCheckManager.Config(enable=False).build(
        dataloader=None, model_parts=[model], optimizers=default_adamw().build(model_parts=[model]),
        lr_schedulers=None, states={}, sd_adapter=None, base_folder=str(tmp_path))
    assert manager.load() is False and manager.save(1) is False
    manager.maybe_wait_for_staging()
    manager.close()
    assert list(tmp_path.iterdir()) == []


def test_version_holds_the_loader_position_unpickled_and_the_train_state_of_its_step(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.train(3)
    job.manager.close()
    step, meta = newest(tmp_path / "ckpt")
    assert step == 3
    # save(step) took the trainer's own state of step 3 (before the trainer's next ``step += 1``)
    assert meta["stateful"]["torchtitan.train_state"] == {"step": 3, "ntokens_seen": 0}
    assert meta["stateful"]["torchtitan.lr_scheduler"] == {"last_epoch": 3}
    loader = meta["data"]["torchtitan.dataloader"]
    assert loader["dp"] == [0, 1]
    # torchdata's own state (TorchTitan's override would have pickled it into bytes)
    text = json.dumps(loader)
    assert "$bytes" not in text and "dp_rank_0" not in text
    assert loader["loader"]["torchdata"]["dataset_state"] == {"sample_idx": 3 * ACCUM * BATCH}


def test_resume_on_another_data_parallel_degree_refuses_the_loader_unless_excluded(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.train(2)
    job.manager.close()
    weights = {k: v.clone() for k, v in job.model.state_dict().items()}
    other = Job(tmp_path, dp=(0, 2))
    with pytest.raises(StateMismatchError, match=r"exclude_from_loading=\['dataloader'\]"):
        other.manager.load()
    assert other.train_state.step == 0  # nothing loaded
    other.manager.close()
    fresh = Job(tmp_path, dp=(0, 2), exclude_from_loading=["dataloader"])
    assert fresh.manager.load() is True
    assert fresh.train_state.step == 2 and fresh.lr_schedulers.state_dict() == {"last_epoch": 2}
    assert all(torch.equal(v, weights[k]) for k, v in fresh.model.state_dict().items())
    assert fresh.dataset.sample_idx == 0  # the loader starts anew
    fresh.train(1)
    fresh.manager.close()
    assert newest(tmp_path / "ckpt")[0] == 3


def test_save_of_a_step_the_optimizer_did_not_take_is_refused(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.train(1)
    with pytest.raises(CheckpointerStateError, match="TorchTitan saves step 5 after 1 optimizer steps"):
        job.manager.save(5)
    job.manager.close()


def test_cuda_graphs_of_the_trainer_are_refused_where_torchtitan_would_capture_them() -> None:
    """TorchTitan replays fwd+bwd as a CUDA graph on NVIDIA CUDA unless ``training.disable_cuda_graphs``."""
    from types import SimpleNamespace

    from torchtitan.config import TrainingConfig

    model = TinyLM()
    optimizers = default_adamw().build(model_parts=[model])
    graphs = SimpleNamespace(config=SimpleNamespace(training=TrainingConfig()))
    eager = SimpleNamespace(config=SimpleNamespace(training=TrainingConfig(disable_cuda_graphs=True)))
    on_cuda = torch.cuda.is_available() and torch.version.hip is None
    lines = unsupported_settings(AsymCheckManager.Config(enable=True), model_parts=[model], optimizers=optimizers,
                                 trainer=graphs)
    assert any(line.startswith("training.disable_cuda_graphs=False") for line in lines) == on_cuda, lines
    assert unsupported_settings(AsymCheckManager.Config(enable=True), model_parts=[model], optimizers=optimizers,
                                trainer=eager) == []
    assert unsupported_settings(AsymCheckManager.Config(enable=True), model_parts=[model], optimizers=optimizers,
                                trainer=TrainState()) == []  # no TorchTitan config: nothing to tell
