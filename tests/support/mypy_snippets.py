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
        # the project's own mypy options (pyproject.toml: strict, ignore_missing_imports, python 3.11) and cache:
        # with the same options every snippet and `make test`'s mypy share one cache, so the packages are
        # analysed once per run (other options invalidate each module's cache entry: ~60 s per call)
        [sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(ROOT / ".mypy_cache"), str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    errors: dict[int, list[str]] = {}
    for line in done.stdout.splitlines():
        # by file name, not by path: mypy (2.4) reports an unchanged module's errors from its cache, under the
        # path it had then (another test run's tmp_path)
        head, _, rest = line.partition(":")
        if Path(head).name == path.name and ": error:" in line:
            errors.setdefault(int(rest.split(":")[0]), []).append(line)
    assert done.returncode == 1, done.stdout + done.stderr
    missing = {name for lineno, name in expected.items() if lineno not in errors}
    assert not missing, f"mypy did not flag {sorted(missing)}:\n{done.stdout}"
    unexpected = {lineno: msgs for lineno, msgs in errors.items() if lineno not in expected}
    assert not unexpected, f"mypy flagged correct lines:\n{done.stdout}"
