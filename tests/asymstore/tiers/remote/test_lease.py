"""The writer lease of remote roots: taken when free, expired or held by a dead local process; refused otherwise."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from asymstore import AsymStore, RootLockedError
from asymstore.fsck import check
from asymstore.tiers.remote.lease import RemoteLease
from asymstore.tiers.remote.tier import RemoteTier


def write_holder(root: Path, **fields: object) -> None:
    doc = {"token": "someone-else", "pid": 1, "host": "other-host", "since": time.time(), "command": "train.py"}
    doc.update(fields)
    (root / ".lock").write_text(json.dumps(doc))


def lease(root: Path, **kw: float) -> RemoteLease:
    return RemoteLease(pafs.LocalFileSystem(), str(root), **kw)


def test_a_live_lease_elsewhere_is_waited_for_then_refused_naming_the_holder(tmp_path: Path) -> None:
    expires = time.time() + 60
    write_holder(tmp_path, expires=expires)
    started = time.monotonic()
    with pytest.raises(RootLockedError, match="pid 1 on other-host"):
        lease(tmp_path, wait_s=0.5).acquire()
    assert time.monotonic() - started >= 0.5  # it waited its wait_s first
    assert time.time() < expires  # and was refused while the holder's lease still ran, not taken at its expiry
    assert json.loads((tmp_path / ".lock").read_text())["token"] == "someone-else"  # untouched


@pytest.mark.parametrize("case", ["expired", "dead-local-holder", "unreadable"])
def test_a_lapsed_or_dead_lease_is_taken_over(tmp_path: Path, case: str) -> None:
    if case == "expired":
        write_holder(tmp_path, expires=time.time() - 1)
    elif case == "dead-local-holder":
        dead = os.fork()
        if dead == 0:
            os._exit(0)
        os.waitpid(dead, 0)  # a pid that no longer runs
        write_holder(tmp_path, expires=time.time() + 60, host=socket.gethostname(), pid=dead)
    else:
        (tmp_path / ".lock").write_bytes(b"\x00garbage")
    mine = lease(tmp_path, wait_s=0)
    mine.acquire()
    doc = json.loads((tmp_path / ".lock").read_text())
    assert doc["token"] == mine.token and doc["pid"] == os.getpid() and doc["expires"] > time.time()
    before = doc["expires"]
    time.sleep(0.01)
    mine.renew()
    assert json.loads((tmp_path / ".lock").read_text())["expires"] > before
    mine.release()
    assert not (tmp_path / ".lock").exists()


def test_a_lease_taken_over_is_given_up_not_fought_over(tmp_path: Path) -> None:
    mine = lease(tmp_path, wait_s=0)
    mine.acquire()
    write_holder(tmp_path, expires=time.time() + 60)  # another writer took it (ours had lapsed)
    mine.renew()
    assert not mine.held and json.loads((tmp_path / ".lock").read_text())["token"] == "someone-else"
    mine.release()
    assert (tmp_path / ".lock").exists()  # never deletes another writer's lease


async def test_fsck_marks_a_live_remote_writers_temporaries_in_progress(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/root"
    async with AsymStore([RemoteTier(uri)], compression="never", segment_bytes=1 << 20) as store:
        await store.put(1, "w", torch.ones(4))
        await store.commit(1)
        (tmp_path / "root" / ".tmp-v000000000002-0badc0de").mkdir()
        report = check(uri)
        assert report.ok and report.writer is not None and f"pid {os.getpid()}" in report.writer
        assert {e.status for e in report.entries} == {"committed", "in_progress"}
    after = check(uri)  # the writer is gone: the same entry is a dead writer's leftover
    assert after.writer is None and not after.ok
    assert [e.status for e in after.entries if e.name.startswith(".tmp-")] == ["partial"]


class _SlowFirstRead(RemoteLease):
    """A fault: the first look at the lease takes a while (a slow mount), so two writers both see none."""

    def __init__(self, *args: object, **kw: float) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._first = True

    def _read(self) -> dict[str, object] | None:
        doc = super()._read()
        if self._first:
            self._first = False
            time.sleep(0.2)
        return doc


def test_two_writers_starting_together_on_a_file_root_never_both_win(tmp_path: Path) -> None:
    import threading

    for attempt in range(5):
        root = tmp_path / f"r{attempt}"
        root.mkdir()
        barrier = threading.Barrier(2)
        won: list[bool] = []

        def take(root: Path = root, barrier: threading.Barrier = barrier, won: list[bool] = won) -> None:
            mine = _SlowFirstRead(pafs.LocalFileSystem(), str(root), wait_s=0.0)
            barrier.wait()
            try:
                mine.acquire()
                won.append(True)
            except RootLockedError:
                won.append(False)

        threads = [threading.Thread(target=take) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(won) == [False, True], (attempt, won)  # the conditional create lets exactly one in
