"""asymcheck: per-iteration asymmetric snapshots of PyTorch training into asymstore.

Quick start::

    from asymcheck import Checkpointer

    with Checkpointer(model, optimizer, "ckpt", stateful={"sched": scheduler}) as ckpt:
        start = ckpt.resume() or 0          # optimizer steps already done
        for step in range(start, total_steps):
            ...                             # forward, backward, optimizer.step(), scheduler.step()
    # leaving the block commits the last step
"""

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
from asymcheck.policy.preempt import PreemptionRecord
from asymcheck.snapshot.edits import DroppedVersionWarning
from asymcheck.snapshot.partition import (
    PARTITIONINGS,
    Extent,
    Partition,
    Partitioning,
    Plan,
    Planner,
    Span,
    Window,
    WindowRecorder,
    plan_partitions,
)
from asymcheck.state.trainstate import Stateful
from asymcheck.stats import CheckpointStats, StepRecord

__all__ = [
    "PARTITIONINGS",
    "AsymcheckError",
    "CheckpointStats",
    "Checkpointer",
    "CheckpointerStateError",
    "CommitFailedError",
    "DroppedVersionWarning",
    "Extent",
    "InvalidOptionError",
    "NoDurableVersionError",
    "Partition",
    "Partitioning",
    "Plan",
    "Planner",
    "PreemptionRecord",
    "RestoreInfo",
    "Span",
    "StateMismatchError",
    "Stateful",
    "StepConflictError",
    "StepRecord",
    "UnsupportedConfigError",
    "UnsupportedModelError",
    "UnsupportedStateError",
    "Window",
    "WindowRecorder",
    "plan_partitions",
]
