"""What the store tests and their child process (tests/procs/store_child.py) share: states, options, fsck runners.

The tensors of a step are a pure function of the step (``make_state``), so a
test can check bit-exact what a killed child committed. ``spawn`` starts the
child; see tests/procs/store_child.py for its modes.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from typing import Any

import torch

from asymstore.fsck.__main__ import main as fsck_main
from tests.support.launch import proc_argv, proc_env

SEGMENT_BYTES = 4096  # a version is ~8 KiB: two segments


def store_kw(compression: str = "never") -> dict[str, Any]:
    """AsymStore options of these tests: fixed small segments, so no calibration probe runs."""
    return {"segment_bytes": SEGMENT_BYTES, "compression": compression}


def step_of(i: int) -> int:
    """The step number of the i-th commit (not contiguous on purpose)."""
    return 10 * (i + 1)


def make_state(step: int, salt: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * salt + step)
    return {
        "w": torch.randn(48, 40, generator=g),
        "b": torch.randn(40, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (17,), generator=g),
        "mask": torch.rand(23, generator=g) > 0.5,
        "step": torch.tensor(step),
    }


def make_frozen_state(step: int) -> dict[str, torch.Tensor]:
    """A LoRA-style state: a frozen base (the same bytes at every step) and a small adapter of ``step``."""
    base = torch.Generator().manual_seed(7)
    g = torch.Generator().manual_seed(step)
    return {
        "base.w": torch.randn(64, 48, generator=base),
        "base.emb": torch.randn(40, 32, generator=base).to(torch.bfloat16),
        "adapter.a": torch.randn(48, 4, generator=g),
        "step": torch.tensor(step),
    }


def same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """True when both hold the same names with bit-identical dtype, shape and bytes."""
    if got.keys() != want.keys():
        return False
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            return False
        if not torch.equal(g.contiguous().view(-1).view(torch.uint8), w.contiguous().view(-1).view(torch.uint8)):
            return False
    return True


def fsck(*args: str) -> tuple[int, str]:
    """Run the fsck CLI (``python -m asymstore.fsck ARGS``) in this process; return (exit status, stdout).

    Same ``main`` as the ``python -m`` entry point, without paying for a fresh
    interpreter (importing torch) on every call; test_fsck_cli.py checks the
    real entry points agree with it.
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fsck_main(list(args))
    return rc, out.getvalue()


def fsck_json(*args: str) -> tuple[int, dict[str, Any]]:
    """Run ``fsck --json ARGS``; return (exit status, parsed report)."""
    rc, out = fsck("--json", *args)
    return rc, json.loads(out)


def fsck_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m asymstore.fsck ARGS`` as a real child process."""
    return subprocess.run([sys.executable, "-m", "asymstore.fsck", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def statuses(report: dict[str, Any]) -> dict[str, str]:
    """Entry name -> status of an fsck --json report."""
    return {v["name"]: v["status"] for v in report["versions"]}


def spawn(*args: str) -> subprocess.Popen[str]:
    """Start tests/procs/store_child.py as a child process with ``args`` (stdin, stdout and stderr piped)."""
    return subprocess.Popen(proc_argv("store_child", *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=proc_env(OMP_NUM_THREADS="1"))


def committed_steps(stdout: str) -> list[int]:
    """The steps a child reported as committed."""
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("committed ")]
