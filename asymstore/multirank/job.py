"""The job as the multi-rank helpers see it: this rank, the global directory, coordination, timeouts.

:class:`~asymstore.multirank.store.RankStore` owns one :class:`Job` and hands
it to the helpers (publish, retention, restore, reshard), which use nothing
else of the store: a small record instead of the whole store, so the helpers
never import the store that composes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asymstore.dist.fabric import Fabric
from asymstore.dist.kv import KV
from asymstore.errors import StoreClosedError
from asymstore.format.globalmanifest import GlobalManifest
from asymstore.io.rootlock import DirLock
from asymstore.multirank import globaldir
from asymstore.multirank.rootlayout import AcrossLayouts
from asymstore.policy.retention import Retention
from asymstore.tiers.protocol import Tier


@dataclass
class Job:
    """What one rank knows of its multi-rank job (see the module docstring).

    Attributes:
        root: the multi-rank root (absolute).
        global_dir: ``root/global``: global manifests and placement records.
        rank: this process's rank.
        world_size: the job's number of ranks.
        fsync: flush files and directories of the global directory.
        timeout_s: longest wait of a global commit for every rank's report.
        restore_timeout_s: longest wait of the collective restore for the ranks.
        global_keep_last: global versions retention keeps (None: all).
        rules: the retention rules beyond ``keep_last`` (``keep_every``, ``keep_best``), judged
            on the global versions; None: the newest ``global_keep_last`` only.
        peer_tiers: unopened tiers to read another rank's shards from, by rank.
        global_cache: the coordinator's kept global manifests as it published them
            (retention reads them, not the files).
        placement_cache: the coordinator's last recorded placement: the ranks'
            reports and the record's digest.
    """

    root: str
    global_dir: str
    rank: int
    world_size: int
    fsync: bool
    timeout_s: float
    restore_timeout_s: float
    global_keep_last: int | None
    peer_tiers: Callable[[int], Sequence[Tier]]
    rules: Retention | None = None
    global_cache: dict[int, GlobalManifest] = field(default_factory=dict)
    placement_cache: tuple[list[Any], str] | None = None
    client: KV | None = None
    """The coordination store client, set when the store opens."""
    link: Fabric | None = None
    """This rank's routes to the coordinator through its node (:mod:`asymstore.dist.fabric`), set when it opens."""
    across_layouts: AcrossLayouts = "resume"
    """What ``restore`` does with the versions of a single-process root (see :mod:`.rootlayout`)."""
    resumed_single: int | None = None
    """The single-process version ``restore`` resumed (the coordinator records it with the layout)."""
    layout_recorded: bool = False
    """The coordinator recorded the root's layout as this job's (see :mod:`.rootlayout`)."""
    replicas_whole: bool = False
    """The replicas of a sliced version differed: from then on this job writes (and publishes) whole copies only."""
    shards_under_root: bool = False
    """Every rank's shards are written to and read from ``root/rank-NNNNN`` (the default tiers): slices may be cut."""
    exchange_slices: bool = False
    """Each rank's tiers are its own and its slices of a replicated state are exchanged at a restore
    (:mod:`.sliceexchange`): slices may be cut though the ranks cannot read each other's shards."""
    shards_seen: bool = False
    """The coordinator saw every rank's shard of a sliced version under the root (the root is shared)."""
    root_lock: DirLock | None = None
    """The root's writer lock, held by the coordinator while it takes a single-process root over (:mod:`.takeover`)."""

    @property
    def kv(self) -> KV:
        """The coordination store client.

        Raises:
            StoreClosedError: the store is not open.
        """
        if self.client is None:
            raise StoreClosedError("the multi-rank store is not open: no coordination store yet")
        return self.client

    @property
    def fabric(self) -> Fabric:
        """This rank's routes to the coordinator (the coordination store directly before ``open`` links it).

        Raises:
            StoreClosedError: the store is not open.
        """
        return self.link if self.link is not None else Fabric(self.kv)

    @property
    def is_coordinator(self) -> bool:
        """True on rank 0, which publishes global manifests."""
        return self.rank == 0

    def global_steps(self) -> list[int]:
        """Published global steps, ascending (reads ``global/``: the coordinator, or a shared filesystem)."""
        return globaldir.list_global_steps(self.global_dir)

    def read_global(self, step: int) -> GlobalManifest:
        """Read the global manifest of ``step`` (see :meth:`global_steps`)."""
        return globaldir.read_global(self.global_dir, step)
