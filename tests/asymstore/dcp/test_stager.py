"""``asymcheck.dcp.Stager``: ``dcp.async_save``'s staging copy into reused host slots, overlapping the next step.

What DCP writes must be exactly the state after the step the save names, although the optimizer changes the
parameters in place afterwards: a small model (BatchNorm buffers change in every forward) trains several steps
with a save after each, its state deep-copied right after the step; every version loads back equal to its copy.
The copies are slowed down (a fault injected into the copy engine's thread), so each one is still running through
the next forward, backward and step: a copy that is not awaited before the step, or that is read late, is caught.
An edit outside the optimizer before the copy finished fails that save (nothing committed) and the next goes on.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from asymcheck.dcp import Stager
from asymcheck.errors import InvalidOptionError, StagingError, UnsupportedModelError
from asymcheck.snapshot import copyengine
from asymstore.dcp import StorageReader, StorageWriter
from asymstore.dcp.lent import is_lent
from tests.support import dcp_train as t

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.usefixtures("one_thread")]

DELAY_S = 0.02  # per background copy batch: longer than a step of the model below


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The fault: every background copy starts late (as a copy of a large state would end late)."""
    real: Callable[[copyengine.CopyJob], bool] = copyengine._copy_cpu

    def late(job: copyengine.CopyJob) -> bool:
        time.sleep(DELAY_S / 4)
        return real(job)

    monkeypatch.setattr(copyengine, "_copy_cpu", late)
    yield


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.ReLU(),
                                torch.nn.Linear(12, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(i))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def app_state(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": i}


def flat(obj: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a nested state: tensors as themselves, anything else as its repr."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    if isinstance(obj, dict):
        return {k: v for key in obj for k, v in flat(obj[key], f"{path}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, x in enumerate(obj) for k, v in flat(x, f"{path}/{i}").items()}
    return {path: repr(obj)}


def assert_same(got: Any, want: Any) -> None:
    g, w = flat(got), flat(want)
    assert g.keys() == w.keys()
    for key, value in w.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == g[key].dtype and torch.equal(g[key], value), key
        else:
            assert g[key] == value, key


def load(writer: StorageWriter, i: int) -> dict[str, Any]:
    model, opt = build(seed=99)
    step(model, opt, 1000)  # AdamW's state exists, with other values
    state = app_state(model, opt, -1)
    dcp.load(state, storage_reader=StorageReader(writer), checkpoint_id=str(i))
    return state


def test_every_step_saved_exactly_while_the_copy_overlaps_the_next_step(tmp_path: Path, slow_copies: None) -> None:
    model, opt = build()
    steps = 5
    taken: dict[int, dict[str, Any]] = {}
    overlapped = 0
    with StorageWriter(tmp_path / "ckpt", keep_last=None) as writer, Stager(opt) as stager:
        assert isinstance(stager, AsyncStager)
        response = None
        for i in range(steps):
            step(model, opt, i)  # waits (step pre-hook) for the copy of step i - 1 before changing the state
            if response is not None:
                response.upload_completion.result()
            state = app_state(model, opt, i)
            taken[i] = copy.deepcopy(state)  # the state after step i
            response = dcp.async_save(state, storage_writer=writer, async_stager=stager, checkpoint_id=str(i))
            assert isinstance(response, AsyncSaveResponse)
            overlapped += not response.staging_completion.done()  # the copy goes on while training does
        assert response is not None
        response.upload_completion.result()  # the last copy finishes without another step
        stats = stager.stats()
        assert writer.store.versions() == {f"local:{tmp_path / 'ckpt'}": list(range(steps))}
        for i in range(steps):
            assert_same(load(writer, i), taken[i])
    assert overlapped == steps
    assert stats.stages == steps and stats.failed == 0
    assert stats.background_bytes > 0 and stats.inline_bytes > 0  # the BatchNorm buffers are copied in stage()
    assert stats.host_bytes <= 2 * (stats.bytes_staged + 64 * 40 + 4096)  # two slots, reused


@pytest.mark.parametrize("edit", ["in-place", "through-data"])
def test_an_edit_before_the_copy_fails_that_save_only(tmp_path: Path, slow_copies: None, edit: str) -> None:
    model, opt = build()
    weight = model[0].weight
    with StorageWriter(tmp_path / "ckpt", keep_last=None) as writer, Stager(opt) as stager:
        step(model, opt, 0)
        dcp.async_save(app_state(model, opt, 0), storage_writer=writer, async_stager=stager,
                       checkpoint_id="0").upload_completion.result()
        step(model, opt, 1)
        response = dcp.async_save(app_state(model, opt, 1), storage_writer=writer, async_stager=stager,
                                  checkpoint_id="1")
        with torch.no_grad():  # an edit between steps, outside the optimizer, before the copy read it
            if edit == "in-place":
                weight.mul_(2)
            else:
                weight.data.mul_(2)  # moves no version counter: the byte sample finds it
        with pytest.raises(StagingError, match="changed before"):
            response.upload_completion.result()
        with pytest.raises(StagingError):
            response.staging_completion.result()
        step(model, opt, 2)
        state = app_state(model, opt, 2)
        want = copy.deepcopy(state)
        dcp.async_save(state, storage_writer=writer, async_stager=stager,
                       checkpoint_id="2").upload_completion.result()
        assert writer.store.versions() == {f"local:{tmp_path / 'ckpt'}": [0, 2]}
        assert_same(load(writer, 2), want)
        assert stager.stats().failed == 1


def test_without_an_optimizer_stage_copies_at_once_into_reused_slots(tmp_path: Path) -> None:
    model, opt = build()
    with StorageWriter(tmp_path / "ckpt", keep_last=2) as writer, Stager() as stager:
        sizes = []
        for i in range(4):
            step(model, opt, i)
            state = app_state(model, opt, i)
            want = copy.deepcopy(state)
            future = dcp.async_save(state, storage_writer=writer, async_stager=stager, checkpoint_id=str(i))
            step(model, opt, 100 + i)  # the staged copy is already taken: training may change everything
            future.result()
            assert_same(load(writer, i), want)
            sizes.append(stager.stats().host_bytes)
        assert stager.stats().background_bytes == 0
    assert sizes[1] == sizes[-1]  # two slots, allocated once


def test_a_slot_held_by_an_unfinished_save_is_waited_for_then_refused(tmp_path: Path) -> None:
    model, opt = build()
    step(model, opt, 0)
    with Stager(opt, slots=1, slot_timeout_s=0.3) as stager:
        held = stager.stage(app_state(model, opt, 0))
        assert not isinstance(held, dict)
        staged = held.result()  # a save still reading the slot holds its views
        views = [v for v in flat(staged).values() if isinstance(v, torch.Tensor) and v.numel()]
        assert views and all(is_lent(v) for v in views)  # the StorageWriter adopts them instead of copying
        del views
        started = time.monotonic()
        with pytest.raises(StagingError, match="no host slot"):
            stager.stage(app_state(model, opt, 0))
        assert 0.3 <= time.monotonic() - started < 5
        host = stager.stats().host_bytes
        del staged, held
        gc.collect()
        again = stager.stage(app_state(model, opt, 0))
        assert not isinstance(again, dict)
        assert_same(again.result(), app_state(model, opt, 0))
        assert stager.stats().host_bytes == host


def test_bad_arguments_are_refused() -> None:
    model, opt = build()
    for kwargs in ({"slots": 0}, {"slots": True}, {"slot_timeout_s": 0}, {"slot_timeout_s": "1"}):
        with pytest.raises(InvalidOptionError):
            Stager(opt, **kwargs)  # type: ignore[arg-type]
    for bad in ("opt", [], [opt, model]):
        with pytest.raises(InvalidOptionError):
            Stager(bad)  # type: ignore[arg-type]
    with Stager(opt) as stager:
        for value in (torch.zeros(3, 3).to_sparse(), torch.empty(2, device="meta")):
            with pytest.raises(UnsupportedModelError):
                stager.stage({"model": model.state_dict(), "x": value})
    with pytest.raises(StagingError, match="closed"):
        stager.stage({"x": torch.zeros(2)})


def test_torchtitan_order_waits_for_staging_before_the_step(tmp_path: Path, slow_copies: None) -> None:
    """TorchTitan waits for ``staging_completion`` right before ``optimizers.step()``: the copy must end by itself."""
    model, opt = build()
    with StorageWriter(tmp_path / "ckpt", keep_last=None) as writer, Stager(opt) as stager:
        step(model, opt, 0)
        state = app_state(model, opt, 0)
        want = copy.deepcopy(state)
        response = dcp.async_save(state, storage_writer=writer, async_stager=stager, checkpoint_id="0")
        x = torch.randn(8, 6)
        model(x).square().mean().backward()
        done = response.staging_completion.exception(timeout=30)  # before the step: no hook has run since
        assert done is None and response.staging_completion.done()
        opt.step()
        response.upload_completion.result()
        assert_same(load(writer, 0), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_staged_exactly(tmp_path: Path) -> None:
    model, opt = build()
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    taken = {}
    with StorageWriter(tmp_path / "ckpt", keep_last=None) as writer, Stager(opt) as stager:
        response = None
        for i in range(4):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(i)).cuda()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if response is not None:
                response.upload_completion.result()
            state = app_state(model, opt, i)
            taken[i] = {k: v for k, v in flat(copy.deepcopy(state)).items()}
            response = dcp.async_save(state, storage_writer=writer, async_stager=stager, checkpoint_id=str(i))
        assert response is not None
        response.upload_completion.result()
        assert stager.stats().failed == 0
        for i in range(4):
            fresh, fresh_opt = build(seed=99)
            step(fresh, fresh_opt, 1000)
            state = app_state(fresh, fresh_opt, -1)
            dcp.load(state, storage_reader=StorageReader(writer), checkpoint_id=str(i))
            got = flat(state)
            for key, value in taken[i].items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(got[key], value.cpu()), key


def test_tied_weights_are_copied_once_and_saved_under_both_names(tmp_path: Path) -> None:
    model, opt = build()
    step(model, opt, 0)
    weight = model[0].weight
    state = {"a": weight.detach(), "b": weight.detach(), "c": weight.detach()[1:]}  # the last: other bytes
    with StorageWriter(tmp_path / "ckpt") as writer, Stager(opt) as stager:
        response = dcp.async_save(state, storage_writer=writer, async_stager=stager, checkpoint_id="0")
        response.upload_completion.result()
        assert stager.stats().bytes_staged == weight.numel() * 4 + weight[1:].numel() * 4
        got = {"a": torch.zeros_like(weight), "b": torch.zeros_like(weight), "c": torch.zeros_like(weight[1:])}
        dcp.load(got, storage_reader=StorageReader(writer))
    assert_same(got, {"a": weight, "b": weight, "c": weight[1:]})


@pytest.mark.slow
@pytest.mark.parametrize("wrap", [pytest.param("ddp", marks=pytest.mark.exhaustive), "fsdp2"])
def test_two_ranks_each_step_exact(tmp_path: Path, wrap: str) -> None:
    """Two gloo ranks (DDP, or FSDP2: DTensor state dicts), a RankStore each: every step loads back as its deep
    copy (checked in each rank); the last one, read in one process, is the whole state the job ended with."""
    if wrap == "fsdp2":
        pytest.importorskip("torch.distributed.fsdp", reason="no FSDP2 in this torch")
    t.run_ranks(2, f"{wrap}-stager", str(tmp_path))
    model = t.small_model(shard=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    t.small_step(model, opt, 0, 0)  # AdamW's state exists
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with StorageReader(tmp_path / "root") as reader:  # the multi-rank version, read in one process
        dcp.load(state, storage_reader=reader)
        assert reader.step == 3
    if wrap == "fsdp2":
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert t.full_digests(model, opt) == t.read_json(tmp_path / "last.json")
    else:
        assert t.digests(state) == t.read_json(tmp_path / "last.json")
    done = t.fsck(tmp_path / "root", "--deep")
    assert done.returncode == 0 and "verdict: OK" in done.stdout, done.stdout + done.stderr
