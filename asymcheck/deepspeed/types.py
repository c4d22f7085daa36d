"""DeepSpeed's non-tensor state objects, registered with the pickle-free codec.

DeepSpeed's checkpoint state dicts hold a few plain objects besides dicts,
lists, tuples, ``torch.Size``, dtypes, numbers, strings and tensors: the loss
scaler, ZeRO's stage enum and the parameter fragment addresses. They are
encoded by their attributes (:func:`asymcheck.state.encode.register_type`); nothing
is pickled, and decoding only rebuilds these classes.
"""

from __future__ import annotations

import importlib
import logging

from asymcheck.state.encode import register_type

logger = logging.getLogger(__name__)

_CLASSES = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def register_deepspeed_types() -> list[str]:
    """Register the DeepSpeed classes found in this DeepSpeed version; return their names."""
    done = []
    for module, name in _CLASSES:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            logger.debug("DeepSpeed has no %s.%s here", module, name)
            continue
        register_type(cls)
        done.append(f"{module}.{name}")
    return done
