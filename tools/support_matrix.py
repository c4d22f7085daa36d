"""The support matrix: framework x configuration, every cell backed by a test or a refusal.

The data lives in ``docs/support-matrix.toml``: one table per framework (``[hf]``, ``[accelerate]``,
...), one entry per configuration (``ddp``, ``fsdp2``, ``deepspeed``, ``fp16``, ``bf16``, ``peft``,
``compile``, ``loader``) with:

- ``status``: ``"yes"`` (kill-and-resume tested on the CPU), ``"gpu"`` (the framework runs it on a GPU
  only: a ``gpu``-marked test, plus a CPU test of the same code path where there is one), ``"no"``
  (refused with a typed error before anything is written), ``"na"`` (does not apply), ``"untested"`` (not
  refused, but no test backs it yet: the ``note`` says what is known);
- ``tests``: pytest node ids (``path::function`` or ``path::function[param]``); a ``yes`` cell needs at
  least one, a ``gpu`` cell at least one marked ``gpu``; a function id without a parameter stands for
  all of its parametrizations;
- ``refusal``: for a ``no`` cell, the refused setting as its framework's refusal table in
  ``asymcheck/integrations/settings.py`` spells it (the reason is rendered from there), or ``note``;
- ``note``: a few words shown beside the cell (optional).

``python tools/support_matrix.py --write`` renders the matrix into README.md between
``<!-- SUPPORT -->`` and ``<!-- /SUPPORT -->``; ``--check`` (run by ``make docs``) fails when the README
block is stale, a cited test does not exist, a ``gpu`` cell cites no ``gpu`` test or a cited refusal is
no longer in its table. The docs page ``docs/guides/support.md`` is rendered by the mkdocs hook
``docs/hooks/refusals.py`` from the same data, with every cell's tests and reasons.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal, cast

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "support-matrix.toml"
README = ROOT / "README.md"
BEGIN, END = "<!-- SUPPORT -->", "<!-- /SUPPORT -->"

Status = Literal["yes", "gpu", "no", "na", "untested"]
STATUSES: tuple[Status, ...] = ("yes", "gpu", "no", "na", "untested")

FRAMEWORKS: dict[str, tuple[str, str | None]] = {
    "checkpointer": ("your own loop (`Checkpointer`)", None),
    "hf": ("Hugging Face Trainer", "HF_TRAINER"),
    "accelerate": ("Accelerate", "ACCELERATE"),
    "lightning": ("Lightning", "LIGHTNING"),
    "torchtitan": ("TorchTitan", "TORCHTITAN"),
}
"""Row key -> (the row's title, its refusal table in settings.py or None)."""

COLUMNS: dict[str, str] = {
    "ddp": "DDP", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed", "fp16": "fp16", "bf16": "bf16",
    "peft": "PEFT/LoRA", "compile": "torch.compile", "loader": "stateful loader",
}
"""Column key -> its heading."""

SYMBOL: dict[Status, str] = {"yes": "✅", "gpu": "✅ GPU", "no": "❌", "na": "—", "untested": "⚠️"}


class MatrixError(Exception):
    """The matrix data is malformed or disagrees with the tests or the refusal tables."""


@dataclass(frozen=True)
class Cell:
    """One framework x configuration cell."""

    status: Status
    tests: tuple[str, ...] = ()
    refusal: str | None = None
    note: str = ""


Matrix = dict[str, dict[str, Cell]]


def load(path: Path = DATA) -> Matrix:
    """The matrix from its TOML file, every row and column present.

    Raises:
        MatrixError: an unknown or missing row, column or status, or a field of the wrong type.
    """
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    if set(raw) != set(FRAMEWORKS):
        raise MatrixError(f"{path.name}: rows {sorted(raw)}, expected {sorted(FRAMEWORKS)}")
    matrix: Matrix = {}
    for row, cells in raw.items():
        if set(cells) != set(COLUMNS):
            raise MatrixError(f"{path.name} [{row}]: columns {sorted(cells)}, expected {sorted(COLUMNS)}")
        matrix[row] = {}
        for column, spec in cells.items():
            where = f"{path.name} [{row}] {column}"
            status = spec.get("status")
            if status not in STATUSES:
                raise MatrixError(f"{where}: status {status!r}, expected one of {STATUSES}")
            tests = spec.get("tests", [])
            if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
                raise MatrixError(f"{where}: tests must be a list of pytest node ids")
            unknown = set(spec) - {"status", "tests", "refusal", "note"}
            if unknown:
                raise MatrixError(f"{where}: unknown fields {sorted(unknown)}")
            matrix[row][column] = Cell(cast(Status, status), tuple(tests), spec.get("refusal"), spec.get("note", ""))
    return matrix


def settings() -> ModuleType:
    """``asymcheck/integrations/settings.py`` loaded from its file (it imports nothing of the package)."""
    name = "asymcheck_support_matrix_settings"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "asymcheck" / "integrations" / "settings.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def reason(row: str, cell: Cell) -> str:
    """Why a ``no`` cell is refused: its refusal table's reason, else its note."""
    table = FRAMEWORKS[row][1]
    if cell.refusal is not None and table is not None:
        for entry in getattr(settings(), table):
            if entry.setting == cell.refusal:
                return f"`{cell.refusal}`: {entry.why}"
    return cell.note


def cited(test: str, collected: set[str]) -> bool:
    """Whether ``test`` names a collected node (a function id stands for all its parametrizations)."""
    return test in collected or any(node.startswith(test + "[") for node in collected)


def problems(matrix: Matrix, collected: set[str], gpu: set[str]) -> list[str]:
    """Every disagreement of ``matrix`` with the collected tests (``gpu``: those marked gpu) and the tables."""
    found: list[str] = []
    for row, cells in matrix.items():
        table = FRAMEWORKS[row][1]
        names = {entry.setting for entry in getattr(settings(), table)} if table is not None else set()
        for column, cell in cells.items():
            where = f"[{row}] {column}"
            for test in cell.tests:
                if not cited(test, collected):
                    found.append(f"{where}: no such test {test}")
            if cell.status in ("yes", "gpu") and not cell.tests:
                found.append(f"{where}: status {cell.status!r} cites no test")
            if cell.status == "gpu" and not any(cited(test, gpu) for test in cell.tests):
                found.append(f"{where}: status 'gpu' cites no test marked gpu")
            if cell.status in ("no", "untested", "na") and cell.refusal is None and not cell.note:
                found.append(f"{where}: a {cell.status!r} cell names its refusal or a note")
            if cell.status == "no":
                if cell.refusal is not None and cell.refusal not in names:
                    found.append(f"{where}: refusal {cell.refusal!r} is not in {table or 'any refusal table'}")
            if cell.status != "no" and cell.refusal is not None:
                found.append(f"{where}: refusal {cell.refusal!r} on a cell that is not refused")
    return found


def render_table(matrix: Matrix, *, link: str) -> str:
    """The Markdown table: a row per framework, a column per configuration, ``link`` under it."""
    lines = ["| | " + " | ".join(COLUMNS.values()) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for row, (title, _) in FRAMEWORKS.items():
        lines.append(f"| {title} | " + " | ".join(SYMBOL[matrix[row][c].status] for c in COLUMNS) + " |")
    legend = ("✅ killed and resumed bit-exact in `make test` (CPU); ✅ GPU: the framework runs it on a GPU only, "
              "tested by `make gpu-test`; ❌ refused with a typed error before anything is written; ⚠️ accepted but "
              f"not yet tested; — does not apply. Each cell's tests and each refusal's reason: {link}.")
    return "\n".join(lines) + "\n\n" + legend + "\n"


def render_details(matrix: Matrix) -> str:
    """Per framework, each cell with the tests that back it or the reason it is refused (the docs page)."""
    out: list[str] = []
    for row, (title, _) in FRAMEWORKS.items():
        out += [f"### {title}", "", "| configuration | | backed by / why |", "|---|---|---|"]
        for column, heading in COLUMNS.items():
            cell = matrix[row][column]
            if cell.status == "no":
                detail = reason(row, cell)
            else:
                detail = "<br>".join(f"`{test}`" for test in cell.tests)
                if cell.note:
                    detail = f"{cell.note}<br>{detail}" if detail else cell.note
            out.append(f"| {heading} | {SYMBOL[cell.status]} | {detail.replace('|', chr(92) + '|')} |")
        out.append("")
    return "\n".join(out)


def readme_block(matrix: Matrix) -> str:
    """What stands between the README's markers."""
    return f"{BEGIN}\n{render_table(matrix, link='[the support matrix](docs/guides/support.md)')}{END}"


def replace_block(text: str, block: str) -> str:
    """``text`` with its marked block replaced by ``block``.

    Raises:
        MatrixError: the markers are missing.
    """
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise MatrixError(f"README.md has no {BEGIN} ... {END} block")
    return text[:start] + block + text[stop + len(END):]


def collect(tests: set[str]) -> tuple[set[str], set[str]]:
    """The node ids pytest collects from the files ``tests`` name (every mark), and those marked gpu."""
    import pytest

    class Recorder:
        def __init__(self) -> None:
            self.all: set[str] = set()
            self.gpu: set[str] = set()

        def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
            for item in items:
                self.all.add(item.nodeid)
                if item.get_closest_marker("gpu") is not None:
                    self.gpu.add(item.nodeid)

    files = sorted({test.split("::", 1)[0] for test in tests})
    missing = [f for f in files if not (ROOT / f).is_file()]
    recorder = Recorder()
    present = [f for f in files if f not in missing]
    if present:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = pytest.main(["--collect-only", "-q", "-m", "", "-p", "no:cacheprovider", *present],
                               plugins=[recorder])
        if code not in (0, 5):
            raise MatrixError(f"collecting {present} failed (pytest exit code {code}):\n{out.getvalue()[-3000:]}")
    return recorder.all, recorder.gpu


def main(argv: list[str] | None = None) -> int:
    """``--write`` the README block, or ``--check`` everything; 1 on a problem."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="render the matrix into README.md")
    mode.add_argument("--check", action="store_true", help="check the README block, the tests and the refusals")
    args = parser.parse_args(argv)
    try:
        matrix = load()
        text = README.read_text(encoding="utf-8")
        new = replace_block(text, readme_block(matrix))
    except MatrixError as e:
        print(f"support matrix: {e}", file=sys.stderr)
        return 1
    if args.write:
        README.write_text(new, encoding="utf-8")
        return 0
    found = [] if new == text else ["README.md: the support matrix block is stale (python tools/support_matrix.py "
                                    "--write)"]
    tests = {test for cells in matrix.values() for cell in cells.values() for test in cell.tests}
    try:
        collected, gpu = collect(tests)
    except MatrixError as e:
        print(f"support matrix: {e}", file=sys.stderr)
        return 1
    found += problems(matrix, collected, gpu)
    for problem in found:
        print(f"support matrix: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
