"""Accelerate with torchdata's StatefulDataLoader (``use_stateful_dataloader=True``) killed and resumed.

The harness of test_kill.py (its ``runs`` fixture runs the configurations this module selects): the
prepared loader is a ``StatefulDataLoader``; each version holds its ``state_dict`` (Accelerate's copy,
after the batches yielded), and the resumed pass is the loader's own iterator built from it, going on
at the next unseen sample. torchdata draws a seed from the global torch generator whenever it builds an
iterator; the resume builds it with that draw undone, so that the run's RNG (dropout) stays where
the uninterrupted run had it: every loss and the final state equal an uninterrupted run's, bit for bit.

The ``-end`` cases resume from the version of an epoch's last optimizer step (the job killed right after it,
that version made durable first): the pass is over, and the next epoch's order comes from the sampler's
generator where the finished pass left it (under DDP Accelerate's synchronized generator, which a version
must hold: without it the resumed epoch was shuffled as the first one was, the losses silently different).
"""

from __future__ import annotations

import pytest

from tests.asymcheck.accelerate.test_kill import Config, Runs, check_kill_and_resume, runs

__all__ = ["runs"]

pytestmark = pytest.mark.slow

CONFIGS = [
    pytest.param(Config("single", 1, accum=2, loader="stateful"), id="single-accum2-stateful"),
    pytest.param(Config("ddp", 2, loader="stateful"), id="ddp2-stateful"),
    pytest.param(Config("ddp", 2, loader="stateful", epoch_end=2), id="ddp2-stateful-epoch-end"),
    pytest.param(Config("ddp", 2, loader="stateful", epoch_end=1), id="ddp2-stateful-first-epoch-end",
                 marks=pytest.mark.exhaustive),
    pytest.param(Config("single", 1, accum=2, loader="stateful", epoch_end=2), id="single-accum2-stateful-epoch-end",
                 marks=pytest.mark.exhaustive),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_stateful_loader_kill_and_resume_bit_exact(runs: Runs, config: Config) -> None:
    check_kill_and_resume(runs, config)
    for rank in range(config.world):
        resumed = runs.cases[config].resumed.events(rank, "resumed")[0]
        assert resumed["loader"] == "StatefulDataLoader", f"{config.name}: rank {rank}: {resumed}"
        if config.epoch_end:  # the case is what it says: resumed from the epoch's last step, its pass over
            case = runs.cases[config]
            assert (resumed["step"], resumed["epoch"], resumed["batches"]) == (
                case.kill, config.epoch_end - 1, config.batches), f"{config.name}: rank {rank}: {resumed}"
