"""Accelerate with ``torch.compile`` (``Accelerator(dynamo_plugin=TorchDynamoPlugin(backend=...))``) killed and resumed.

The harness of test_kill.py (its ``runs`` fixture runs the configurations this module selects): a small
GPT-2 compiled by ``accelerator.prepare`` with the ``aot_eager`` backend (Dynamo and AOTAutograd, no code
generation: fast) under ``asymcheck.accelerate.attach``, SIGKILLed after a random optimizer step and
resumed; every loss and the final state equal an uninterrupted compiled run's, bit for bit. The
Checkpointer's forward pre-hooks run eagerly at a graph break (``torch.compiler.disable``), so the
default ``"asymmetric"`` partitioning copies during the compiled forward and backward: each case also
checks that the model ran compiled and that bytes were copied in forward and backward hooks.
One process with ``accumulate()`` runs in ``make test``; 2 processes (DDP, gloo) and ``inductor`` (generated C++
kernels, a compiler on the machine) are ``exhaustive`` (each compiled process costs seconds of compilation).
"""

from __future__ import annotations

import pytest

from tests.asymcheck.accelerate.test_kill import Config, Runs, check_kill_and_resume, runs

__all__ = ["runs"]

pytestmark = pytest.mark.slow

CONFIGS = [
    pytest.param(Config("single", 1, accum=2, compile="aot_eager"), id="single-accum2-aot_eager"),
    pytest.param(Config("ddp", 2, compile="aot_eager"), id="ddp2-aot_eager", marks=pytest.mark.exhaustive),
    pytest.param(Config("single", 1, compile="inductor"), id="single-inductor", marks=pytest.mark.exhaustive),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_compiled_kill_and_resume_bit_exact(runs: Runs, config: Config) -> None:
    check_kill_and_resume(runs, config)
    case = runs.cases[config]
    for job in (case.reference, case.resumed):
        for rank in range(config.world):
            compiled = job.events(rank, "compiled")
            assert compiled and compiled[0]["graphs"] >= 1 and compiled[0]["wrapper"] == "OptimizedModule", \
                f"{config.name}: {job.out.name} rank {rank} did not run compiled: {compiled}"
    for rank in range(config.world):
        stats = case.resumed.events(rank, "stats")[0]
        # the partitions were copied by the hooks inside the compiled forward and backward, not all at the step
        assert stats["partitioning"] == "asymmetric" and stats["forward_bytes"] > 0 and stats["backward_bytes"] > 0, \
            f"{config.name}: rank {rank}: {stats}"
