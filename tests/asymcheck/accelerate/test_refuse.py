"""What ``asymcheck.accelerate.attach`` refuses (before anything is hooked), and the loader position's checks.

In-process, without an ``Accelerator`` (its state is a process-wide singleton): the accelerator is a
stand-in exposing the attributes :func:`asymcheck.accelerate.unsupported_settings` reads. The
refusals of a real Accelerate job, and everything that trains, are in test_accelerate_kill.py.
"""

from __future__ import annotations

import itertools
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import accelerate
import pytest
import torch
from accelerate.utils import DistributedType, DynamoBackend

from asymcheck import StateMismatchError, UnsupportedConfigError
from asymcheck.accelerate import ResumableLoader, UnsupportedAccelerateConfigError, attach, unsupported_settings
from asymcheck.errors import InexactResumeWarning, UnresumableDataError


def accelerator(**changes: Any) -> Any:
    fields: dict[str, Any] = {
        "distributed_type": DistributedType.NO, "mixed_precision": "no", "parallelism_config": None,
        "use_stateful_dataloader": False,
        "state": SimpleNamespace(dynamo_plugin=SimpleNamespace(backend=DynamoBackend.NO), fsdp_plugin=None)}
    fields.update(changes)
    return SimpleNamespace(**fields)


def with_state(**changes: Any) -> Any:
    state = {"dynamo_plugin": SimpleNamespace(backend=DynamoBackend.NO), "fsdp_plugin": None, **changes}
    return accelerator(state=SimpleNamespace(**state))


def test_supported_settings_pass() -> None:
    for kind in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.DEEPSPEED):
        assert unsupported_settings(accelerator(distributed_type=kind)) == []


@pytest.mark.parametrize(("acc", "setting"), [
    (accelerator(distributed_type=DistributedType.XLA), "distributed_type=DistributedType.XLA"),
    (accelerator(distributed_type=DistributedType.MEGATRON_LM), "distributed_type=DistributedType.MEGATRON_LM"),
    (with_state(dynamo_plugin=SimpleNamespace(backend=DynamoBackend.INDUCTOR, use_regional_compilation=True)),
     "TorchDynamoPlugin(use_regional_compilation=True)"),
    (accelerator(mixed_precision="fp8"), "mixed_precision=fp8"),
    (accelerator(parallelism_config=SimpleNamespace(tp_size=2, cp_size=1, sp_size=1)), "tp_size=2"),
    (accelerator(parallelism_config=SimpleNamespace(tp_size=1, cp_size=2, sp_size=None)), "cp_size=2"),
])
def test_refused_settings_are_named(acc: Any, setting: str) -> None:
    problems = unsupported_settings(acc)
    assert len(problems) == 1 and setting in problems[0], problems
    with pytest.raises(UnsupportedAccelerateConfigError, match=re.escape(setting)) as info:
        attach(acc, None, None, "unused")  # refused before the model or optimizer is looked at
    assert isinstance(info.value, UnsupportedConfigError)


def test_compile_and_stateful_loader_are_supported() -> None:
    """Whole-model torch.compile (one process, DDP), the StatefulDataLoader: test_compile.py, test_stateful_loader.py"""
    for kind in (DistributedType.NO, DistributedType.MULTI_CPU):
        for backend in (DynamoBackend.AOT_EAGER, DynamoBackend.INDUCTOR):
            acc = with_state(dynamo_plugin=SimpleNamespace(backend=backend, use_regional_compilation=None))
            acc.distributed_type = kind
            assert unsupported_settings(acc) == []
    assert unsupported_settings(accelerator(use_stateful_dataloader=True)) == []


def test_compile_under_deepspeed_is_refused(tmp_path: Path) -> None:
    acc = with_state(dynamo_plugin=SimpleNamespace(backend=DynamoBackend.INDUCTOR, use_regional_compilation=None))
    acc.distributed_type = DistributedType.DEEPSPEED
    problems = unsupported_settings(acc)
    assert len(problems) == 1 and problems[0].startswith("dynamo_backend under DeepSpeed ("), problems
    with pytest.raises(UnsupportedAccelerateConfigError, match="dynamo_backend under DeepSpeed"):
        attach(acc, torch.nn.Linear(2, 2), None, str(tmp_path / "ckpt"), data={})
    assert not any(tmp_path.iterdir())  # refused before the store was opened


def test_fsdp1_is_refused_naming_the_switch_to_fsdp2() -> None:
    acc = with_state(fsdp_plugin=SimpleNamespace(fsdp_version=1))
    acc.distributed_type = DistributedType.FSDP
    problems = unsupported_settings(acc)
    assert len(problems) == 1 and problems[0].startswith("fsdp_version=1 ("), problems
    assert "FullyShardedDataParallelPlugin(fsdp_version=2)" in problems[0]
    with pytest.raises(UnsupportedAccelerateConfigError, match="fsdp_version=1"):
        attach(acc, None, None, "unused")


def test_fsdp2_is_refused_as_gpu_only_and_untested(tmp_path: Path) -> None:
    """Accelerate 1.15 runs FSDP on GPUs only (on the CPU it prepares DDP): the route is refused before anything."""
    acc = with_state(fsdp_plugin=SimpleNamespace(fsdp_version=2))
    acc.distributed_type = DistributedType.FSDP
    problems = unsupported_settings(acc)
    assert len(problems) == 1 and problems[0].startswith("fsdp_version=2 (Accelerate 1.15 runs FSDP on GPUs only"), \
        problems
    with pytest.raises(UnsupportedAccelerateConfigError, match="fsdp_version=2"):
        attach(acc, torch.nn.Linear(2, 2), None, str(tmp_path / "ckpt"), data={})
    assert not any(tmp_path.iterdir())  # refused before the store was opened


def test_untested_accelerate_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accelerate, "__version__", "1.16.0")
    assert any("accelerate 1.16.0" in p for p in unsupported_settings(accelerator()))


class Loader:
    """The parts of a prepared loader ResumableLoader uses: its epoch, ``set_epoch``, its length.

    A pass draws its order from the global torch RNG when it begins (as a shuffling DataLoader does).
    """

    def __init__(self) -> None:
        self.iteration = 0

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch

    def __len__(self) -> int:
        return 5

    def __iter__(self) -> Any:
        yield from torch.randperm(5).tolist()
        self.iteration += 1


def skipping(loader: Loader, n: int) -> Any:
    """``accelerator.skip_first_batches`` of the stand-in: a new loader object, the same order."""
    other = Loader()
    other.iteration = loader.iteration
    return itertools.islice(iter(other), n, None)


def test_loader_position_round_trip_and_checks() -> None:
    acc = SimpleNamespace(gradient_state=SimpleNamespace(active_dataloader=None))
    loader = ResumableLoader(acc, Loader(), "train")
    seen = []
    for batch in loader:
        seen.append(batch)
        state = loader.state_dict()
        assert state["active"] and state["batches"] == len(seen) and state["epoch"] == 0
        if len(seen) == 3:
            break
    assert not loader.active and loader.state_dict()["active"] is False  # a broken-off pass is over
    fresh = ResumableLoader(acc, Loader(), "train")
    fresh.load_state_dict({"epoch": 4, "batches": 2, "active": False, "start": {}})
    assert fresh.epoch == 4 and sorted(fresh) == [0, 1, 2, 3, 4]  # between passes: the next one is the loader's
    with pytest.raises(StateMismatchError, match="6 batches"):
        fresh.load_state_dict({"epoch": 0, "batches": 6, "active": True, "start": {}})
    with pytest.raises(StateMismatchError, match="not a loader position"):
        fresh.load_state_dict({"epoch": 0})


def test_continuation_draws_the_interrupted_order_and_leaves_the_rng_alone() -> None:
    acc = SimpleNamespace(gradient_state=SimpleNamespace(active_dataloader=None), skip_first_batches=skipping)
    torch.manual_seed(7)
    loader = ResumableLoader(acc, Loader(), "train")
    loader.load_state_dict({"epoch": 3, "batches": 0, "active": False, "start": {}})
    order, state = [], None
    for batch in loader:
        order.append(batch)
        if len(order) == 2:
            state = loader.state_dict()  # what a version after this batch holds
    assert state is not None and loader.epoch == 4
    torch.manual_seed(99)  # the resumed process: the RNG is the version's, long past the pass's start
    before = torch.get_rng_state()
    resumed = ResumableLoader(acc, Loader(), "train")
    resumed.load_state_dict(state)
    assert resumed.epoch == 3
    assert list(resumed) == order[2:]  # the same order, after the batches already trained
    assert torch.equal(torch.get_rng_state(), before)  # the pass's draws were made from its own start state
    assert resumed.epoch == 4  # the loader's epoch moved on as the uninterrupted pass's did


def stateful_shard() -> Any:
    """A prepared-style stateful loader (torchdata) whose sampler shuffles with a generator of its own.

    As Accelerate's under DDP (its synchronized generator) or any loader given ``generator=``: each pass
    draws its order from that generator where the pass before left it.
    """
    from accelerate.data_loader import DataLoaderShard

    data = torch.utils.data.TensorDataset(torch.arange(12))
    sampler = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(3))
    return DataLoaderShard(data, batch_size=4, sampler=sampler, use_stateful_dataloader=True)


def order(loader: ResumableLoader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


@pytest.mark.parametrize("where", ["after the last batch", "between passes"])
def test_a_version_at_a_pass_end_resumes_the_next_order_of_the_loaders_generator(where: str) -> None:
    """The version's pass is over: the next pass draws from the sampler generator where the finished pass left it."""
    acc = SimpleNamespace(gradient_state=SimpleNamespace(active_dataloader=None))
    loader = ResumableLoader(acc, stateful_shard(), "train")
    state: dict[str, Any] = {}
    for _ in loader:
        state = loader.state_dict()  # what a version taken at this batch's step holds
    if where == "between passes":
        state = loader.state_dict()
    assert state["active"] == (where == "after the last batch") and state["generators"].keys() == {"sampler"}
    want = order(loader)  # the uninterrupted run's second pass
    resumed = ResumableLoader(acc, stateful_shard(), "train")  # a new process: its generator as prepare left it
    assert order(ResumableLoader(acc, stateful_shard(), "train")) != want  # (which draws the first pass's order)
    resumed.check_state_dict(state)
    resumed.load_state_dict(state)
    if where == "after the last batch":
        assert order(resumed) == []  # the finished pass: nothing left of it
    assert resumed.epoch == 1 and order(resumed) == want
    # a version without the generators' states (taken before they were recorded) is refused, nothing loaded
    old = {k: v for k, v in state.items() if k != "generators"}
    other = ResumableLoader(acc, stateful_shard(), "train")
    for call in (other.check_state_dict, other.load_state_dict):
        with pytest.raises(StateMismatchError, match="no state of the loader's generators"):
            call(old)
    assert other.epoch == 0 and not other.position.continuing
    with pytest.raises(StateMismatchError, match="generators"):  # states of other generators than the loader's
        other.load_state_dict({**state, "generators": {"loader": state["generators"]["sampler"]}})


def plain_job() -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    """A stand-in accelerator of one process (prepare() returns its arguments) and a model with its optimizer."""
    acc = accelerator(scaler=None, unwrap_model=lambda m: m)
    model = torch.nn.Linear(4, 2)
    return acc, model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_loader_prepare_did_not_return_is_refused(tmp_path: Path) -> None:
    acc, model, opt = plain_job()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4,
                                         shuffle=True)
    for data in (loader, {"train": loader}):
        with pytest.raises(UnresumableDataError, match="did not return") as info:
            attach(acc, model, opt, str(tmp_path), data=data)
        assert "'loader'" in str(info.value) or "'train'" in str(info.value)
    assert not any(tmp_path.iterdir())  # refused before the store was opened


def test_no_data_is_named_unless_said_explicitly(tmp_path: Path) -> None:
    acc, model, opt = plain_job()
    with pytest.warns(InexactResumeWarning, match="no data="):
        attach(acc, model, opt, str(tmp_path / "a")).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactResumeWarning)
        attach(acc, model, opt, str(tmp_path / "b"), data={}).close()  # the loop draws no batches from a loader


def test_a_prepared_loader_with_workers_is_named(tmp_path: Path) -> None:
    from accelerate.data_loader import DataLoaderShard

    acc, model, opt = plain_job()
    loader = DataLoaderShard(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4, num_workers=2)
    with pytest.warns(InexactResumeWarning, match="num_workers=2") as record:
        attach(acc, model, opt, str(tmp_path), data=loader).close()
    assert len(record) == 1


def test_no_location_is_a_typed_error_naming_the_fix(tmp_path: Path) -> None:
    """run_clm_no_trainer.py's --output_dir is None unless given: attach(..., args.output_dir) names the line to use."""
    from asymcheck.accelerate import MissingLocationError
    from asymcheck.errors import AsymcheckError

    acc, model, opt = plain_job()
    for make in (lambda: attach(acc, model, opt, None, data={}), lambda: attach(acc, model, opt, data={})):
        with pytest.raises(MissingLocationError, match="missing the argument 'location'") as info:
            make()
        assert isinstance(info.value, AsymcheckError) and isinstance(info.value, TypeError)
        assert 'os.path.join(args.output_dir or ".", "asymcheck")' in str(info.value)
    assert not any(tmp_path.iterdir())


def test_fullgraph_compile_copies_at_the_step(tmp_path: Path) -> None:
    """TorchDynamoPlugin(fullgraph=True): no hook in the graph, the copy at the step; other partitionings refused."""
    from asymcheck.errors import InvalidOptionError
    from asymcheck.options import PartitionOptions

    acc, model, opt = plain_job()
    acc.unwrap_model = lambda m, keep_torch_compile=True: m
    acc.step = 0
    acc.state = SimpleNamespace(fsdp_plugin=None, dynamo_plugin=SimpleNamespace(
        backend=DynamoBackend.AOT_EAGER, fullgraph=True, use_regional_compilation=None))
    with pytest.raises(InvalidOptionError, match="fullgraph"):
        attach(acc, model, opt, str(tmp_path / "a"), data={}, partitions=PartitionOptions(partitioning="asymmetric"))
    assert not (tmp_path / "a").exists()  # refused before the store was opened
    with attach(acc, model, opt, str(tmp_path / "b"), data={}, partitions=PartitionOptions(partitioning="step")):
        pass
    with attach(acc, model, opt, str(tmp_path / "c"), data={}) as ckpt:  # no partitions=: "step"
        assert ckpt.checkpointer.partitioning == "step"
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        steps = ckpt.stats().steps
        assert len(steps) >= 3 and all(r.hook_s == 0 and r.forward_bytes == r.backward_bytes == 0 for r in steps)
    acc.state.dynamo_plugin.fullgraph = None  # graph breaks allowed: the hooks run eagerly at them
    with attach(acc, model, opt, str(tmp_path / "d"), data={}) as ckpt:
        assert ckpt.checkpointer.partitioning == "asymmetric"
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert any(r.hook_s > 0 for r in ckpt.stats().steps)  # the forward and grad hooks ran
