"""asymcheck: per-iteration asymmetric snapshots of PyTorch training into asymstore.

Quick start::

    from asymcheck import Checkpointer

    with Checkpointer(model, optimizer, "ckpt", stateful={"sched": scheduler}) as ckpt:
        start = ckpt.resume() or 0          # optimizer steps already done
        for step in range(start, total_steps):
            ...                             # forward, backward, optimizer.step(), scheduler.step()
    # leaving the block commits the last step
"""

import warnings
from typing import Any

from asymcheck.checkpointer import Checkpointer, RestoreInfo
from asymcheck.errors import (
    AsymcheckError,
    CheckpointerStateError,
    CommitFailedError,
    InvalidOptionError,
    NoDurableVersionError,
    StateMismatchError,
    StepConflictError,
    UnsupportedConfigError,
    UnsupportedModelError,
    UnsupportedStateError,
)
from asymcheck.integrations.sampler import ResumableDistributedSampler
from asymcheck.options import (
    CheckpointerOptions,
    CommitOptions,
    FailureOptions,
    PacingOptions,
    PartitionOptions,
    PreemptionOptions,
    RetentionOptions,
)
from asymcheck.policy.preempt import PreemptionRecord
from asymcheck.snapshot.edits import DroppedVersionWarning
from asymcheck.snapshot.partition import PARTITIONINGS, Partitioning, Plan
from asymcheck.state.trainstate import Stateful
from asymcheck.stats import CheckpointStats, StepRecord

__all__ = [
    "PARTITIONINGS",
    "AsymcheckError",
    "CheckpointStats",
    "Checkpointer",
    "CheckpointerOptions",
    "CheckpointerStateError",
    "CommitFailedError",
    "CommitOptions",
    "DroppedVersionWarning",
    "FailureOptions",
    "InvalidOptionError",
    "NoDurableVersionError",
    "PacingOptions",
    "PartitionOptions",
    "Partitioning",
    "Plan",
    "PreemptionOptions",
    "PreemptionRecord",
    "RestoreInfo",
    "ResumableDistributedSampler",
    "RetentionOptions",
    "StateMismatchError",
    "Stateful",
    "StepConflictError",
    "StepRecord",
    "UnsupportedConfigError",
    "UnsupportedModelError",
    "UnsupportedStateError",
]

_MOVED = {name: "asymcheck.snapshot.partition" for name in
          ("Extent", "Partition", "Planner", "Span", "Window", "WindowRecorder", "plan_partitions")}
"""Names no longer exported here (the planner's internals), with the module they live in."""


def __getattr__(name: str) -> Any:
    """The names moved out of ``asymcheck`` (see ``_MOVED``), with a DeprecationWarning; removed next release."""
    if name in _MOVED:
        import importlib

        warnings.warn(f"asymcheck.{name} is deprecated: import it from {_MOVED[name]}", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
