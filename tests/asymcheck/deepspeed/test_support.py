"""The DeepSpeed settings attach() and install() refuse, read from real DeepSpeedConfig objects.

A real engine with optimizer offload is refused in tests/asymcheck/deepspeed/test_multirank.py; NVMe offload,
parameter offload, ZeRO++ hpZ and AutoTP cannot be built on this CPU machine, so their refusal is
checked on the configuration DeepSpeed parses for them.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")

from deepspeed.runtime.config import DeepSpeedConfig

from asymcheck.deepspeed.support import unsupported_settings

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 8}


def config(**zero: Any) -> DeepSpeedConfig:
    return DeepSpeedConfig({**BASE, "zero_optimization": {"stage": 3, **zero}})


def test_plain_zero_configs_of_the_tested_version_are_supported() -> None:
    for stage in (0, 1, 2, 3):
        assert unsupported_settings(config(stage=stage), version="0.19.8") == []


@pytest.mark.parametrize(("zero", "named"), [
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "offload_optimizer.device=nvme"),
    ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer.device=cpu"),
    ({"offload_param": {"device": "cpu"}}, "offload_param.device=cpu"),
    ({"zero_hpz_partition_size": 2}, "zero_hpz_partition_size=2"),
])
def test_settings_whose_state_the_capture_misses_are_named(zero: dict[str, Any], named: str) -> None:
    [problem] = unsupported_settings(config(**zero), version="0.19.8")
    assert named in problem


def test_engine_kinds_and_versions_outside_what_is_tested_are_named() -> None:
    problems = unsupported_settings(config(), version="0.20.0", pipeline=True, moe=True, model_parallel=True)
    assert len(problems) == 4
    assert "0.20.0" in problems[0] and "pipeline" in problems[1] and "MoE" in problems[2]
    assert "model parallelism" in problems[3]
