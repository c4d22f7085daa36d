"""asymcheck for Ray Train: the workers of a ``TorchTrainer`` take a version every step on a shared root.

Inside the training function (Ray Train V2, the default of ray 2.60)::

    with asymcheck.ray.RayCheckpointer(model, optimizer, "/shared/ckpt") as ckpt:
        start = ckpt.resume() or 0              # the newest version that verifies, after any restart
        for step in range(start, total):
            ...                                 # forward, backward, optimizer.step()
            ckpt.report({"loss": loss.item()})  # ray.train.report + a pointer to the newest published version
            ckpt.check_preemption()             # Ray's drain notice: the agreed flush

Ray tracks pointers (``asymcheck.json``: root, step, world size, metrics), never copies of the state; the
Checkpointer underneath is the multi-rank one, coordinated through the TCPStore of the process group Ray
set up. What is captured, what is refused and why: docs/guides/ray.md. Importing this module imports ray.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Unpack

import ray
import ray.train
import torch

from asymcheck.checkpointer import Checkpointer
from asymcheck.errors import RayPointerError, RayPreemptionTimeoutError, UnsupportedRayConfigError
from asymcheck.integrations import support
from asymcheck.integrations.settings import RAY, refusal
from asymcheck.options import CheckpointerOptions, PreemptionOptions
from asymcheck.policy.preempt import PreemptionRecord
from asymcheck.state.replicas import Replication
from asymcheck.state.trainstate import Stateful
from asymstore.format.names import is_uri
from asymstore.protocols import CollectiveStore

logger = logging.getLogger(__name__)

__all__ = ["POINTER_FILE", "STEP_METRIC", "RayCheckpointer", "RayPointerError", "RayPreemptionTimeoutError",
           "UnsupportedRayConfigError", "VersionPointer", "ray_problems", "read_pointer"]

POINTER_FILE = "asymcheck.json"
"""The file a Ray checkpoint of this integration holds (nothing else)."""

STEP_METRIC = "asymcheck_step"
"""The metric a report with a checkpoint adds: the step of the version the checkpoint names."""

_FORMAT = 1
_POINTER_MAX_BYTES = 64 * 1024
_WAIT_POLL_S = 0.5


@dataclass(frozen=True)
class VersionPointer:
    """What a Ray checkpoint of :class:`RayCheckpointer` holds: where a published version is, not its bytes.

    Attributes:
        root: the absolute path of the checkpoint root (a directory every worker sees).
        step: the version's step (optimizer steps completed).
        world_size: the number of ranks that wrote it.
        metrics: the numbers :meth:`RayCheckpointer.report` was given at that step (empty when it was not
            called at that step).
    """

    root: str
    step: int
    world_size: int
    metrics: Mapping[str, float]

    def to_json(self) -> str:
        """The pointer file's text (strict JSON)."""
        return json.dumps({"format": _FORMAT, "root": self.root, "step": self.step, "world_size": self.world_size,
                           "metrics": dict(self.metrics)}, allow_nan=False, sort_keys=True)

    @classmethod
    def parse(cls, raw: bytes, where: str) -> VersionPointer:
        """Read a pointer file's bytes (untrusted input: strict JSON of the exact shape).

        Raises:
            RayPointerError: anything else, naming ``where``.
        """
        def bad(why: str) -> RayPointerError:
            return RayPointerError(f"{where}: not an asymcheck pointer ({why})")

        def no_constant(name: str) -> Any:
            raise bad(f"{name} is not strict JSON")

        try:
            doc = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise bad(str(exc)) from None
        if not isinstance(doc, dict) or set(doc) != {"format", "root", "step", "world_size", "metrics"}:
            raise bad("keys format, root, step, world_size and metrics expected")
        if doc["format"] != _FORMAT:
            raise bad(f"format {doc['format']!r}, this release reads {_FORMAT}")
        root, step, world, metrics = doc["root"], doc["step"], doc["world_size"], doc["metrics"]
        if not isinstance(root, str) or not os.path.isabs(root) or "\0" in root:
            raise bad("root must be an absolute path")
        for name, value in (("step", step), ("world_size", world)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "step" else 1):
                raise bad(f"{name} {value!r}")
        if not isinstance(metrics, dict) or not all(
                isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for k, v in metrics.items()):
            raise bad("metrics must map names to finite numbers")
        return cls(root, step, world, {k: float(v) for k, v in metrics.items()})


def _read_pointer_file(directory: str) -> VersionPointer:
    path = os.path.join(directory, POINTER_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise RayPointerError(f"{path}: the Ray checkpoint holds no asymcheck pointer ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > _POINTER_MAX_BYTES:
            raise RayPointerError(f"{path}: not a regular file of at most {_POINTER_MAX_BYTES} bytes")
        raw = f.read(_POINTER_MAX_BYTES + 1)
    return VersionPointer.parse(raw, path)


def read_pointer(checkpoint: ray.train.Checkpoint | str | os.PathLike[str]) -> VersionPointer:
    """The version a Ray checkpoint of :class:`RayCheckpointer` names.

    Args:
        checkpoint: a ``ray.train.Checkpoint`` (``ray.train.get_checkpoint()``, ``result.checkpoint``; on
            remote storage it is fetched into a temporary directory first) or a local directory.

    Raises:
        RayPointerError: the checkpoint holds no pointer, or one that is not valid.
    """
    if isinstance(checkpoint, ray.train.Checkpoint):  # before PathLike: it has an __fspath__ that raises
        with checkpoint.as_directory() as directory:
            return _read_pointer_file(directory)
    return _read_pointer_file(os.fspath(checkpoint))


def ray_problems(root: str | os.PathLike[str]) -> list[str]:
    """One line per Ray Train setting :class:`RayCheckpointer` refuses here (empty: supported).

    The settings and why: :data:`asymcheck.integrations.settings.RAY`.
    """
    problems = support.version_problems("ray", ray.__version__)
    if is_uri(os.fspath(root)):
        problems.append(refusal(RAY, "a URI root").line(f"root {os.fspath(root)!r}"))
    if not hasattr(ray.train, "get_preemption_info"):  # only Ray Train V2 exports it
        problems.append(refusal(RAY, "RAY_TRAIN_V2_ENABLED=0").line())
        return problems
    try:
        world = int(ray.train.get_context().get_world_size())
    except RuntimeError:  # Ray: "get_context cannot be used outside of a Ray Train training function"
        problems.append(refusal(RAY, "outside a Ray Train worker").line())
        return problems
    if world > 1:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            problems.append(refusal(RAY, "no torch.distributed process group").line())
        elif "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            problems.append(refusal(RAY, "TorchConfig(init_method='tcp')").line())
    return problems


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics a version can carry: names with finite numbers (the rest goes to Ray only)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class RayCheckpointer:
    """A :class:`asymcheck.Checkpointer` inside a Ray Train worker, reporting its versions to Ray as pointers.

    Build it in the training function of a ``ray.train.torch.TorchTrainer`` (every worker, after the model
    and optimizer; wrap the model in ``DistributedDataParallel`` first when there are several workers):
    Ray has set up the gloo/NCCL process group and ``MASTER_ADDR``/``MASTER_PORT``, so on a directory the
    Checkpointer is the multi-rank one (a ``RankStore``: each rank commits its shard, rank 0 publishes the
    global version once every rank has). SIGTERM is left alone by default (the training function runs on a
    thread of Ray's worker, where no handler can be installed); Ray's own preemption notice is
    :meth:`check_preemption`.

    Args:
        model: the module trained (the ``DistributedDataParallel`` wrapper, or the module with
            ``replication="replicated"``).
        optimizer: its optimizer.
        root: the checkpoint root: a directory every worker sees (shared storage on several nodes).
        stateful: as :class:`asymcheck.Checkpointer`'s.
        data: as :class:`asymcheck.Checkpointer`'s.
        every: as :class:`asymcheck.Checkpointer`'s.
        replication: as :class:`asymcheck.Checkpointer`'s.
        **options: the Checkpointer's option groups (``preemption`` defaults to
            ``PreemptionOptions(preempt_on="none")``).

    Raises:
        UnsupportedRayConfigError: a refused setting (docs/guides/ray.md): nothing was hooked.

    Attributes:
        checkpointer: the Checkpointer underneath (``stats()``, ``versions()``, ``restored``, ``preempted``).
        ray_pointer: the pointer of Ray's latest checkpoint when :meth:`resume` ran (None: Ray had none).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: str | os.PathLike[str], *,
                 stateful: Mapping[str, Stateful] | None = None, data: Mapping[str, Stateful] | None = None,
                 every: int = 1, replication: Replication = "detect",
                 **options: Unpack[CheckpointerOptions]) -> None:
        """Check the Ray Train setup, then build the Checkpointer on ``root``."""
        support.require_supported(ray_problems(root), UnsupportedRayConfigError,
                                  "asymcheck.ray.RayCheckpointer does not capture this Ray Train job correctly")
        context = ray.train.get_context()
        self.rank = int(context.get_world_rank())
        self.world_size = int(context.get_world_size())
        self.root = os.path.abspath(os.fspath(root))
        if not {"preemption", "preempt_on", "preempt_deadline_s"} & set(options):
            options["preemption"] = PreemptionOptions(preempt_on="none")
        self.checkpointer = Checkpointer(model, optimizer, self.root, stateful=stateful, data=data, every=every,
                                         replication=replication, **options)
        self.ray_pointer: VersionPointer | None = None
        self._reported: int | None = None  # the newest step a Ray checkpoint names
        self._metrics: dict[int, dict[str, float]] = {}  # rank 0: the numbers reported at steps not yet published

    @property
    def step(self) -> int:
        """Optimizer steps completed (the Checkpointer's)."""
        return self.checkpointer.step

    def resume(self) -> int | None:
        """Load the newest version that verifies; checked against Ray's latest checkpoint first.

        Ray's latest checkpoint (``ray.train.get_checkpoint()``) is read before anything is loaded: a pointer
        to another root is refused, and a pointer into a root that holds no version too (a fresh start there
        would silently train from scratch in a run Ray resumes). The version loaded is the store's newest that
        verifies, which is normally the pointer's or newer (versions published after Ray's last report); an
        older one (the pointer's failed verification) is logged as a WARNING.

        Returns:
            The restored step, or None on a fresh start.

        Raises:
            RayPointerError: see above; nothing was loaded.
            Everything :meth:`asymcheck.Checkpointer.resume` raises.
        """
        latest = ray.train.get_checkpoint()
        pointer = None if latest is None else read_pointer(latest)
        if pointer is not None and pointer.root != self.root:
            raise RayPointerError(f"Ray's latest checkpoint names root {pointer.root}, this job's root is {self.root}: "
                                  "resume from the root the run was started with")
        self.ray_pointer = pointer
        step = self.checkpointer.resume()
        if pointer is not None:
            if step is None:
                raise RayPointerError(f"Ray's latest checkpoint names step {pointer.step} of {self.root}, which holds "
                                      "no version: refusing to start the run again from scratch")
            if step < pointer.step:
                logger.warning("Ray's latest checkpoint names step %d; resumed step %d, the newest version of %s "
                               "that verifies", pointer.step, step, self.root)
        steps = [s for s in (step, None if pointer is None else pointer.step) if s is not None]
        self._reported = max(steps) if steps else None
        return step

    def report(self, metrics: Mapping[str, Any]) -> int | None:
        """``ray.train.report(metrics)`` from every worker, with a pointer to a newly published version attached.

        The numbers in ``metrics`` also go into the current step's version (``meta["metrics"]``, where
        ``keep_best`` reads them). Rank 0 attaches a checkpoint when a version newer than the last one
        reported was published: a directory holding only :data:`POINTER_FILE` (root, step, world size and
        the numbers reported at that step), and adds :data:`STEP_METRIC` to the metrics. The version is
        committed in the background while the next iteration runs, so the step it names is at most the
        current one (usually one or two before it); Ray's other metrics are the current step's. Every
        worker must call it the same number of times (Ray's report is a barrier).

        Returns:
            The step of the version attached (rank 0), else None.
        """
        numbers = _numbers(metrics)
        if numbers:
            self.checkpointer.log_metrics(numbers)
        if self.rank == 0:
            self._metrics[self.checkpointer.step] = numbers
        return self._report(dict(metrics))

    def _published(self) -> int | None:
        """The newest published step (rank 0; None elsewhere and before the first)."""
        store = self.checkpointer.store
        if isinstance(store, CollectiveStore):
            return store.published_step if store.is_coordinator else None
        final = self.checkpointer.final_versions  # set once closed (or preempted): the store is gone then
        steps = [s for tier in (self.checkpointer.versions() if final is None else final).values() for s in tier]
        return max(steps) if steps else None

    def _report(self, metrics: dict[str, Any]) -> int | None:
        step = self._published() if self.rank == 0 else None
        if step is None or (self._reported is not None and step <= self._reported):
            ray.train.report(metrics)
            return None
        pointer = VersionPointer(self.root, step, self.world_size, self._metrics.get(step, {}))
        self._metrics = {s: m for s, m in self._metrics.items() if s > step}
        directory = tempfile.mkdtemp(prefix="asymcheck-ray-")
        try:
            with open(os.path.join(directory, POINTER_FILE), "w", encoding="utf-8") as f:
                f.write(pointer.to_json())
            # Ray copies it into the run's storage, then removes it (Ray Train's local mode keeps it: no storage)
            ray.train.report({**metrics, STEP_METRIC: step}, checkpoint=ray.train.Checkpoint.from_directory(directory),
                             delete_local_checkpoint_after_upload=True)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self._reported = step
        logger.debug("reported version %d of %s to Ray", step, self.root)
        return step

    def check_preemption(self, *, wait: bool = True, max_wait_s: float = 600.0) -> PreemptionRecord | None:
        """Ask Ray for a preemption notice; on one, flush the newest completed step on every rank.

        Calls ``ray.train.get_preemption_info()`` (a barrier: every worker calls this the same number of times,
        after the same optimizer step, e.g. every k steps). Without a notice it returns None. With one (a node
        hosting a worker is being drained), every rank runs :meth:`asymcheck.Checkpointer.preempt` with Ray's
        reclaim deadline (the ``preemption`` option's deadline when Ray gives none): the newest completed step
        becomes a published version, which is then reported to Ray. The Checkpointer is closed afterwards.

        Args:
            wait: after the flush, wait for Ray to end the attempt (it restarts the worker group once the
                drain deadline passes, and the next attempt resumes from the flushed version): training on
                would be thrown away by that restart, and a training function that returned would end the
                run as finished. False: return the record (the loop goes on without versions).
            max_wait_s: the longest wait past Ray's deadline (or past the flush without one).

        Returns:
            None without a notice; the flush's record with one and ``wait=False``.

        Raises:
            RayPreemptionTimeoutError: (``wait``) Ray did not end the attempt within ``max_wait_s``.
        """
        info = ray.train.get_preemption_info()
        if info is None:
            return None
        left = None if info.deadline_ms is None else info.deadline_ms / 1000.0 - time.time()
        logger.warning("Ray preemption notice (ranks %s, %s): flushing step %d", info.preempted_ranks,
                       "no deadline" if left is None else f"{left:.1f} s left", self.checkpointer.step)
        record = self.checkpointer.preempt(deadline_s=None if left is None else max(left, 1.0))
        self._report({})
        if not wait:
            return record
        until = time.monotonic() + max(left or 0.0, 0.0) + max_wait_s
        while time.monotonic() < until:
            time.sleep(_WAIT_POLL_S)
        raise RayPreemptionTimeoutError(f"flushed step {record.step}, then waited {max_wait_s:g} s past the notice's "
                                        "deadline for Ray to end the attempt")

    def close(self) -> None:
        """Close the Checkpointer (its final version committed), then report that version to Ray.

        Every worker calls it (the report is a barrier); after an error use the ``with`` block, which
        closes without reporting.
        """
        closed = self.checkpointer.preempted is not None
        self.checkpointer.close()
        if not closed:
            self._report({})

    def __enter__(self) -> RayCheckpointer:
        """Return self."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close; on an exception only the Checkpointer (no Ray report: the other workers may be gone)."""
        if exc is None:
            self.close()
        else:
            self.checkpointer.__exit__(exc_type, exc, tb)
