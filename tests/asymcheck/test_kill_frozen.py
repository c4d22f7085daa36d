"""Kill tests of a frozen base (asymcheck.snapshot.frozen): SIGKILL, resume, bit-exact, the base copied once per run.

An own-loop LoRA-style model (tests/procs/asymcheck_child.py ``frozen``: a frozen MLP whose
middle weight is 256 KiB, a trainable low-rank adapter, AdamW over the adapter only) trains with
a version every step, dies by SIGKILL inside a forward, and a fresh process resumes: the result
equals an uninterrupted run without a Checkpointer byte for byte, and the resumed process copied
the frozen base from the model once (its first version after the restart), not once per version.
``frozenedit`` also edits the frozen weight between steps (one element under ``torch.no_grad()``,
which only the version counter sees, then a ``p.data`` edit, which only the byte sample sees)
before the kill: the resumed state must hold the edited bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.asymcheck.test_kill import KILLED, assert_bit_exact, assert_losses_match, finish, losses, spawn

pytestmark = pytest.mark.slow

ITERATIONS = 14
BASE = 256 * 256 * 4  # the frozen middle weight: the one parameter large enough to be taken as known
OTHERS = 128 << 10  # every other byte of a version (small frozen layers, adapter, its AdamW moments): ~92 KiB


def args(config: str, ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", config, "--dir", str(ckpt), "--out", str(out), "--iterations", str(ITERATIONS), *extra]


@pytest.mark.parametrize("config", ["frozen", "frozenedit"])
def test_frozen_base_resumes_bit_exact_after_sigkill(tmp_path: Path, config: str) -> None:
    ref, ckpt = tmp_path / "ref", tmp_path / "ckpt"
    procs = [spawn(*args(config, tmp_path / "unused", ref, "--no-ckpt")),
             spawn(*args(config, ckpt, tmp_path / "killed", "--kill", "forward:11"))]
    (rc_ref, _, err_ref), (rc_killed, _, err_killed) = (finish(p) for p in procs)
    assert rc_ref == 0, err_ref
    assert rc_killed == KILLED, f"the child was not killed (rc {rc_killed}):\n{err_killed}"
    rc, events, err = finish(spawn(*args(config, ckpt, tmp_path / "resumed")))
    assert rc == 0, err
    resumed: dict[str, Any] = next(e for e in events if e["event"] == "resumed")
    assert resumed["step"] >= 8  # past both edits of frozenedit (at the heads of iterations 4 and 6)
    assert_bit_exact(ref, tmp_path / "resumed")
    assert_losses_match(ref, tmp_path / "killed", tmp_path / "resumed", iterations=ITERATIONS)
    stats = next(e for e in events if e["event"] == "stats")
    assert stats["committed"] >= 3
    assert BASE <= stats["copy_bytes"] <= BASE + stats["committed"] * OTHERS, stats  # the base once after the restart
    if config == "frozenedit":
        assert max(rec["dropped"] for rec in losses(tmp_path / "killed")) == 1  # the p.data edit: one version
