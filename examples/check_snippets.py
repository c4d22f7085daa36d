"""Check the documentation's code against examples/ and run every example.

1. Every ```python block of README.md must appear, verbatim, in one of the
   examples/*.py files (the README cannot include files; the docs do).
2. Every ```python block of docs/**/*.md must only include an example
   (``--8<-- "examples/NAME.py"`` or ``--8<-- "examples/NAME.py:section"``).
3. Every examples/*.py except this one runs with this interpreter, each in a
   fresh temporary working directory (removed afterwards), within a time limit,
   two at a time (``--jobs``). An example in a folder of its own (``examples/ray_train/``: it starts a
   Ray cluster) runs in the test that names its path instead: each one a page includes must be named
   by a test under tests/.

Usage: ``python examples/check_snippets.py [--timeout SECONDS] [--jobs N] [NAME.py ...]``
(names: run only those examples; the documentation checks always run).
Exits 1 when anything fails.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INCLUDE = re.compile(r'^\s*--8<--\s+"examples/[\w./-]+\.py(:[\w-]+)?"\s*$')


def examples() -> list[Path]:
    return sorted(p for p in EXAMPLES.glob("*.py") if p.name != Path(__file__).name)


def check_readme() -> list[str]:
    sources = {p.name: p.read_text() for p in examples()}
    problems = []
    for n, block in enumerate(FENCE.findall((ROOT / "README.md").read_text()), 1):
        if not any(block in text for text in sources.values()):
            first = block.strip().splitlines()[0] if block.strip() else "(empty)"
            problems.append(f"README.md: python block {n} ({first!r}) is in no examples/*.py file")
    return problems


def check_docs() -> list[str]:
    problems = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for n, block in enumerate(FENCE.findall(page.read_text()), 1):
            lines = [line for line in block.splitlines() if line.strip()]
            if not lines or not all(INCLUDE.match(line) for line in lines):
                problems.append(f"{page.relative_to(ROOT)}: python block {n} does not include an examples/ file")
    return problems


def check_run_by_tests() -> list[str]:
    """Every included example outside examples/*.py is named (its path from the root) by a test under tests/."""
    included = {m.group(1) for page in (ROOT / "docs").rglob("*.md")
                for m in re.finditer(r'^\s*--8<--\s+"(examples/[\w./-]+\.py)', page.read_text(), re.MULTILINE)}
    direct = {f"examples/{p.name}" for p in examples()}
    tests = [p.read_text() for p in (ROOT / "tests").rglob("test_*.py")]
    problems = []
    for path in sorted(included - direct):
        if not (ROOT / path).is_file():
            problems.append(f"{path}: included by the docs, missing")
        elif not any(path in text for text in tests):
            problems.append(f"{path}: included by the docs, run neither here nor by a test naming it")
    return problems


def run(example: Path, timeout: float) -> tuple[bool, float, str]:
    workdir = tempfile.mkdtemp(prefix=f"example-{example.stem}-")
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(example)], cwd=workdir, capture_output=True, text=True,
                              timeout=timeout, check=False)
        ok, output = done.returncode == 0, done.stdout + done.stderr
        if not ok:
            output += f"\nexit status {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        ok = False
        output = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {timeout:.0f} s"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return ok, time.perf_counter() - started, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds each example may take (default 120)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="examples run at once (default 2: each is mostly one process importing torch)")
    parser.add_argument("names", nargs="*", help="run only these examples (file names under examples/)")
    args = parser.parse_args()
    problems = check_readme() + check_docs() + check_run_by_tests()
    for problem in problems:
        print(f"FAIL {problem}")
    chosen = [p for p in examples() if not args.names or p.name in args.names]
    unknown = set(args.names) - {p.name for p in chosen}
    if unknown:
        problems.append(f"unknown examples: {sorted(unknown)}")
        print(f"FAIL unknown examples: {sorted(unknown)}")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # results printed in order as they come
        results = pool.map(lambda example: run(example, args.timeout), chosen)
        for example, (ok, seconds, output) in zip(chosen, results, strict=True):
            print(f"{'ok  ' if ok else 'FAIL'} examples/{example.name} ({seconds:.1f} s)", flush=True)
            if not ok:
                problems.append(example.name)
                print("    " + output.strip().replace("\n", "\n    "), flush=True)
    print(f"{len(chosen)} examples run, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
