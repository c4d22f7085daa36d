"""Errors raised by asymcheck; every one derives from :class:`asymstore.AsymstoreError`."""

from __future__ import annotations

from asymstore.errors import AsymstoreError


class AsymcheckError(AsymstoreError):
    """Root of the errors asymcheck raises on purpose."""


class StateMismatchError(AsymcheckError, ValueError):
    """A checkpoint does not fit the live model, optimizer or stateful objects.

    Raised by ``resume()`` before anything is loaded: the live objects are unchanged.
    """


class UnsupportedStateError(AsymcheckError, TypeError):
    """A state dict holds a value that cannot be stored without pickle."""


class CommitFailedError(AsymcheckError):
    """A background commit of a version failed on the durable tier."""


class CheckpointerStateError(AsymcheckError, RuntimeError):
    """The Checkpointer was used out of order (closed, or resumed after training began)."""


class StagingError(AsymcheckError, RuntimeError):
    """A DCP staging copy (``asymcheck.dcp.Stager``) was not taken: the save it belongs to writes nothing.

    A tensor changed before its copy finished, no host slot came free in time, or the stager is closed.
    """


class StepConflictError(AsymcheckError):
    """The store already holds a version at or after the step this run would write.

    Call ``resume()`` first, or point the Checkpointer at a fresh directory.
    """


class UnsupportedModelError(AsymcheckError, TypeError):
    """The model or optimizer holds tensors the lazy copy cannot read safely (a tensor subclass such as DTensor).

    Raised when the Checkpointer is constructed, before any hook is registered.
    """


class InvalidOptionError(AsymcheckError, ValueError):
    """An option of the Checkpointer (or of a part it is built from) has a value it does not take.

    The message names the option and the values it takes; raised by the constructor, before
    anything is hooked (``Checkpointer(partitioning="blocks")``).
    """


class UnsupportedConfigError(AsymcheckError, ValueError):
    """A DeepSpeed configuration (or version) the adapter does not capture correctly; the message names the setting.

    Raised by ``attach()`` and ``install()`` before anything is hooked.
    """


class NoDurableVersionError(CommitFailedError):
    """Background commits kept failing and no version became durable within the failure budget.

    Raised at the next optimizer step (or ``close()``); see ``Checkpointer(max_steps_without_durable=...,
    max_seconds_without_durable=...)``.
    """


# -- DeepSpeed -------------------------------------------------------------------


class DeepSpeedExportError(AsymcheckError):
    """The location holds no exportable DeepSpeed version, or a file name would leave the output directory."""


class NotInStoreError(AsymcheckError, FileNotFoundError):
    """A DeepSpeed checkpoint file asked for is not in any committed version of the store."""


# -- Accelerate ------------------------------------------------------------------


class UnsupportedAccelerateConfigError(UnsupportedConfigError):
    """An Accelerate setting (or version) ``asymcheck.accelerate.attach()`` does not capture correctly.

    The message names the setting; raised before anything is hooked. The refused settings:
    docs/guides/accelerate.md.
    """


class DataPositionError(AsymcheckError, RuntimeError):
    """A loader given to ``asymcheck.accelerate.attach(data=...)`` is iterated directly: its position is unknown.

    Raised when a version takes the position; iterate the ``ResumableLoader`` (``ckpt.loader``) instead.
    """


# -- Hugging Face Trainer --------------------------------------------------------


class UnsupportedTrainerConfigError(UnsupportedConfigError):
    """A Trainer setting ``asymcheck.hf.AsymCheckCallback`` does not capture, or resume, exactly.

    The message names the ``TrainingArguments`` field (or the model kind); raised by
    ``resume_from()`` and at ``on_train_begin``, before anything is hooked. The refused settings:
    docs/guides/hf-trainer.md.
    """


class TrainerResumeError(AsymcheckError, RuntimeError):
    """The Trainer did not start where the store's version is, so the callback refuses to train on.

    ``train()`` was not given ``resume_from(trainer)``'s directory while the store holds
    versions, it resumed from another directory (its own ``checkpoint-N``), or the version
    ``resume_from()`` chose failed verification when it was loaded. Raised at ``on_train_begin``,
    before the first step.
    """


# -- Lightning -------------------------------------------------------------------


class UnsupportedLightningConfigError(UnsupportedConfigError):
    """A Lightning setting (or version) ``asymcheck.lightning.AsymCheckCallback`` does not capture correctly.

    The message names the setting; raised when ``fit`` starts, before anything is hooked. The refused
    settings: docs/guides/lightning.md.
    """


# -- the data position (Lightning, Accelerate, HF Trainer) -----------------------


class UnresumableDataError(AsymcheckError, ValueError):
    """A train loader whose position a resume could not set back exactly; the message names it and what would differ.

    Raised before the first training step (Lightning: ``on_train_start``; Accelerate: ``attach()``;
    HF Trainer: ``on_train_begin``). Each integration has an option that trains anyway and warns
    with :class:`InexactResumeWarning` naming the same (Lightning: ``AsymCheckCallback(inexact_data="warn")``).
    """


class InexactResumeWarning(UserWarning):
    """A resume will not continue the data exactly as an uninterrupted run would; the message says what differs."""


# -- TorchTitan ------------------------------------------------------------------


class UnsupportedTorchTitanConfigError(UnsupportedConfigError):
    """A TorchTitan setting (or version) ``asymcheck.torchtitan.AsymCheckManager`` does not capture correctly.

    The message names the setting (a ``checkpoint.`` field, or what the trainer handed the manager); raised
    when the trainer builds the manager, before anything is hooked. The refused settings:
    docs/guides/torchtitan.md.
    """


# -- Ray Train -------------------------------------------------------------------


class UnsupportedRayConfigError(UnsupportedConfigError):
    """A Ray Train setting (or version) ``asymcheck.ray.RayCheckpointer`` does not capture correctly.

    The message names the setting; raised when the RayCheckpointer is built, before anything is hooked. The
    refused settings: docs/guides/ray.md.
    """


class RayPointerError(AsymcheckError, ValueError):
    """A Ray checkpoint's pointer file (``asymcheck.json``) is missing, malformed, or names another root."""


class RayPreemptionTimeoutError(AsymcheckError, RuntimeError):
    """After a preemption flush, Ray Train did not end the attempt within the wait allowed.

    Raised from the training function instead of waiting forever: the attempt then ends as a worker failure,
    and the next one resumes from the flushed version all the same.
    """
