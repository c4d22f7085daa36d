"""Run mypy (strict) on a snippet whose wrong lines end in ``# LINE <name>``: each must be flagged, no other."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def assert_mypy_flags_exactly_the_marked_lines(snippet: str, tmp_path: Path, *, timeout_s: float = 900) -> None:
    """mypy reports an error on every ``# LINE`` line of ``snippet`` (dedented) and on no other line."""
    pytest.importorskip("mypy")
    source = textwrap.dedent(snippet)
    path = tmp_path / "snippet.py"
    path.write_text(source)
    expected = {i + 1: line.split("# LINE ")[1] for i, line in enumerate(source.splitlines()) if "# LINE " in line}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--ignore-missing-imports", "--no-error-summary",
         "--follow-imports=silent", "--cache-dir", str(ROOT / ".mypy_cache"), "--python-version", "3.11",
         str(path)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    errors: dict[int, list[str]] = {}
    for line in done.stdout.splitlines():
        if line.startswith(str(path)) and ": error:" in line:
            errors.setdefault(int(line.split(":")[1]), []).append(line)
    assert done.returncode == 1, done.stdout + done.stderr
    missing = {name for lineno, name in expected.items() if lineno not in errors}
    assert not missing, f"mypy did not flag {sorted(missing)}:\n{done.stdout}"
    unexpected = {lineno: msgs for lineno, msgs in errors.items() if lineno not in expected}
    assert not unexpected, f"mypy flagged correct lines:\n{done.stdout}"
