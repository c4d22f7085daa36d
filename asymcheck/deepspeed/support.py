"""Which DeepSpeed engines ``attach()`` and ``install()`` capture correctly; everything else is refused.

The adapters are tested (tests/asymcheck/deepspeed/test_multirank.py) with DeepSpeed
0.19 on the CPU accelerator and gloo, 1 and 2 ranks, ZeRO stages 0-3 with
fp32 training, data parallelism only. Settings whose state lives where the
capture does not look (offloaded optimizer state or parameters, expert
parallel MoE layers, pipeline stages, model-parallel groups, hierarchical
ZeRO++ partitions) are refused with :class:`UnsupportedConfigError` naming
the setting, before anything is hooked, instead of producing versions that
silently miss state.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from asymcheck.errors import UnsupportedConfigError

logger = logging.getLogger(__name__)

Api = Literal["attach", "install"]
TESTED = (0, 19)  # major, minor of the DeepSpeed versions the tests exercise (pyproject.toml: >=0.19,<0.20)


def _device(offload: Any) -> str:
    if offload is None:
        return "none"
    device = getattr(offload, "device", "none")
    return str(getattr(device, "value", device))


def unsupported_settings(config: Any, *, version: str, pipeline: bool = False, moe: bool = False,
                         model_parallel: bool = False) -> list[str]:
    """The settings of a DeepSpeed configuration the adapters do not capture correctly.

    Args:
        config: a ``deepspeed.runtime.config.DeepSpeedConfig`` (``engine._config``).
        version: ``deepspeed.__version__``.
        pipeline: the engine trains a ``PipelineModule``.
        moe: the model has MoE layers.
        model_parallel: the engine was given model-parallel groups (``mpu``).

    Returns:
        One line per refused setting (empty: supported).
    """
    out: list[str] = []
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    if (major, minor) != TESTED:
        out.append(f"deepspeed {version}: only {TESTED[0]}.{TESTED[1]}.x is tested")
    zero = getattr(config, "zero_config", None)
    if zero is not None:
        if _device(getattr(zero, "offload_optimizer", None)) != "none":
            out.append(f"zero_optimization.offload_optimizer.device={_device(zero.offload_optimizer)}"
                       " (optimizer state offloaded out of the tensors the capture reads)")
        if _device(getattr(zero, "offload_param", None)) != "none":
            out.append(f"zero_optimization.offload_param.device={_device(zero.offload_param)}"
                       " (parameters offloaded out of the tensors the capture reads)")
        if int(getattr(zero, "zero_hpz_partition_size", 1) or 1) > 1:
            out.append(f"zero_optimization.zero_hpz_partition_size={zero.zero_hpz_partition_size} (ZeRO++ secondary "
                       "partitions)")
    if pipeline:
        out.append("pipeline parallelism (a PipelineModule engine)")
    if moe:
        out.append("MoE layers (expert-parallel state files)")
    if model_parallel:
        out.append("model parallelism (an mpu / tensor-parallel groups)")
    tp = getattr(getattr(config, "tensor_parallel_config", None), "autotp_size", 0) or 0
    if int(tp) > 1:
        out.append(f"tensor_parallel.autotp_size={tp}")
    return out


def check_engine(engine: Any, api: Api) -> None:
    """Refuse an engine whose configuration ``api`` does not capture correctly.

    Raises:
        UnsupportedConfigError: naming every unsupported setting.
    """
    import deepspeed

    problems = unsupported_settings(getattr(engine, "_config", None), version=deepspeed.__version__,
                                    pipeline=bool(getattr(engine, "pipeline_parallelism", False)),
                                    moe=bool(getattr(engine, "has_moe_layers", False)),
                                    model_parallel=getattr(engine, "mpu", None) is not None)
    if problems:
        raise UnsupportedConfigError(f"asymcheck.deepspeed.{api}() does not capture this engine correctly: "
                                     + "; ".join(problems))
