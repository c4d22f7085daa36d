"""resume() reads the model's tensors in place, and refuses to train on after a resume that found nothing whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asymcheck import CheckpointerStateError
from asymcheck.options import RetentionOptions
from asymstore import CorruptVersionError
from tests.support.asymcheck_train import (
    corrupt_newest_segment,
    equal_state,
    make_model,
    make_opt,
    open_ckpt,
    step_once,
    train,
)


def test_resume_fills_the_live_parameters_themselves(tmp_path: Path) -> None:
    _, opt_saved, states = train(tmp_path, 4, retention=RetentionOptions(keep_last=2))
    model = make_model(seed=9)
    opt, sched = make_opt(model)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with open_ckpt(model, opt, tmp_path, stateful={"sched": sched}, retention=RetentionOptions(keep_last=2)) as ckpt:
        assert ckpt.resume() == 4
        assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs  # read into, not replaced
        equal_state(states[4], model.state_dict())
        saved = opt_saved.state_dict()["state"]
        live = opt.state_dict()["state"]
        assert saved.keys() == live.keys()
        for i in saved:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(saved[i][key], live[i][key])
        step_once(model, opt, 4, sched)


def test_no_version_verifying_stops_training_on_a_partly_loaded_model(tmp_path: Path) -> None:
    train(tmp_path, 2, retention=RetentionOptions(keep_last=2))
    corrupt_newest_segment(tmp_path, 2)
    corrupt_newest_segment(tmp_path, 1)
    model = make_model(seed=9)
    opt, sched = make_opt(model)
    ckpt = open_ckpt(model, opt, tmp_path, stateful={"sched": sched}, retention=RetentionOptions(keep_last=2))
    with ckpt:
        with pytest.raises(CorruptVersionError):
            ckpt.resume()
        with pytest.raises(CheckpointerStateError, match="rebuild the model"):
            step_once(model, opt, 0, sched)


def test_restore_live_returns_the_parameters_it_read_into(tmp_path: Path) -> None:
    import asyncio

    from asymcheck.restore.resume import restore_live
    from asymcheck.state.trainstate import TrainingState
    from asymstore import AsymStore, LocalTier

    _, _, states = train(tmp_path, 3, retention=RetentionOptions(keep_last=1))
    model = make_model(seed=9)
    opt, sched = make_opt(model)
    state = TrainingState(model, opt, stateful={"sched": sched})

    async def go() -> None:
        async with AsymStore([LocalTier(tmp_path)], read_only=True) as store:
            ckpt, in_place = await restore_live(store, state)
        assert in_place
        for key, param in model.state_dict().items():
            assert ckpt.tensors[f"model/{key}"].data_ptr() == param.data_ptr()  # the bytes landed in the parameter
        equal_state(states[3], model.state_dict())

    asyncio.run(go())


def test_existing_optimizer_state_is_filled_in_place_too(tmp_path: Path) -> None:
    _, opt_saved, _ = train(tmp_path, 3, retention=RetentionOptions(keep_last=1))
    model = make_model(seed=9)
    opt, sched = make_opt(model)
    step_once(model, opt, 0, sched)  # the live optimizer has moments already (a job that stepped before resuming)
    ptrs = {(i, k): v.data_ptr() for i, st in opt.state_dict()["state"].items() for k, v in st.items()}
    with open_ckpt(model, opt, tmp_path, stateful={"sched": sched}, retention=RetentionOptions(keep_last=1)) as ckpt:
        assert ckpt.resume() == 3
        live = opt.state_dict()["state"]
        assert {(i, k): v.data_ptr() for i, st in live.items() for k, v in st.items()} == ptrs
        saved = opt_saved.state_dict()["state"]
        assert all(torch.equal(saved[i][k], live[i][k]) for i in saved for k in saved[i])
