"""The multi-rank protocol as types: every round, key and payload on the job's coordination store.

The ranks of a :class:`~asymstore.multirank.RankStore` agree only through keys of a c10d key-value
store (:mod:`asymstore.dist.kv`), never a collective; this module alone spells the keys and encodes
the payloads (frozen dataclasses, strict JSON), as DCP's ``_DistWrapper`` keeps its rounds. Rounds
(``s<n>`` counts the rank's opens): the session (:class:`Verdict`), the step agreement
(:class:`Agreement`), the commit (:class:`CommitRound`), the restore (:class:`RestoreRound`) and
retention (:class:`RetainSet`); each class names its keys. A value a peer put is untrusted: at most
:data:`MAX_PAYLOAD_BYTES` of strict JSON of the expected shape, else
:class:`~asymstore.errors.CoordinationProtocolError` naming the key.

Guide: ``docs/guides/multirank.md``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeVar

from asymstore.dist.fabric import Fabric
from asymstore.dist.kv import KV
from asymstore.errors import (
    AsymstoreError,
    CoordinationProtocolError,
    GlobalCommitError,
    GlobalManifestError,
    GlobalVersionDroppedError,
    RootLayoutError,
    relayed,
)
from asymstore.format.globalmanifest import GlobalManifest, ShardInfo, manifest_digest
from asymstore.format.placement import RankPlacement

logger = logging.getLogger(__name__)

MAX_PAYLOAD_BYTES = 64 << 20
"""The largest value read from the coordination store (a :class:`TryMsg` carries a whole global manifest)."""

REASON_CHARS = 500
"""A dropped version's reason is cut to this many characters on the wire."""

NONCE = "nonce"
"""The counter that makes each agreed step's commit key unique."""

RETAIN_ALL = "retain/all"
"""Counter: one past the oldest shard step every rank must keep (plain ``keep_last``)."""

RETAIN_RANKED = "retain/ranked"
"""Set once the coordinator keeps some rank's shards apart from the others' (:func:`raise_keep_from`)."""

RETAIN_SET = "retain/set"
"""The shard steps each rank keeps under ``keep_every``/``keep_best`` (:class:`RetainSet`)."""


def session_counter(rank: int) -> str:
    """The counter of ``rank``'s opens (its session number)."""
    return f"session/{rank}"


def retain_rank(rank: int) -> str:
    """Counter: one past the oldest shard step ``rank`` must keep, where ranks differ."""
    return f"retain/{rank}"


def session_key(session: int, name: str) -> str:
    """A key of session ``session`` (the same on every rank that opened its store as often)."""
    return f"s{session}/{name}"


def round_key(session: int, kind: str, n: int) -> str:
    """The key prefix of the ``n``-th round of ``kind`` (``"agree"``, ``"restore"``) in session ``session``."""
    return session_key(session, f"{kind}/{n}")


def layout_key(session: int) -> str:
    """Where the coordinator puts its :class:`Verdict` on the root at ``open``."""
    return session_key(session, "layout")


def commit_tag(step: int, nonce: int | None = None) -> str:
    """The tag of the commit of ``step`` (with the agreement's nonce, when the step was agreed)."""
    return str(step) if nonce is None else f"{step}.{nonce}"


# -- decoding helpers ------------------------------------------------------------------------------------


def _bad(what: str, doc: object) -> CoordinationProtocolError:
    return CoordinationProtocolError(f"malformed {what}: {str(doc)[:200]}")


def _int(doc: object, what: str, *, low: int = 0) -> int:
    if isinstance(doc, bool) or not isinstance(doc, int) or doc < low:
        raise _bad(what, doc)
    return doc


def _str(doc: object, what: str) -> str:
    if not isinstance(doc, str):
        raise _bad(what, doc)
    return doc


def _dict(doc: object, what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise _bad(what, doc)
    return doc


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not strict JSON")


def _shard_info(doc: object) -> ShardInfo:
    """A shard entry a peer put, strictly typed (ShardInfo alone would coerce ``"3"`` or ``3.5``)."""
    d = _dict(doc, "shard entry")
    for name in ("rank", "step", "nbytes", "tensors"):
        _int(d.get(name, 0), f"shard {name}")
    _str(d.get("digest"), "shard digest")
    _dict(d.get("summary", {}), "shard summary")
    return ShardInfo.from_json(d)


def decode(raw: bytes | bytearray | memoryview | str, kind: type[P], key: str = "a value") -> P:
    """Parse a payload of type ``kind`` from the bytes a rank put (untrusted).

    Raises:
        CoordinationProtocolError: larger than :data:`MAX_PAYLOAD_BYTES`, not strict JSON, or not a ``kind``.
    """
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) > MAX_PAYLOAD_BYTES:
        raise CoordinationProtocolError(f"{key}: a payload of {len(data)} bytes exceeds the "
                                        f"{MAX_PAYLOAD_BYTES}-byte limit of the coordination protocol")
    try:
        doc = json.loads(data, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CoordinationProtocolError(f"{key}: not strict JSON: {str(exc)[:200]}") from exc
    try:
        return kind.from_json(doc)
    except CoordinationProtocolError as exc:
        raise CoordinationProtocolError(f"{key}: {exc}") from exc
    except (GlobalManifestError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CoordinationProtocolError(f"{key}: malformed {kind.__name__}: {str(exc)[:200]}") from exc


def encode(payload: Payload) -> str:
    """The strict JSON of ``payload`` as it goes on the wire."""
    return json.dumps(payload.to_json(), allow_nan=False)


# -- payloads --------------------------------------------------------------------------------------------


class Payload(Protocol):
    """A value of the protocol: strict JSON out, checked JSON in."""

    def to_json(self) -> Any:
        """The JSON value put on the wire."""
        ...  # pragma: no cover

    @classmethod
    def from_json(cls, doc: Any) -> Self:
        """Read what :meth:`to_json` wrote (CoordinationProtocolError when malformed)."""
        ...  # pragma: no cover


P = TypeVar("P", bound=Payload)


@dataclass(frozen=True)
class Relayed:
    """An error the coordinator relays to every rank by type name (see :func:`asymstore.errors.relayed`)."""

    error: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> Relayed:
        """Relay ``exc``."""
        return cls(type(exc).__name__, str(exc))

    def exception(self, default: type[AsymstoreError]) -> AsymstoreError:
        """The error typed again (``default`` when its name is not one of the relayed errors)."""
        return relayed(self.error, self.message, default)

    def to_json(self) -> dict[str, Any]:
        """``{"error": name, "message": text}``."""
        return {"error": self.error, "message": self.message}

    @classmethod
    def from_json(cls, doc: Any) -> Relayed:
        """Read what :meth:`to_json` wrote."""
        d = _dict(doc, "relayed error")
        return cls(_str(d.get("error"), "relayed error name"), _str(d.get("message"), "relayed error message"))


@dataclass(frozen=True)
class Agreement:
    """The coordinator's choice of the next step (``floor``: the newest global step then, -1 for none)."""

    step: int
    floor: int
    nonce: int

    def to_json(self) -> dict[str, Any]:
        """``{"step", "floor", "nonce"}``."""
        return {"step": self.step, "floor": self.floor, "nonce": self.nonce}

    @classmethod
    def from_json(cls, doc: Any) -> Agreement:
        """Read what :meth:`to_json` wrote."""
        d = _dict(doc, "agreement")
        return cls(_int(d.get("step"), "agreed step"), _int(d.get("floor"), "agreed floor", low=-1),
                   _int(d.get("nonce"), "agreement nonce"))


@dataclass(frozen=True)
class ShardReport:
    """A rank's report of its shard of a commit: committed (``info``), failed, or dropped.

    Attributes:
        info: the committed shard (None: it failed or was dropped).
        placement: where the rank's tiers are (None: not reported, or malformed: see ``placement_error``).
        placement_error: why the placement reported is not read (it is not recorded; the commit goes on).
        failed: why the shard commit failed.
        dropped: why the rank dropped its version (cut to :data:`REASON_CHARS`).
    """

    info: ShardInfo | None = None
    placement: RankPlacement | None = None
    placement_error: str | None = None
    failed: str | None = None
    dropped: str | None = None

    def __post_init__(self) -> None:
        """Check that exactly one of ``info``, ``failed``, ``dropped`` is set.

        Raises:
            ValueError: none or several.
        """
        if sum(x is not None for x in (self.info, self.failed, self.dropped)) != 1:
            raise ValueError("a shard report is exactly one of committed, failed, dropped")

    def to_json(self) -> dict[str, Any]:
        """The shard's JSON (:class:`~asymstore.format.globalmanifest.ShardInfo`), ``{"failed"}`` or ``{"dropped"}``."""
        if self.dropped is not None:
            return {"dropped": self.dropped[:REASON_CHARS]}
        if self.failed is not None:
            return {"failed": self.failed}
        assert self.info is not None
        doc = self.info.to_json()
        if self.placement is not None:
            doc["placement"] = self.placement.to_json()
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> ShardReport:
        """Read what :meth:`to_json` wrote (a malformed placement only sets ``placement_error``)."""
        d = _dict(doc, "shard report")
        if "dropped" in d:
            return cls(dropped=_str(d["dropped"], "dropped reason")[:REASON_CHARS])
        if "failed" in d:
            return cls(failed=_str(d["failed"], "failure reason"))
        info = _shard_info(d)
        placement, problem = None, None
        if d.get("placement") is not None:
            try:
                placement = RankPlacement.from_json(d["placement"])
            except GlobalManifestError as exc:
                problem = str(exc)
        return cls(info, placement, problem)


@dataclass(frozen=True)
class GlobalAnswer:
    """The coordinator's answer to a global commit: published (``step``), or why not.

    Attributes:
        step: the global step published (None: not published).
        failed: why the global version is not published.
        dropped: a rank dropped its version (:class:`~asymstore.errors.GlobalVersionDroppedError`).
    """

    step: int | None = None
    failed: str | None = None
    dropped: bool = False

    def __post_init__(self) -> None:
        """Check that exactly one of ``step`` and ``failed`` is set.

        Raises:
            ValueError: none or both, or ``dropped`` without ``failed``.
        """
        if (self.step is None) == (self.failed is None) or (self.dropped and self.failed is None):
            raise ValueError("a global answer is a published step or a failure")

    def raise_failure(self) -> None:
        """Raise what the coordinator said, if the version is not published.

        Raises:
            GlobalVersionDroppedError: a rank dropped its version.
            GlobalCommitError: the global version is not published.
        """
        if self.failed is None:
            return
        if self.dropped:
            raise GlobalVersionDroppedError(self.failed)
        raise GlobalCommitError(self.failed)

    def to_json(self) -> dict[str, Any]:
        """``{"step"}``, ``{"failed"}`` or ``{"failed", "dropped": true}``."""
        if self.failed is None:
            return {"step": self.step}
        return {"failed": self.failed, "dropped": True} if self.dropped else {"failed": self.failed}

    @classmethod
    def from_json(cls, doc: Any) -> GlobalAnswer:
        """Read what :meth:`to_json` wrote."""
        d = _dict(doc, "global answer")
        if "failed" in d:
            return cls(failed=_str(d["failed"], "failure reason"), dropped="dropped" in d)
        return cls(step=_int(d.get("step"), "published step"))


@dataclass(frozen=True)
class Flushed:
    """A rank finished its part of its last commit (at ``flush``), having heard ``answer``."""

    answer: GlobalAnswer

    def to_json(self) -> dict[str, Any]:
        """``{"global": answer}``."""
        return {"global": self.answer.to_json()}

    @classmethod
    def from_json(cls, doc: Any) -> Flushed:
        """Read what :meth:`to_json` wrote."""
        return cls(GlobalAnswer.from_json(_dict(doc, "flushed note").get("global")))


@dataclass(frozen=True)
class Have:
    """The shard steps a rank's own tiers hold (restore's first round)."""

    steps: tuple[int, ...]

    def to_json(self) -> list[int]:
        """The steps, as a list."""
        return list(self.steps)

    @classmethod
    def from_json(cls, doc: Any) -> Have:
        """Read what :meth:`to_json` wrote."""
        if not isinstance(doc, list):
            raise _bad("list of shard steps", doc)
        return cls(tuple(_int(s, "shard step") for s in doc))


@dataclass(frozen=True)
class NodeCandidate:
    """A restore candidate as one node hears it: the global version's identity and its node's entries only.

    What a rank needs to check and load its shard of a global version of its own world size (not one of
    slices): O(its node) bytes to read and parse, not O(ranks). The whole manifest stays with the
    coordinator, which puts it once in the job's store when the restore is done
    (:meth:`RestoreRound.chosen`); a rank that needs it later checks it against ``digest``.

    Attributes:
        step: the global step.
        world_size: the global version's ranks.
        digest: :func:`~asymstore.format.globalmanifest.manifest_digest` of the coordinator's global manifest.
        shards: the global manifest's entries of the node's ranks: consecutive ranks, ascending.
    """

    step: int
    world_size: int
    digest: str
    shards: tuple[ShardInfo, ...]

    def __post_init__(self) -> None:
        """Check the entries: at least one, consecutive ranks within the world, a digest of 16 hex digits.

        Raises:
            ValueError: they are not.
        """
        first = self.shards[0].rank if self.shards else -1
        if (not self.shards or [s.rank for s in self.shards] != list(range(first, first + len(self.shards)))
                or first + len(self.shards) > self.world_size or not _HEX16.fullmatch(self.digest)):
            raise ValueError(f"a node's candidate names ranks {[s.rank for s in self.shards][:8]} of a world of "
                             f"{self.world_size} (consecutive ranks within it) and a digest of 16 hex digits")

    @classmethod
    def of(cls, g: GlobalManifest, ranks: range, digest: str) -> NodeCandidate:
        """The candidate ``g`` (of digest ``digest``) as the node of ``ranks`` hears it."""
        return cls(g.step, g.world_size, digest, g.shards[ranks.start:ranks.stop])

    @property
    def ranks(self) -> range:
        """The ranks whose entries it carries."""
        return range(self.shards[0].rank, self.shards[-1].rank + 1)

    def shard(self, rank: int) -> ShardInfo:
        """The entry of ``rank``.

        Raises:
            CoordinationProtocolError: it carries no entry of ``rank``.
        """
        if rank not in self.ranks:
            raise CoordinationProtocolError(f"the candidate of global step {self.step} carries ranks "
                                            f"{self.ranks.start}..{self.ranks.stop - 1}, not rank {rank}")
        return self.shards[rank - self.ranks.start]

    def to_json(self) -> dict[str, Any]:
        """``{"step", "world_size", "digest", "shards": [entry JSON]}``."""
        return {"step": self.step, "world_size": self.world_size, "digest": self.digest,
                "shards": [s.to_json() for s in self.shards]}

    @classmethod
    def from_json(cls, doc: Any) -> NodeCandidate:
        """Read what :meth:`to_json` wrote (every entry strictly typed)."""
        d = _dict(doc, "node candidate")
        shards = d.get("shards")
        if not isinstance(shards, list):
            raise _bad("node candidate entries", shards)
        return cls(_int(d.get("step"), "candidate step"), _int(d.get("world_size"), "candidate world size", low=1),
                   _str(d.get("digest"), "candidate digest"), tuple(_shard_info(e) for e in shards))


_HEX16 = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class TryMsg:
    """The coordinator's word on restore candidate ``k``: load ``candidate`` (or ``node``), ``done``, or an ``error``.

    Attributes:
        candidate: the global version to check and load, whole (one of another world size, a
            single-process one, or one of slices: every rank reads other ranks' shards; the whole
            manifest put in the coordination store by :meth:`RestoreRound.chosen`).
        node: the global version to check and load, as this rank's node hears it (any other).
        done: the step of the global version every rank loaded (the restore is over).
        notes: with ``done``: the candidates skipped and why.
        error: the error every rank raises.
    """

    candidate: GlobalManifest | None = None
    done: int | None = None
    notes: tuple[str, ...] = ()
    error: Relayed | None = None
    node: NodeCandidate | None = None

    def __post_init__(self) -> None:
        """Check that exactly one of ``candidate``, ``node``, ``done``, ``error`` is set.

        Raises:
            ValueError: none or several.
        """
        if sum(x is not None for x in (self.candidate, self.node, self.done, self.error)) != 1:
            raise ValueError("a restore message is exactly one of a candidate, done, an error")

    def to_json(self) -> dict[str, Any]:
        """``{"global": manifest JSON}``, ``{"node": candidate}``, ``{"done", "notes"}`` or ``{"error", "message"}``."""
        if self.error is not None:
            return self.error.to_json()
        if self.done is not None:
            return {"done": self.done, "notes": list(self.notes)}
        if self.node is not None:
            return {"node": self.node.to_json()}
        assert self.candidate is not None
        return {"global": self.candidate.to_json().decode()}

    @classmethod
    def from_json(cls, doc: Any) -> TryMsg:
        """Read what :meth:`to_json` wrote (a candidate's manifest is parsed and verified)."""
        d = _dict(doc, "restore message")
        if "error" in d:
            return cls(error=Relayed.from_json(d))
        if "done" in d:
            notes = d.get("notes", [])
            if not isinstance(notes, list):
                raise _bad("restore notes", notes)
            return cls(done=_int(d["done"], "restored step"), notes=tuple(_str(n, "note") for n in notes))
        if "node" in d:
            return cls(node=NodeCandidate.from_json(d["node"]))
        return cls(GlobalManifest.from_json(_str(d.get("global"), "global manifest").encode()))


@dataclass(frozen=True)
class Fit:
    """Whether a rank's destinations fit its shard of a candidate (``reason``: why not)."""

    ok: bool
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        """``{"ok", "reason"}``."""
        return {"ok": self.ok, "reason": self.reason}

    @classmethod
    def from_json(cls, doc: Any) -> Fit:
        """Read what :meth:`to_json` wrote."""
        d = _dict(doc, "fit")
        ok = d.get("ok")
        if not isinstance(ok, bool):
            raise _bad("fit", doc)
        return cls(ok, _str(d.get("reason", ""), "fit reason"))


@dataclass(frozen=True)
class Go:
    """The coordinator's word once every rank checked a candidate: load it, or raise ``error``."""

    error: Relayed | None = None

    def to_json(self) -> dict[str, Any]:
        """``{"go": true}`` or ``{"error", "message"}``."""
        return {"go": True} if self.error is None else self.error.to_json()

    @classmethod
    def from_json(cls, doc: Any) -> Go:
        """Read what :meth:`to_json` wrote."""
        d = _dict(doc, "go")
        if "error" in d:
            return cls(Relayed.from_json(d))
        if d.get("go") is not True:
            raise _bad("go", doc)
        return cls()


@dataclass(frozen=True)
class LoadResult:
    """Whether a rank loaded and verified its shard of a candidate (``refused``: its destinations refused it)."""

    ok: bool
    reason: str = ""
    refused: bool = False

    def to_json(self) -> dict[str, Any]:
        """``{"ok", "reason"}``, with ``"refused": true`` when refused."""
        out: dict[str, Any] = {"ok": self.ok, "reason": self.reason}
        if self.refused:
            out["refused"] = True
        return out

    @classmethod
    def from_json(cls, doc: Any) -> LoadResult:
        """Read what :meth:`to_json` wrote."""
        d = _dict(doc, "load result")
        ok, refused = d.get("ok"), d.get("refused", False)
        if not isinstance(ok, bool) or not isinstance(refused, bool):
            raise _bad("load result", doc)
        return cls(ok, _str(d.get("reason", ""), "load reason"), refused)


@dataclass(frozen=True)
class Verdict:
    """What the coordinator found at ``open``, as every rank hears it (see :mod:`.takeover`).

    Attributes:
        pending: the root's current versions are single-process: the first global version takes it over.
        found: what the root holds, in words (for the refusal).
        newest: the newest single-process step (None: none).
        error: ``(type name, message)`` when the coordinator could not open; every rank raises it.
    """

    pending: bool
    found: str
    newest: int | None
    error: tuple[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON put in the coordination store."""
        return {"pending": self.pending, "found": self.found, "newest": self.newest,
                "error": list(self.error) if self.error else None}

    @classmethod
    def from_json(cls, doc: Any) -> Verdict:
        """Read what :meth:`to_json` wrote."""
        d = _dict(doc, "layout verdict")
        pending, newest, error = d.get("pending"), d.get("newest"), d.get("error")
        if not isinstance(pending, bool):
            raise _bad("layout verdict", doc)
        if error is not None and (not isinstance(error, list) or len(error) != 2):
            raise _bad("relayed error", error)
        return cls(pending, _str(d.get("found"), "layout found"),
                   None if newest is None else _int(newest, "newest single-process step"),
                   (_str(error[0], "error name"), _str(error[1], "error message")) if error else None)

    def raise_error(self) -> None:
        """Raise the coordinator's error, typed as it was, if it had one."""
        if self.error is not None:
            raise relayed(self.error[0], self.error[1], RootLayoutError)


@dataclass(frozen=True)
class RetainSet:
    """Under ``keep_every``/``keep_best``: rank -> the shard steps it keeps (below the newest, only those)."""

    ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """``{"ranks": {"<rank>": [steps]}}`` (ranks with no step left out)."""
        return {"ranks": {str(r): list(steps) for r, steps in self.ranks.items() if steps}}

    @classmethod
    def from_json(cls, doc: Any) -> RetainSet:
        """Read what :meth:`to_json` wrote."""
        ranks = _dict(_dict(doc, "retained set").get("ranks"), "retained set")
        out: dict[int, tuple[int, ...]] = {}
        for r, steps in ranks.items():
            if not isinstance(steps, list) or not r.isdigit():
                raise _bad("retained steps", {r: steps})
            out[int(r)] = tuple(_int(s, "retained step") for s in steps)
        return cls(out)


# -- the wire --------------------------------------------------------------------------------------------


class Wire:
    """Typed puts, gets and waits on the coordination store: where payloads meet their keys.

    Gathers (every rank's part of a round, read by the coordinator) and broadcasts (the coordinator's
    word, heard by every rank) go through the rank's :class:`~asymstore.dist.fabric.Fabric`: directly on
    the job's store on node 0, through the node's leader elsewhere. ``put``/``get``/``has``/``wait`` are
    the job's store itself.

    Args:
        kv: the job's coordination client, or this rank's fabric.
    """

    def __init__(self, kv: KV | Fabric) -> None:
        """Wrap ``kv``."""
        self.fabric = kv if isinstance(kv, Fabric) else Fabric(kv)
        self.kv = self.fabric.kv

    def put(self, key: str, payload: Payload) -> None:
        """Put ``payload`` under ``key``."""
        self.kv.store.set(key, encode(payload))

    def get(self, key: str, kind: type[P]) -> P:
        """The payload under ``key`` (it must be set).

        Raises:
            CoordinationProtocolError: it is no ``kind`` (see :func:`decode`).
        """
        return decode(self.kv.store.get(key), kind, key)

    def get_many(self, keys: Sequence[str], kind: type[P]) -> list[P]:
        """The payloads under ``keys`` (they must be set), in one request where the store can."""
        if not keys:
            return []
        multi_get = getattr(self.kv.store, "multi_get", None)
        raw = multi_get(list(keys)) if multi_get is not None else [self.kv.store.get(k) for k in keys]
        return [decode(v, kind, k) for k, v in zip(keys, raw, strict=True)]

    def wait(self, keys: Sequence[str], timeout_s: float, what: str) -> None:
        """Wait until every key is set (CoordinationTimeoutError: see :meth:`asymstore.dist.kv.KV.wait`)."""
        self.kv.wait(keys, timeout_s, what)

    def await_(self, key: str, kind: type[P], timeout_s: float, what: str) -> P:
        """Wait for ``key``, then return its payload."""
        self.wait([key], timeout_s, what)
        return self.get(key, kind)

    def has(self, key: str) -> bool:
        """True when ``key`` is set."""
        return self.kv.has(key)

    def contribute(self, prefix: str, rank: int, payload: Payload) -> None:
        """Put ``rank``'s part of the gather under ``prefix`` (key ``<prefix>/<rank>``)."""
        self.fabric.contribute(prefix, rank, encode(payload))

    def gather(self, prefix: str, ranks: Sequence[int], kind: type[P], timeout_s: float, what: str) -> list[P]:
        """The coordinator: the parts of ``ranks`` under ``prefix``, in their order.

        Raises:
            CoordinationTimeoutError: a part did not come in time (the missing ranks named).
            CoordinationProtocolError: a part is no ``kind``.
        """
        return self.fabric.gather_each(prefix, ranks, timeout_s, what,
                                       lambda r, raw: decode(raw, kind, f"{prefix}/{r}"))  # each as it comes

    def missing(self, prefix: str, ranks: Sequence[int]) -> list[int]:
        """The ranks of ``ranks`` whose part under ``prefix`` did not reach the coordinator yet."""
        return self.fabric.missing(prefix, ranks)

    def announce(self, key: str, payload: Payload) -> None:
        """The coordinator: the broadcast ``key``."""
        self.fabric.announce(key, encode(payload))

    def announce_each(self, key: str, payload_of: Callable[[int], Payload]) -> None:
        """The coordinator: the broadcast ``key``, node by node (``payload_of(n)`` for node ``n``)."""
        self.fabric.announce_each(key, lambda node: encode(payload_of(node)))

    def hear(self, key: str, kind: type[P], timeout_s: float, what: str) -> P:
        """Wait for the broadcast ``key`` and return its payload (CoordinationTimeoutError)."""
        return decode(self.fabric.hear(key, timeout_s, what), kind, key)


def open_session(kv: KV, rank: int) -> int:
    """Count an ``open`` of ``rank``: its session number (blocking)."""
    return int(kv.store.add(session_counter(rank), 1))


def next_nonce(kv: KV) -> int:
    """Coordinator: a nonce no agreement of the job used yet (blocking)."""
    return int(kv.store.add(NONCE, 1))


@dataclass(frozen=True)
class CommitRound:
    """The keys of one global commit (``prefix`` = ``s<session>/commit/<tag>``) and its typed exchanges.

    Every rank's :class:`ShardReport` under ``<prefix>/rank/<r>``, the coordinator's
    :class:`GlobalAnswer` under ``<prefix>/global``, every rank's :class:`Flushed` under
    ``<prefix>/flushed/<r>``. The methods block (call them in a thread).
    """

    wire: Wire
    prefix: str
    world_size: int

    @classmethod
    def of(cls, kv: KV | Fabric, session: int, tag: str, world_size: int) -> CommitRound:
        """The round of the commit tagged ``tag`` (:func:`commit_tag`) in session ``session``."""
        return cls(Wire(kv), session_key(session, f"commit/{tag}"), world_size)

    def report_key(self, rank: int) -> str:
        """Where ``rank`` reports its shard (:class:`ShardReport`)."""
        return f"{self.prefix}/rank/{rank}"

    @property
    def answer_key(self) -> str:
        """Where the coordinator answers (:class:`GlobalAnswer`)."""
        return f"{self.prefix}/global"

    def flushed_key(self, rank: int) -> str:
        """Where ``rank`` says it finished its part (:class:`Flushed`)."""
        return f"{self.prefix}/flushed/{rank}"

    def report(self, rank: int, report: ShardReport) -> None:
        """Every rank: report its shard."""
        self.wire.contribute(f"{self.prefix}/rank", rank, report)

    def reports(self, timeout_s: float, what: str) -> list[ShardReport]:
        """Coordinator: every rank's report, by rank, once all came.

        Raises:
            CoordinationTimeoutError: not every rank reported within ``timeout_s``.
            CoordinationProtocolError: a malformed report.
        """
        return self.wire.gather(f"{self.prefix}/rank", range(self.world_size), ShardReport, timeout_s, what)

    def missing_reports(self) -> list[int]:
        """The ranks whose report did not reach the coordinator yet."""
        return self.wire.missing(f"{self.prefix}/rank", range(self.world_size))

    def answer(self, answer: GlobalAnswer) -> None:
        """Coordinator: say whether the global version is published."""
        self.wire.announce(self.answer_key, answer)

    def wait_answer(self, timeout_s: float, what: str) -> GlobalAnswer:
        """Wait for the coordinator's answer (CoordinationTimeoutError) and return it."""
        return self.wire.hear(self.answer_key, GlobalAnswer, timeout_s, what)

    def flushed(self, rank: int, note: Flushed) -> None:
        """A non-coordinator: it finished its part of this commit."""
        self.wire.contribute(f"{self.prefix}/flushed", rank, note)

    def wait_flushed(self, timeout_s: float, what: str) -> None:
        """Coordinator: wait until every other rank finished its part."""
        self.wire.gather(f"{self.prefix}/flushed", range(1, self.world_size), Flushed, timeout_s, what)


@dataclass(frozen=True)
class RestoreRound:
    """The keys of one collective restore (``prefix`` = ``s<session>/restore/<i>``) and its typed exchanges.

    ``<prefix>/have/<r>`` (:class:`Have`), ``/try/<k>`` (:class:`TryMsg`: whole, or each node its own
    :class:`NodeCandidate`), ``/fit/<k>/<r>`` (:class:`Fit`), ``/go/<k>`` (:class:`Go`),
    ``/result/<k>/<r>`` (:class:`LoadResult`), ``/chosen`` (the whole global manifest loaded, after node
    candidates). The methods block (call them in a thread). See :mod:`asymstore.multirank.restore` for the order.
    """

    wire: Wire
    prefix: str
    world_size: int

    @classmethod
    def of(cls, kv: KV | Fabric, prefix: str, world_size: int) -> RestoreRound:
        """The round under ``prefix`` (:func:`round_key` of ``"restore"``)."""
        return cls(Wire(kv), prefix, world_size)

    def key(self, *parts: object) -> str:
        """The key of a message of this round: ``key("fit", k, rank)`` (see the module docstring)."""
        return "/".join([self.prefix, *map(str, parts)])

    def _gather(self, name: str, k: int | None, kind: type[P], timeout_s: float, what: str) -> list[P]:
        prefix = self.key(name) if k is None else self.key(name, k)
        return self.wire.gather(prefix, range(self.world_size), kind, timeout_s, what)

    def have(self, rank: int, have: Have) -> None:
        """Every rank: list the shard steps it holds."""
        self.wire.contribute(self.key("have"), rank, have)

    def haves(self, timeout_s: float) -> list[Have]:
        """Coordinator: every rank's list, by rank."""
        return self._gather("have", None, Have, timeout_s, "ranks listing their shards for restore")

    def post_try(self, k: int, msg: TryMsg) -> None:
        """Coordinator: its word on candidate ``k``."""
        self.wire.announce(self.key("try", k), msg)

    def post_try_each(self, k: int, msg_of: Callable[[int], TryMsg]) -> None:
        """Coordinator: its word on candidate ``k``, node by node (``msg_of(n)`` for node ``n``)."""
        self.wire.announce_each(self.key("try", k), msg_of)

    def chosen(self, g: GlobalManifest) -> None:
        """Coordinator: put the whole global manifest every rank loaded (``/chosen``, in the job's store only)."""
        self.wire.put(self.key("chosen"), TryMsg(g))

    def whole(self, node: NodeCandidate) -> GlobalManifest:
        """A rank: the whole global manifest the coordinator chose (one request on the job's store).

        Raises:
            CoordinationProtocolError: it is malformed, or not the global manifest ``node`` stands for
                (another step or another digest).
        """
        g = self.wire.get(self.key("chosen"), TryMsg).candidate
        if g is None or g.step != node.step or manifest_digest(g) != node.digest:
            raise CoordinationProtocolError(
                f"{self.key('chosen')}: not the global manifest of step {node.step} (digest {node.digest}) "
                f"the coordinator offered, but {None if g is None else (g.step, manifest_digest(g))}")
        return g

    def wait_try(self, k: int, timeout_s: float) -> TryMsg:
        """A rank: the coordinator's word on candidate ``k``."""
        return self.wire.hear(self.key("try", k), TryMsg, timeout_s, "the coordinator's restore")

    def fit(self, k: int, rank: int, fit: Fit) -> None:
        """Every rank: whether its destinations fit candidate ``k``."""
        self.wire.contribute(self.key("fit", k), rank, fit)

    def fits(self, k: int, timeout_s: float, what: str) -> list[Fit]:
        """Coordinator: every rank's fit of candidate ``k``, by rank."""
        return self._gather("fit", k, Fit, timeout_s, what)

    def go(self, k: int, go: Go) -> None:
        """Coordinator: load candidate ``k``, or the error."""
        self.wire.announce(self.key("go", k), go)

    def wait_go(self, k: int, timeout_s: float) -> Go:
        """A rank: the coordinator's word after the fits of candidate ``k``."""
        return self.wire.hear(self.key("go", k), Go, timeout_s, "the coordinator's restore")

    def result(self, k: int, rank: int, result: LoadResult) -> None:
        """Every rank: whether it loaded candidate ``k``."""
        self.wire.contribute(self.key("result", k), rank, result)

    def results(self, k: int, timeout_s: float, what: str) -> list[LoadResult]:
        """Coordinator: every rank's result of candidate ``k``, by rank."""
        return self._gather("result", k, LoadResult, timeout_s, what)


@dataclass(frozen=True)
class AgreeRound:
    """One agreement on the next step (``key`` = :func:`round_key` of ``"agree"``)."""

    wire: Wire
    key: str

    def propose(self, agreement: Agreement) -> None:
        """Coordinator: post the agreement."""
        self.wire.announce(self.key, agreement)

    def agreed(self, timeout_s: float) -> Agreement:
        """Every rank: wait for the coordinator's agreement and return it."""
        return self.wire.hear(self.key, Agreement, timeout_s, "agreeing on the next step")


def retained_set(kv: KV | Fabric) -> RetainSet | None:
    """The shard steps each rank keeps under ``keep_every``/``keep_best`` (None: not posted yet).

    Off node 0, the node store's copy, which the coordinator puts there when it posts it.

    Raises:
        CoordinationProtocolError: the record is malformed.
    """
    raw = Wire(kv).fabric.peek(RETAIN_SET)
    return None if raw is None else decode(raw, RetainSet, RETAIN_SET)


def post_retained_set(kv: KV | Fabric, kept: RetainSet) -> None:
    """Coordinator: post the shard steps each rank keeps (into every node store too)."""
    Wire(kv).announce(RETAIN_SET, kept)


def keep_from(kv: KV | Fabric, rank: int) -> int:
    """The oldest shard step ``rank`` must keep under plain ``keep_last`` (-1: none posted).

    Off node 0, the node store's copies of the counters, which the coordinator puts there when it raises them.
    """
    fabric = Wire(kv).fabric
    own = fabric.read_int(retain_rank(rank)) if fabric.has(RETAIN_RANKED) else 0
    return max(own, fabric.read_int(RETAIN_ALL)) - 1


def raise_keep_from(kv: KV | Fabric, steps: dict[int, int], world_size: int) -> None:
    """Coordinator: rank -> the oldest shard step it must keep (counters only rise: one request when alike).

    Every node store is told the new values too (see :mod:`asymstore.dist.fabric`).
    """
    fabric = Wire(kv).fabric
    if len(set(steps.values())) == 1 and len(steps) == world_size:  # the usual case: one request
        fabric.raise_counter(RETAIN_ALL, next(iter(steps.values())) + 1)
        return
    for r, step in steps.items():  # a kept version of another world size may need rank r's older shards
        fabric.raise_counter(retain_rank(r), step + 1)
    if not fabric.kv.has(RETAIN_RANKED):
        fabric.announce(RETAIN_RANKED, "1")


PAYLOADS: tuple[Callable[..., Payload], ...] = (
    Relayed, Agreement, ShardReport, GlobalAnswer, Flushed, Have, TryMsg, Fit, Go, LoadResult, Verdict, RetainSet)
"""Every payload type of the protocol."""
