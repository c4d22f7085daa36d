"""Accelerate with a PEFT (LoRA) model under ``asymcheck.accelerate.attach``, killed and resumed.

The harness of test_kill.py (its ``runs`` fixture runs the configurations this module selects): the
small GPT-2 wrapped by ``peft.get_peft_model`` (LoRA ``r=4`` on ``c_attn``, LoRA dropout on), its base
frozen, the optimizer holding only the adapters, prepared by Accelerate. A version holds the whole
``PeftModel`` (the frozen base too) and the adapters' optimizer state; every loss and the final state
(model, optimizer, scheduler, RNG) equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import pytest

from tests.asymcheck.accelerate.test_kill import Config, Runs, check_kill_and_resume, runs

__all__ = ["runs"]

pytestmark = pytest.mark.slow

CONFIGS = [
    pytest.param(Config("single", 1, accum=2, peft=True), id="single-accum2-peft"),
    pytest.param(Config("ddp", 2, peft=True), id="ddp2-peft", marks=pytest.mark.exhaustive),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_peft_kill_and_resume_bit_exact(runs: Runs, config: Config) -> None:
    check_kill_and_resume(runs, config)
    for rank in range(config.world):
        resumed = runs.cases[config].resumed.events(rank, "resumed")[0]
        # the run trained adapters only, on a frozen base
        assert resumed["model"] == "PeftModel" and 0 < resumed["trainable"] < resumed["parameters"] // 10, resumed
