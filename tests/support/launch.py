"""Start the scripts of tests/procs as child processes: ``python -m tests.procs.NAME`` with the repository importable.

The child finds ``tests`` (and so ``tests.support``) through ``PYTHONPATH``, whatever its working
directory; no script edits ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/support/launch.py -> ../..


def proc_argv(name: str, *args: str) -> list[str]:
    """The command line running ``tests/procs/NAME.py`` with ``args``, in this interpreter."""
    return [sys.executable, "-m", f"tests.procs.{name}", *args]


def proc_env(**extra: str) -> dict[str, str]:
    """This process's environment, the repository first on ``PYTHONPATH``, plus ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
