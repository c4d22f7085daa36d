"""The harness the benches share: the hidden ``--child`` flag, fresh-process children, interleaved (ABBA) rounds.

A bench that compares methods runs each measurement in a fresh process (this script again, with
``--child ...``), so no method inherits another's heap, page cache state or imported modules, and
runs the methods in rounds whose order changes (:func:`order`), so a drift of the machine during a
bench does not favour one method. Imported as a sibling module (``from harness import ...``), like
``common``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# -- argument parsing --------------------------------------------------------------------------


def add_child_flag(ap: argparse.ArgumentParser, nargs: int | None = None,
                   metavar: tuple[str, ...] | None = None) -> None:
    """The hidden ``--child`` option a parent passes to the fresh process it starts (default None: the parent)."""
    if nargs is None:
        ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    else:
        ap.add_argument("--child", nargs=nargs, metavar=metavar, default=None, help=argparse.SUPPRESS)


def add_quick_flag(ap: argparse.ArgumentParser, what: str) -> None:
    """``--quick``: the bench's smallest mode (``what`` says what it runs and how long it takes)."""
    ap.add_argument("--quick", action="store_true", help=what)


# -- fresh-process children --------------------------------------------------------------------


def child_argv(script: str, *args: str) -> list[str]:
    """The command line running ``script`` again in this interpreter with ``args`` (``--child ...`` among them)."""
    return [sys.executable, os.path.abspath(script), *args]


@dataclass
class Run:
    """How one fresh process ended: exit code (-1: timed out), stdout, stderr, wall seconds, 1-minute load at start."""

    code: int
    stdout: str
    stderr: str
    seconds: float
    loadavg_1m: float

    @property
    def log(self) -> str:
        """stdout then stderr."""
        return self.stdout + self.stderr

    def last_json(self) -> dict[str, Any]:
        """The JSON object on the last line of stdout (a child's result)."""
        return dict(json.loads(self.stdout.strip().splitlines()[-1]))


def settle() -> None:
    """Write back the previous run's dirty pages and let the disk go quiet before the next measurement."""
    os.sync()
    time.sleep(0.5)


def run_fresh(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
              cwd: str | os.PathLike[str] | None = None, capture: bool = True) -> Run:
    """Run ``argv`` in a fresh process and wait for it (``env`` added to this process's environment).

    With ``capture`` off the child's output goes to this process's; past ``timeout`` the child is
    killed and the run's code is -1, its log saying so.
    """
    penv = dict(os.environ, **(env or {}))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(argv), capture_output=capture, text=True, timeout=timeout, cwd=cwd, env=penv,
                              check=False)
        code, out, err = proc.returncode, proc.stdout or "", proc.stderr or ""
    except subprocess.TimeoutExpired as exc:
        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        code, out, err = -1, f"timed out after {timeout:.0f} s\n{text(exc.stdout)}", text(exc.stderr)
    return Run(code, out, err, time.perf_counter() - t0, load)


def take_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the JSON result a child wrote to ``path``, and remove the file."""
    out: dict[str, Any] = json.loads(Path(path).read_text())
    Path(path).unlink()
    return out


# -- interleaved rounds ------------------------------------------------------------------------


def order(methods: list[str], rnd: int, *, rotate: bool = True) -> list[str]:
    """Round ``rnd``'s order of ``methods``: rotated by ``rnd // 2``, reversed on odd rounds (ABC CBA BCA ACB ...).

    Every method runs first, last and in between as often as the others, and each pair of rounds
    is interleaved ABBA, so a drift of the machine during a bench does not favour one method.
    ``rotate=False``: only the reversal (AB BA AB BA ...).
    """
    k = (rnd // 2) % len(methods) if rotate else 0
    rotated = methods[k:] + methods[:k]
    return rotated[::-1] if rnd % 2 else rotated


def rounds(methods: list[str], n: int, *, rotate: bool = True) -> Iterator[tuple[int, str]]:
    """``(round, method)`` for ``n`` rounds of every method, in :func:`order`."""
    for rnd in range(n):
        for method in order(methods, rnd, rotate=rotate):
            yield rnd, method
