"""The Checkpointer's options, typed and grouped by concern (frozen dataclasses, checked when built).

``Checkpointer(model, opt, "ckpt", retention=RetentionOptions(keep_last=5), pacing=PacingOptions(max_overhead=None))``;
integrations forward the same groups as ``**options: Unpack[CheckpointerOptions]``, so a misspelt
option is a type error. Each group checks its values when it is built (``InvalidOptionError``).
The flat keywords of earlier releases (``keep_last=5``) still work for one release, with a
``DeprecationWarning`` naming the group (see :data:`FLAT_OPTIONS`). Guide:
docs/guides/checkpointer.md, "Options".
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, get_args

from asymcheck.errors import InvalidOptionError
from asymcheck.policy.failures import ON_ERROR, OnError
from asymcheck.policy.preempt import DEFAULT_DEADLINE_S, PREEMPT_ON, PreemptOn
from asymcheck.snapshot.partition import PARTITIONINGS, Clock, Partitioning
from asymcheck.state.replicas import DEDUPS, Dedup
from asymstore import KeepBest
from asymstore.multirank.rootlayout import AcrossLayouts

__all__ = [
    "FLAT_OPTIONS",
    "CheckpointerOptions",
    "CommitOptions",
    "CopyMode",
    "Dedup",
    "FailureOptions",
    "FlatOptions",
    "Options",
    "PacingOptions",
    "PartitionOptions",
    "PreemptionOptions",
    "RetentionOptions",
    "WhenBusy",
    "renamed_location",
    "resolve",
]

WhenBusy = Literal["wait", "skip"]
CopyMode = Literal["thread", "inline"]
FrozenMode = Literal["copy", "known"]
"""Frozen parameters: ``"copy"`` them at every version, or take them as ``"known"`` unchanged (CommitOptions.frozen)."""


def _int(owner: str, name: str, value: object, *, least: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidOptionError(f"{owner}.{name} must be an int >= {least}{' or None' if optional else ''}, "
                                 f"got {value!r}")


def _positive(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or math.isnan(value):
        raise InvalidOptionError(f"{owner}.{name} must be a number > 0{' or None' if optional else ''}, "
                                 f"got {value!r}")


def _one_of(owner: str, name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidOptionError(f"{owner}.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RetentionOptions:
    """Which committed versions the store keeps (applied when the Checkpointer builds the store itself).

    A store passed in built keeps its own rules. Under several ranks the rules judge global versions.

    Attributes:
        keep_last: the newest versions kept per tier (None: every version).
        keep_every: also keep, permanently on persistent tiers, every version whose step is a
            multiple of it (None: no such rule).
        keep_best: also keep the best versions by a metric given to ``Checkpointer.log_metrics``
            (None: no such rule).

    Raises:
        InvalidOptionError: ``keep_last`` or ``keep_every`` is not an int >= 1 (or None), or
            ``keep_best`` is not a :class:`asymstore.KeepBest`.
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: KeepBest | None = None

    def __post_init__(self) -> None:
        """Check every value."""
        _int("RetentionOptions", "keep_last", self.keep_last, least=1, optional=True)
        _int("RetentionOptions", "keep_every", self.keep_every, least=1, optional=True)
        if self.keep_best is not None and not isinstance(self.keep_best, KeepBest):
            raise InvalidOptionError(f"RetentionOptions.keep_best must be an asymstore.KeepBest or None, "
                                     f"got {self.keep_best!r}")


@dataclass(frozen=True, kw_only=True)
class PartitionOptions:
    """How each version's copy is spread over the next iteration (docs/guides/checkpointer.md, "Partitioning").

    Attributes:
        partitioning: ``"asymmetric"`` sizes partitions to the idle windows measured between hooks,
            ``"uniform"`` cuts equal partitions (as many in the forward as in the backward pass),
            ``"step"`` copies everything in the step pre-hook, blocking. Every mode takes the same
            state, bit for bit.
        warmup: iterations measured before partitions are sized.
        max_partitions: soft limit on partitions per version.
        min_partition_bytes: the smallest partition worth a separate copy.
        replan_tolerance: relative drift of the windows that triggers a re-plan.
        clock: timing source for the windows (None: CUDA events for a CUDA model, ``perf_counter``
            otherwise).

    Raises:
        InvalidOptionError: ``partitioning`` is not one of :data:`asymcheck.PARTITIONINGS`, a count
            is out of its range, or ``clock`` has no ``mark``/``seconds``.
    """

    partitioning: Partitioning = "asymmetric"
    warmup: int = 3
    max_partitions: int = 16
    min_partition_bytes: int = 1 << 20
    replan_tolerance: float = 0.25
    clock: Clock | None = None

    def __post_init__(self) -> None:
        """Check every value."""
        _one_of("PartitionOptions", "partitioning", self.partitioning, PARTITIONINGS)
        _int("PartitionOptions", "warmup", self.warmup, least=1)
        _int("PartitionOptions", "max_partitions", self.max_partitions, least=1)
        _int("PartitionOptions", "min_partition_bytes", self.min_partition_bytes, least=0)
        _positive("PartitionOptions", "replan_tolerance", self.replan_tolerance)
        if self.clock is not None and not (callable(getattr(self.clock, "mark", None))
                                           and callable(getattr(self.clock, "seconds", None))):
            raise InvalidOptionError(f"PartitionOptions.clock must have mark() and seconds(), got {self.clock!r}")


@dataclass(frozen=True, kw_only=True)
class FailureOptions:
    """What a failed background commit does (docs/guides/checkpointer.md, "When commits fail").

    Attributes:
        on_error: ``"budget"`` (logged, counted, retried by the next versions; training stops with
            ``NoDurableVersionError`` only past the budget below; a commit the root's layout refuses
            stops it at the next step as ``"raise"`` does), ``"raise"`` (``CommitFailedError`` at
            the next step) or ``"log"`` (never stops).
        max_steps_without_durable: with ``"budget"``, optimizer steps tolerated without a durable
            version once commits fail (None: no step limit).
        max_seconds_without_durable: the same in seconds (None: no time limit).

    Raises:
        InvalidOptionError: a value out of its range.
    """

    on_error: OnError = "budget"
    max_steps_without_durable: int | None = None
    max_seconds_without_durable: float | None = 1800.0

    def __post_init__(self) -> None:
        """Check every value."""
        _one_of("FailureOptions", "on_error", self.on_error, ON_ERROR)
        _int("FailureOptions", "max_steps_without_durable", self.max_steps_without_durable, least=1, optional=True)
        _positive("FailureOptions", "max_seconds_without_durable", self.max_seconds_without_durable, optional=True)


@dataclass(frozen=True, kw_only=True)
class PreemptionOptions:
    """What a preemption notice does (docs/guides/preemption.md).

    Attributes:
        preempt_on: ``"sigterm"`` (the Checkpointer is then built on the main thread): on SIGTERM
            the next hook commits the newest completed step durably (under several ranks the step
            the ranks agree on), then hands the signal on; ``"none"`` leaves SIGTERM alone.
        preempt_deadline_s: how long, from the notice, the flush may wait for commits and
            persistent copies before it hands the signal on all the same (None: no limit).

    Raises:
        InvalidOptionError: ``preempt_on`` is not a mode, or the deadline is not > 0 (or None).
    """

    preempt_on: PreemptOn = "sigterm"
    preempt_deadline_s: float | None = DEFAULT_DEADLINE_S

    def __post_init__(self) -> None:
        """Check every value."""
        _one_of("PreemptionOptions", "preempt_on", self.preempt_on, PREEMPT_ON)
        _positive("PreemptionOptions", "preempt_deadline_s", self.preempt_deadline_s, optional=True)


@dataclass(frozen=True, kw_only=True)
class PacingOptions:
    """Which steps become versions beyond ``every`` (docs/guides/checkpointer.md, "Pacing").

    Attributes:
        max_overhead: the step-time budget of checkpointing, as a fraction of the step without it.
            After 50 steps and every 200 after, 3 steps take no version to measure the step alone;
            past the budget, versions are taken every few steps instead (``stats().pacing``).
            None: a version every ``every`` steps, always.
        save_on_close: ``close()`` saves the final step even when it is not a multiple of ``every``.

    Raises:
        InvalidOptionError: ``max_overhead`` is not > 0 (or None), or ``save_on_close`` not a bool.
    """

    max_overhead: float | None = 0.05
    save_on_close: bool = True

    def __post_init__(self) -> None:
        """Check every value."""
        _positive("PacingOptions", "max_overhead", self.max_overhead, optional=True)
        if not isinstance(self.save_on_close, bool):
            raise InvalidOptionError(f"PacingOptions.save_on_close must be a bool, got {self.save_on_close!r}")


@dataclass(frozen=True, kw_only=True)
class CommitOptions:
    """Host memory and background commits: how many versions are staged and committed at once.

    Attributes:
        max_inflight: background commits running at once.
        when_busy: a version sealed while ``max_inflight`` commits run: ``"wait"`` (back-pressure)
            or ``"skip"`` it (never under several ranks: a version one rank skips is never global).
        host_slots: host staging buffers, each the size of the flat state. With 2 the next version
            is copied during the next step even while the last one commits; with 1 (half the
            memory) a version opened meanwhile is copied once that commit gives the slot back.
        copy: ``"thread"`` (a copy thread) or ``"inline"`` (copies inside the hooks).
        dedup: state that is the same on every rank of a multi-rank store (a ``DistributedDataParallel``
            model's parameters and optimizer state): ``"replicas"`` (default) cuts it into balanced
            slices and each rank copies, hashes and writes only its own (bytes per rank about
            ``1 / world``; the replicas are compared across ranks, in full in the first versions, and a
            job whose replicas differ falls back to whole copies with a WARNING); ``"off"``: every
            rank writes all of it (docs/guides/multirank.md, "Replicated state").
        frozen: parameters with ``requires_grad`` off and in no optimizer param group: ``"copy"``
            (default) copies and hashes them at every version like everything else (tiers that
            reference unchanged bytes still write them once); ``"known"`` copies them to host once and
            takes them as unchanged while their object, address and version counter stay the same and
            the edit detector's sample agrees, so a version does not read them again (a GPU run's
            frozen base no longer crosses PCIe at every step). ``"known"`` cannot see an edit through
            ``p.data`` (which moves no version counter) that the sample misses, such as a teacher
            model updated by ``param.data.mul_(m).add_(...)``: use it only when frozen parameters are
            never written that way outside ``ckpt.editing()`` (docs/guides/checkpointer.md,
            "Frozen parameters").

    Raises:
        InvalidOptionError: a value out of its range.
    """

    max_inflight: int = 1
    when_busy: WhenBusy = "wait"
    host_slots: int = 2
    copy: CopyMode = "thread"
    dedup: Dedup = "replicas"
    frozen: FrozenMode = "copy"

    def __post_init__(self) -> None:
        """Check every value."""
        _int("CommitOptions", "max_inflight", self.max_inflight, least=1)
        _one_of("CommitOptions", "when_busy", self.when_busy, get_args(WhenBusy))
        _int("CommitOptions", "host_slots", self.host_slots, least=1)
        _one_of("CommitOptions", "copy", self.copy, get_args(CopyMode))
        _one_of("CommitOptions", "dedup", self.dedup, DEDUPS)
        _one_of("CommitOptions", "frozen", self.frozen, get_args(FrozenMode))


GROUPS: dict[str, type[Any]] = {
    "retention": RetentionOptions,
    "partitions": PartitionOptions,
    "failures": FailureOptions,
    "preemption": PreemptionOptions,
    "pacing": PacingOptions,
    "commits": CommitOptions,
}

GROUP_ONLY = frozenset({"dedup", "frozen"})
"""Fields added after the flat keywords were deprecated: given inside their group only, never flat."""

FLAT_OPTIONS: dict[str, str] = {
    field.name: group for group, cls in GROUPS.items() for field in dataclasses.fields(cls)
    if field.name not in GROUP_ONLY
}
"""Each deprecated flat keyword -> the group parameter whose field of the same name replaces it."""


class GroupOptions(TypedDict, total=False):
    """The group parameters of :class:`asymcheck.Checkpointer` (and ``across_layouts``), as keywords to forward."""

    retention: RetentionOptions
    partitions: PartitionOptions
    failures: FailureOptions
    preemption: PreemptionOptions
    pacing: PacingOptions
    commits: CommitOptions
    across_layouts: AcrossLayouts


class FlatOtherOptions(TypedDict, total=False):
    """The deprecated flat keywords but the retention ones (which some integrations take as their own arguments)."""

    partitioning: Partitioning
    warmup: int
    max_partitions: int
    min_partition_bytes: int
    replan_tolerance: float
    clock: Clock | None
    on_error: OnError
    max_steps_without_durable: int | None
    max_seconds_without_durable: float | None
    preempt_on: PreemptOn
    preempt_deadline_s: float | None
    max_overhead: float | None
    save_on_close: bool
    max_inflight: int
    when_busy: WhenBusy
    host_slots: int
    copy: CopyMode


class FlatOptions(FlatOtherOptions, total=False):
    """The flat keywords of earlier releases, deprecated: each is the field of the same name of a group.

    ``keep_last=5`` is ``retention=RetentionOptions(keep_last=5)``; :data:`FLAT_OPTIONS` maps each
    keyword to its group. They work for one release, with a ``DeprecationWarning``.
    """

    keep_last: int | None
    keep_every: int | None
    keep_best: KeepBest | None


class CheckpointerOptions(GroupOptions, FlatOptions, total=False):
    """The options an integration forwards to the Checkpointer: ``**options: Unpack[CheckpointerOptions]``.

    Every group parameter (and ``across_layouts``) of :class:`asymcheck.Checkpointer`, plus the
    deprecated flat keywords of :class:`FlatOptions`; a key not listed is a type error. ``every``,
    ``stateful`` and ``data`` are the integration's own parameters, not in here.
    """


@dataclass(frozen=True, kw_only=True)
class Options:
    """Every group, resolved (the defaults where a group was not given); what the Checkpointer runs with."""

    retention: RetentionOptions = RetentionOptions()
    partitions: PartitionOptions = PartitionOptions()
    failures: FailureOptions = FailureOptions()
    preemption: PreemptionOptions = PreemptionOptions()
    pacing: PacingOptions = PacingOptions()
    commits: CommitOptions = CommitOptions()


def resolve(groups: Mapping[str, object], flat: Mapping[str, Any], *, caller: str = "Checkpointer",
            stacklevel: int = 3) -> Options:
    """The groups given, with the deprecated flat keywords folded into the groups they belong to.

    Args:
        groups: group parameter name -> the group given, or None (its defaults).
        flat: deprecated flat keyword -> value (each warns, naming its group).
        caller: who took them, for the messages.
        stacklevel: of the ``DeprecationWarning`` (the user's call, seen from here).

    Raises:
        TypeError: a keyword that is neither a group nor a flat option (as Python says of a misspelt one).
        InvalidOptionError: a group is not of its class, a flat keyword is given beside its own
            group, or a value is out of range.
    """
    unknown = sorted(set(flat) - set(FLAT_OPTIONS))
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    values: dict[str, Any] = {}
    for name, cls in GROUPS.items():
        given = groups.get(name)
        if given is not None and not isinstance(given, cls):
            raise InvalidOptionError(f"{caller}({name}=...) takes an asymcheck.{cls.__name__}, got {given!r}")
        values[name] = given if given is not None else cls()
    moved: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        group = FLAT_OPTIONS[key]
        if groups.get(group) is not None:
            raise InvalidOptionError(f"{caller}() got {key}= beside {group}=: give {key} inside {group}= only")
        moved.setdefault(group, {})[key] = value
    for group, fields in moved.items():
        cls = GROUPS[group]
        new = f"{group}={cls.__name__}({', '.join(f'{k}=...' for k in fields)})"
        warnings.warn(f"{caller}({', '.join(f'{k}=...' for k in fields)}) is deprecated and goes in the next "
                      f"release: pass {new} (from asymcheck.options)", DeprecationWarning, stacklevel=stacklevel)
        values[group] = dataclasses.replace(values[group], **fields)
    return Options(**values)


def renamed_location(location: object, old_value: object, *, old: str, caller: str, stacklevel: int = 3) -> Any:
    """Where the checkpoint lives: ``location``, or the value given under its former keyword ``old`` (deprecated).

    Every entry point names the parameter ``location``; the former names (``store_or_tiers``,
    ``root_or_store``) work for one release, with a ``DeprecationWarning``.

    Args:
        location: the value given as ``location`` (None: not given).
        old_value: the value given under the former keyword (None: not given).
        old: the former keyword, for the messages.
        caller: who took them, for the messages.
        stacklevel: of the ``DeprecationWarning`` (the user's call, seen from here).

    Raises:
        TypeError: both are given, or neither (as Python says of a missing argument).
    """
    if old_value is not None:
        if location is not None:
            raise TypeError(f"{caller}() got both location= and its former name {old}=")
        warnings.warn(f"{caller}({old}=...) is deprecated and goes in the next release: pass location=... "
                      "(or the location positionally)", DeprecationWarning, stacklevel=stacklevel)
        return old_value
    if location is None:
        raise TypeError(f"{caller}() missing the argument 'location' (where the checkpoint lives)")
    return location
