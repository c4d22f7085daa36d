"""The integration base: one loader position for every framework, one RNG capture, the refusals as data,
one supported-settings check with the tested-version rule, and the old public names as deprecated aliases."""

from __future__ import annotations

import random
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import asymcheck
import asymcheck.accelerate
import asymcheck.hf
import asymcheck.lightning
from asymcheck.errors import UnsupportedTrainerConfigError
from asymcheck.integrations import HeldRng, LoaderPosition, ResumableLoader, pass_states
from asymcheck.integrations.settings import ACCELERATE, HF_TRAINER, LIGHTNING, RAY, TESTED, TORCHTITAN, Refusal, refusal


def shuffled(generator: torch.Generator | None = None) -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(20)), batch_size=4, shuffle=True,
                                       generator=generator)


def test_both_framework_loaders_are_the_one_resumable_loader() -> None:
    acc = SimpleNamespace(gradient_state=SimpleNamespace(active_dataloader=None))
    loaders = [asymcheck.accelerate.ResumableLoader(acc, shuffled(), "train"),
               asymcheck.lightning.ResumableLoader(shuffled(), "train")]
    for loader in loaders:
        assert isinstance(loader, ResumableLoader) and isinstance(loader.position, LoaderPosition)
        assert loader.name == "train" and loader.batches == 0 and len(loader) == 5
        loader.batches = 2
        assert loader.position.batches == 2


def test_a_position_continues_the_interrupted_order_and_gives_the_rng_back() -> None:
    g = torch.Generator().manual_seed(5)
    loader = shuffled(g)
    pos = LoaderPosition()
    pos.begin({"generator": g})
    start = {k: v.clone() for k, v in pos.start.items()}
    order = [b[0].tolist() for b in loader]
    torch.manual_seed(123)  # the resumed process: other states, which the continuation must leave as they are
    g.manual_seed(999)
    before = torch.get_rng_state()
    resumed = LoaderPosition()
    resumed.continue_at(2, start)
    assert resumed.pending is not None and resumed.pending[0] == 2

    def rest() -> Any:
        it = iter(loader)
        for _ in range(2):
            next(it)
        return it

    got = [b[0].tolist() for b in resumed.continued({"generator": g}, rest)]
    assert got == order[2:] and resumed.batches == 2  # counts from the batches already trained
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(resumed.start[k], start[k]) for k in start)  # the pass's own start, for the next version
    resumed.resumed()
    assert resumed.pending is None


def test_pass_states_name_the_global_generator_and_each_role() -> None:
    g = torch.Generator().manual_seed(1)
    states = pass_states({"sampler": g})
    assert set(states) == {"torch", "sampler"} and torch.equal(states["sampler"], g.get_state())


def test_held_rng_is_put_back_once() -> None:
    held = HeldRng()
    assert not held.put_back()
    random.seed(4)
    torch.manual_seed(4)
    held.hold()
    want = (random.random(), torch.rand(3))
    assert held.held and held.put_back() and not held.held
    assert random.random() == want[0] and torch.equal(torch.rand(3), want[1])  # the held states, drawn again
    held.put_back()  # nothing held: the states go on
    assert random.random() != want[0]


def test_refusals_are_data_each_naming_a_setting_and_why() -> None:
    for table in (ACCELERATE, HF_TRAINER, LIGHTNING, RAY, TORCHTITAN):
        assert all(isinstance(r, Refusal) and r.setting and r.why for r in table)
        assert len({r.setting for r in table}) == len(table)
    assert set(TESTED) == {"accelerate", "transformers", "lightning", "ray", "torchtitan"}
    with pytest.raises(KeyError):
        refusal(HF_TRAINER, "no such setting")


def trainer_args(**over: Any) -> SimpleNamespace:
    base = {"fsdp": [], "fp16": False, "auto_find_batch_size": False, "ignore_data_skip": False,
            "torch_compile": False, "n_gpu": 1, "world_size": 1, "deepspeed": None, "deepspeed_plugin": None}
    return SimpleNamespace(**{**base, **over})


def test_the_trainer_check_reports_the_tables_reasons_and_the_untested_version(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedTrainerConfigError) as info:
        asymcheck.hf.check_trainer(trainer_args(ignore_data_skip=True, n_gpu=2))  # type: ignore[arg-type]
    assert refusal(HF_TRAINER, "ignore_data_skip=True").line() in str(info.value)
    assert refusal(HF_TRAINER, "n_gpu").line("n_gpu=2") in str(info.value)
    monkeypatch.setattr(asymcheck.hf.transformers, "__version__", "5.25.0")  # the module object the check reads
    with pytest.raises(UnsupportedTrainerConfigError, match=r"transformers 5\.25\.0: only 5\.24\.x is tested"):
        asymcheck.hf.check_trainer(trainer_args())  # type: ignore[arg-type]


@pytest.mark.parametrize(("module", "old", "new"), [
    (asymcheck, "Planner", "asymcheck.snapshot.partition"),
    (asymcheck, "plan_partitions", "asymcheck.snapshot.partition"),
    (asymcheck.lightning, "AsymCheck", "AsymCheckCallback"),
    (asymcheck.lightning, "TESTED", "settings.TESTED"),
    (asymcheck.accelerate, "TESTED", "settings.TESTED"),
])
def test_old_public_names_warn_and_still_work(module: Any, old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=new):
        obj = getattr(module, old)
    assert obj is not None and old not in getattr(module, "__all__", [])
    if old == "AsymCheck":
        assert obj is asymcheck.lightning.AsymCheckCallback
    if old == "TESTED":
        assert obj == TESTED[module.__name__.split(".")[1]]


def test_the_integration_module_and_trained_attribute_are_deprecated_aliases() -> None:
    import asymcheck.integration
    from asymcheck.integrations.support import untested_version

    with pytest.warns(DeprecationWarning, match="asymcheck.integrations.support"):
        assert asymcheck.integration.untested_version is untested_version
    loader = asymcheck.lightning.ResumableLoader(shuffled())
    with pytest.warns(DeprecationWarning, match="batches"):
        loader.trained = 3
    assert loader.batches == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert asymcheck.lightning.AsymCheckCallback is not None and asymcheck.Checkpointer is not None
