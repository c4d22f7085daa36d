"""The Checkpointer's typed options as an integration forwards them, with the integration's own retention arguments.

Each entry point (``accelerate.attach``, both ``AsymCheckCallback``) takes the option groups as
``**options: Unpack[CheckpointerOptions]``. :func:`forwarded_options` resolves them once, where the
user called (the deprecated flat keywords warn there, a misspelt one is a ``TypeError`` there),
folds in the integration's own retention arguments (``keep_last``, ``keep_every``, a best-version
rule), and returns every group, so the Checkpointer (or ``deepspeed.attach``) gets groups only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from asymcheck.errors import InvalidOptionError
from asymcheck.options import (
    GROUPS,
    CheckpointerOptions,
    FlatOtherOptions,
    GroupOptions,
    RetentionOptions,
    resolve,
)
from asymstore import KeepBest

__all__ = ["CallbackOptions", "TrainerCallbackOptions", "forwarded_options", "with_retention"]

RETENTION_ARGUMENTS = ("keep_last", "keep_every", "keep_best")
"""The retention fields a callback takes as its own arguments: not in :class:`CallbackOptions`."""


class CallbackOptions(GroupOptions, FlatOtherOptions, total=False):
    """:class:`asymcheck.options.CheckpointerOptions` without ``keep_last``, ``keep_every`` and ``keep_best``.

    What ``asymcheck.lightning.AsymCheckCallback`` takes as ``**options``: its own ``keep_last``,
    ``keep_every`` and ``monitor`` arguments are the retention rules' flat forms there.
    """


class TrainerCallbackOptions(CallbackOptions, total=False):
    """What ``asymcheck.hf.AsymCheckCallback`` takes as ``**options``: its own are ``keep_last`` and ``keep_best``."""

    keep_every: int | None


_DEFAULT = RetentionOptions()


def with_retention(retention: RetentionOptions, caller: str, **own: Any) -> RetentionOptions:
    """``retention`` with the integration's own retention arguments ``own`` (field -> value) applied.

    An argument left at its default changes nothing; one given beside a different value of the
    same field in ``retention`` (not its default) is refused: each rule is given once.

    Raises:
        InvalidOptionError: a rule given both ways, or a value out of range.
    """
    changes: dict[str, Any] = {}
    for name, value in own.items():
        default = getattr(_DEFAULT, name)
        if value == default:
            continue
        held = getattr(retention, name)
        if held != default and held != value:
            raise InvalidOptionError(f"{caller}() got {name}={value!r} beside retention=RetentionOptions("
                                     f"{name}={held!r}): give it once")
        changes[name] = value
    return dataclasses.replace(retention, **changes) if changes else retention


def forwarded_options(caller: str, options: Mapping[str, Any], *, keep_last: int | None = _DEFAULT.keep_last,
                      keep_every: int | None = None, keep_best: KeepBest | None = None,
                      stacklevel: int = 4) -> CheckpointerOptions:
    """Every option group for the Checkpointer: ``options`` resolved, the integration's retention arguments applied.

    Args:
        caller: the entry point, for the messages.
        options: what the user gave as ``**options`` (groups, ``across_layouts``, deprecated flat keywords).
        keep_last: the integration's own ``keep_last`` argument.
        keep_every: the integration's own ``keep_every`` argument.
        keep_best: the integration's own best-version rule.
        stacklevel: of the flat keywords' ``DeprecationWarning``, seen from :func:`asymcheck.options.resolve`
            (4: the user's call of the entry point that called this).

    Raises:
        TypeError: a keyword that is no option.
        InvalidOptionError: a group not of its class, a flat keyword beside its own group, a retention
            rule given both as an argument and in ``retention=``, a value out of range.
    """
    flat = dict(options)
    groups = {name: flat.pop(name, None) for name in GROUPS}
    across = flat.pop("across_layouts", None)
    resolved = resolve(groups, flat, caller=caller, stacklevel=stacklevel)
    retention = with_retention(resolved.retention, caller, keep_last=keep_last, keep_every=keep_every,
                               keep_best=keep_best)
    out: CheckpointerOptions = {
        "retention": retention, "partitions": resolved.partitions, "failures": resolved.failures,
        "preemption": resolved.preemption, "pacing": resolved.pacing, "commits": resolved.commits}
    if across is not None:
        out["across_layouts"] = across
    return out
