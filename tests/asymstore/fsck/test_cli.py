"""``python -m asymstore.fsck``: exit status, --json schema, text output, --repair."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asymstore import AsymStore, LocalTier
from asymstore.format.names import LATEST, QUARANTINE, version_dirname
from asymstore.fsck.__main__ import main
from asymstore.io.rootlock import LOCK_NAME
from tests.support.store import fsck, fsck_json, make_state, same_state, store_kw

TOP_KEYS = {"schema", "root", "deep", "ok", "latest", "latest_problem", "newest_restorable", "versions",
            "problems", "repaired", "writer", "layout", "layout_record", "layout_problems"}
VERSION_KEYS = {"name", "status", "step", "nbytes", "problems", "unreferenced", "kept_by", "referenced_by", "ok"}


async def make_root(root: Path, steps: tuple[int, ...] = (10, 20)) -> Path:
    async with AsymStore([LocalTier(root)], keep_last=None, **store_kw()) as store:
        for step in steps:
            await store.put_many(step, make_state(step))
            await store.commit(step, meta={"step": step})
    return root


def snapshot(root: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every path under ``root`` -> (inode, size, mtime_ns, sha256) of a file, (inode, 0, 0, "dir") of a directory.

    The writer lock file is left out: every writer (repair too) records itself in it.
    """
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        filenames = [n for n in filenames if n != LOCK_NAME]
        for name in dirnames:
            path = Path(dirpath, name)
            out[str(path.relative_to(root))] = (path.stat().st_ino, 0, 0, "dir")
        for name in filenames:
            path = Path(dirpath, name)
            st = path.stat()
            out[str(path.relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns,
                                                hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def statuses(report: dict[str, Any]) -> list[tuple[str, str, int | None]]:
    return [(v["name"], v["status"], v["step"]) for v in report["versions"]]


async def test_clean_root(tmp_path: Path) -> None:
    root = await make_root(tmp_path)
    rc, report = fsck_json(str(root))
    assert rc == 0
    assert set(report) == TOP_KEYS
    assert report["schema"] == 1
    assert report["root"] == str(root)
    assert report["deep"] is False
    assert report["ok"] is True
    assert (report["latest"], report["latest_problem"], report["newest_restorable"]) == (20, None, 20)
    assert report["problems"] == [] and report["repaired"] == []
    assert statuses(report) == [("v000000000010", "committed", 10), ("v000000000020", "committed", 20)]
    for v in report["versions"]:
        assert set(v) == VERSION_KEYS
        assert v["ok"] is True and v["problems"] == [] and v["unreferenced"] == []
        files = [p for p in (root / v["name"]).iterdir() if p.name != "MANIFEST.json"]
        assert v["nbytes"] == sum(p.stat().st_size for p in files) > 0
    rc, deep = fsck_json("--deep", str(root))
    assert rc == 0 and deep["deep"] is True and deep["ok"] is True


async def test_text_output_names_each_version(tmp_path: Path) -> None:
    root = await make_root(tmp_path, (10, 20, 30))
    (root / ".tmp-v000000000040-0badc0de").mkdir()
    rc, text = fsck(str(root))
    assert rc == 1
    lines = text.splitlines()
    assert lines[0] == f"root: {root}"
    for step in (10, 20, 30):
        (line,) = [x for x in lines if version_dirname(step) in x]
        assert line.split()[:3] == ["committed", "step", str(step)]
    (line,) = [x for x in lines if ".tmp-v000000000040-0badc0de" in x]
    assert line.split()[:3] == ["partial", "step", "40"]
    assert "      problem: a commit that never published" in lines
    assert "LATEST: 30" in lines and "newest restorable: 30" in lines
    assert lines[-1] == "verdict: 1 problem(s)"
    rc, text = fsck("--repair", str(root))
    assert rc == 0
    assert "repaired: removed partial .tmp-v000000000040-0badc0de" in text.splitlines()
    assert text.splitlines()[-1] == "verdict: OK"


async def test_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main([str(tmp_path / "file"), "--json"]) == 2
    for argv in ([], ["--bogus", str(tmp_path)], [str(tmp_path), str(tmp_path)]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


async def test_empty_root_is_clean(tmp_path: Path) -> None:
    rc, report = fsck_json(str(tmp_path))
    assert rc == 0
    assert report["versions"] == [] and report["latest"] is None and report["newest_restorable"] is None


async def test_repair_on_clean_root_changes_nothing(tmp_path: Path) -> None:
    root = await make_root(tmp_path)
    before = snapshot(root)
    rc, report = fsck_json("--repair", "--deep", str(root))
    assert rc == 0 and report["repaired"] == []
    assert snapshot(root) == before


async def test_partial_tmp_dir(tmp_path: Path) -> None:
    root = await make_root(tmp_path)
    tmp = root / ".tmp-v000000000030-1234abcd"
    tmp.mkdir()
    (tmp / "seg-000000.bin").write_bytes(b"x" * 100)
    rc, report = fsck_json(str(root))
    assert rc == 1 and report["ok"] is False
    assert statuses(report)[0] == (tmp.name, "partial", 30)
    assert report["versions"][0]["ok"] is False
    assert report["newest_restorable"] == 20 and report["latest_problem"] is None
    rc, fixed = fsck_json("--repair", str(root))
    assert rc == 0 and fixed["repaired"] == [f"removed partial {tmp.name}"]
    assert not tmp.exists()


async def test_version_without_manifest_is_orphaned(tmp_path: Path) -> None:
    root = await make_root(tmp_path)
    orphan = root / version_dirname(5)
    orphan.mkdir()
    (orphan / "seg-000000.bin").write_bytes(b"x" * 100)
    stray = root / f".{LATEST}.0123456789ab.tmp"  # an interrupted LATEST update
    stray.write_text("30\n")
    record = root / ".LAYOUT.json.0123456789ab.tmp"  # an interrupted layout record update
    record.write_text("{")
    before = snapshot(root)
    rc, report = fsck_json(str(root))
    assert rc == 1
    got = {name: (status, step) for name, status, step in statuses(report)}
    assert got[orphan.name] == ("orphaned", 5)
    assert got[stray.name] == ("orphaned", None) and got[record.name] == ("orphaned", None)
    assert sorted(report["problems"]) == sorted([
        f"{orphan.name}: orphaned: no manifest: a retention delete that was interrupted",
        f"{stray.name}: orphaned: leftover of a LATEST update",
        f"{record.name}: orphaned: leftover of a layout record update"])
    rc, fixed = fsck_json("--repair", str(root))
    assert rc == 0
    assert sorted(fixed["repaired"]) == sorted([f"removed orphaned {orphan.name}", f"removed orphaned {stray.name}",
                                                f"removed orphaned {record.name}"])
    assert not orphan.exists() and not stray.exists() and not record.exists()
    kept = {k: v for k, v in before.items() if not k.startswith((orphan.name, stray.name, record.name))}
    assert snapshot(root) == kept  # the committed versions and LATEST are untouched


async def test_unreferenced_file_is_quarantined(tmp_path: Path) -> None:
    root = await make_root(tmp_path)
    vdir = root / version_dirname(20)
    extra = vdir / "notes.txt"
    extra.write_text("left here by hand")
    data_before = {k: v for k, v in snapshot(root).items() if k != f"{vdir.name}/notes.txt"}
    rc, report = fsck_json(str(root))
    assert rc == 1
    entry = report["versions"][1]
    assert (entry["name"], entry["status"], entry["ok"]) == (vdir.name, "committed", False)
    assert entry["unreferenced"] == ["notes.txt"]
    assert entry["problems"] == ["unreferenced file notes.txt"]
    assert report["newest_restorable"] == 20  # still restorable: the manifest's data is intact

    rc, fixed = fsck_json("--repair", str(root))
    assert rc == 0, fixed["problems"]
    assert fixed["repaired"][0].startswith(f"moved unreferenced {vdir.name}/notes.txt to {root / QUARANTINE}/")
    (moved,) = (root / QUARANTINE).iterdir()
    assert moved.name.startswith(f"{vdir.name}-notes.txt-")
    assert moved.read_text() == "left here by hand"
    after = {k: v for k, v in snapshot(root).items() if not k.startswith(QUARANTINE)}
    assert after == data_before  # the version's own files: same inodes, sizes, mtimes, bytes
    async with AsymStore([LocalTier(root)], **store_kw()) as store:
        ckpt = await store.restore()
    assert ckpt.step == 20 and not ckpt.fell_back and same_state(ckpt.tensors, make_state(20))


async def test_real_entry_points(tmp_path: Path) -> None:
    """``python -m asymstore.fsck`` and the ``asymstore-fsck`` script exit and print like ``main``."""
    roots = []
    for name in ("a", "b"):
        root = await make_root(tmp_path / name)
        (root / ".tmp-v000000000030-00000000").mkdir()
        (root / version_dirname(5)).mkdir()
        (root / LATEST).write_text("10\n")
        roots.append(root)
    want_rc, want = fsck_json(str(roots[0]))
    assert want_rc == 1
    script = Path(sys.executable).with_name("asymstore-fsck")
    commands = {
        "json": [sys.executable, "-m", "asymstore.fsck", "--json", str(roots[0])],
        "repair": [str(script), "--repair", str(roots[1])],
        "missing": [sys.executable, "-m", "asymstore.fsck", str(tmp_path / "missing")],
        "usage": [str(script), "--no-such-flag", str(roots[0])],
    }
    procs = {k: subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, c in commands.items()}  # started together: each pays for importing torch
    done = {k: (p.communicate(timeout=120), p.returncode) for k, p in procs.items()}

    (out, err), rc = done["json"]
    assert rc == 1, err
    assert json.loads(out) == want
    (out, err), rc = done["repair"]
    assert rc == 0, err
    assert out.splitlines()[-1] == "verdict: OK" and "repaired: set LATEST to 20" in out
    assert fsck_json(str(roots[1]))[0] == 0
    (out, err), rc = done["missing"]
    assert rc == 2 and "is not a directory" in err
    (out, err), rc = done["usage"]
    assert rc == 2 and "unrecognized arguments: --no-such-flag" in err


# -- remote tier locations -----------------------------------------------------


@pytest.fixture(params=["file", "s3"])
def remote_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/remote"
    uri: str = request.getfixturevalue("s3_uri")
    return uri


async def test_fsck_checks_and_repairs_remote_roots(remote_uri: str) -> None:
    from asymstore.tiers.remote.tier import RemoteTier

    async with AsymStore([RemoteTier(remote_uri)], keep_last=None, **store_kw()) as store:
        for step in (10, 20):
            await store.put_many(step, make_state(step))
            await store.commit(step, meta={"step": step})
    tier = RemoteTier(remote_uri)
    seg = f"{tier.root}/{version_dirname(20)}/seg-000000.bin"
    with tier.fs.open_input_file(seg) as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0x10  # same size: only --deep reads the bytes
    with tier.fs.open_output_stream(seg) as out:
        out.write(bytes(data))
    tier.fs.create_dir(f"{tier.root}/.tmp-v000000000030-deadbeef")
    with tier.fs.open_output_stream(f"{tier.root}/.tmp-v000000000030-deadbeef/seg-000000.bin") as out:
        out.write(b"left by a dead writer")

    rc, shallow = fsck_json(remote_uri)
    assert rc == 1 and shallow["root"] == remote_uri
    assert [(v["name"], v["status"]) for v in shallow["versions"]] == [
        (".tmp-v000000000030-deadbeef", "partial"), (version_dirname(10), "committed"),
        (version_dirname(20), "committed")]
    rc, deep = fsck_json("--deep", remote_uri)
    assert rc == 1 and deep["newest_restorable"] == 10
    (bad,) = [v for v in deep["versions"] if v["name"] == version_dirname(20)]
    assert bad["status"] == "corrupt" and any("checksum mismatch" in p for p in bad["problems"]), bad

    rc, fixed = fsck_json("--repair", remote_uri)  # implies --deep
    assert rc == 0 and fixed["ok"] and fixed["deep"], fixed["problems"]
    assert "moved corrupt v000000000020 to .quarantine/" in fixed["repaired"]
    assert "removed leftover .tmp-v000000000030-deadbeef" in fixed["repaired"]
    rc, after = fsck_json("--deep", remote_uri)
    assert rc == 0 and after["latest"] == after["newest_restorable"] == 10, after["problems"]
    async with AsymStore([RemoteTier(remote_uri)], **store_kw()) as store:
        ckpt = await store.restore()
    assert ckpt.step == 10 and not ckpt.fell_back and same_state(ckpt.tensors, make_state(10))


async def test_repair_refuses_a_root_with_a_live_writer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    async with AsymStore([LocalTier(root)], **store_kw()) as store:
        await store.put_many(1, make_state(1))
        await store.commit(1)
        (root / ".tmp-v000000000002-0badc0de").mkdir()  # looks partial, but a live writer holds the root
        rc, report = fsck_json(str(root))
        assert rc == 0 and report["writer"] and f"pid {os.getpid()}" in report["writer"]
        assert ("in_progress" in {v["status"] for v in report["versions"]})
        (root / version_dirname(1) / "stray.bin").write_bytes(b"x")
        assert main(["--repair", str(root)]) == 2
        assert "not repairing" in capsys.readouterr().err
        assert (root / ".tmp-v000000000002-0badc0de").is_dir()  # nothing touched
