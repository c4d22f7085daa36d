"""tools/support_matrix.py: the support matrix's data is checked against the tests and the refusal tables.

Each kind of rot the check exists for is shown to fail it on a small matrix (a cited test gone, a ✅ with no
test, a GPU cell with no gpu test, a refusal no longer in its table, a refusal on a supported cell, an
unknown status in the file), and the repository's own matrix loads, names only refusals that exist and is
what README.md shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tools import load_tool

REPO = Path(__file__).resolve().parents[2]



sm = load_tool("support_matrix")
T = "tests/x/test_a.py::test_kill"


def _matrix(**cells: object) -> dict[str, dict[str, object]]:
    """Every cell "na" with a note, but those given as ``row__column``."""
    matrix = {row: {col: sm.Cell("na", note="n/a") for col in sm.COLUMNS} for row in sm.FRAMEWORKS}
    for key, cell in cells.items():
        row, col = key.split("__")
        matrix[row][col] = cell
    return matrix


def test_a_consistent_matrix_has_no_problems() -> None:
    refused = sm.settings().HF_TRAINER[1].setting
    m = _matrix(hf__ddp=sm.Cell("yes", (T,)), hf__fp16=sm.Cell("gpu", (T + "[cuda]",)),
                hf__fsdp2=sm.Cell("no", refusal=refused))
    assert sm.problems(m, {T + "[cpu]", T + "[cuda]"}, {T + "[cuda]"}) == []


@pytest.mark.parametrize(("cell", "collected", "gpu", "expect"), [
    (sm.Cell("yes", (T,)), set(), set(), "no such test"),
    (sm.Cell("yes", (T + "[a]",)), {T + "[b]"}, set(), "no such test"),
    (sm.Cell("yes"), set(), set(), "cites no test"),
    (sm.Cell("gpu", (T,)), {T}, set(), "cites no test marked gpu"),
    (sm.Cell("no", refusal="a setting no table has"), set(), set(), "is not in HF_TRAINER"),
    (sm.Cell("no"), set(), set(), "names its refusal or a note"),
    (sm.Cell("untested"), set(), set(), "names its refusal or a note"),
    (sm.Cell("yes", (T,), refusal="fsdp"), {T}, set(), "on a cell that is not refused"),
])
def test_each_kind_of_rot_is_found(cell: object, collected: set[str], gpu: set[str], expect: str) -> None:
    found = sm.problems(_matrix(hf__ddp=cell), collected, gpu)
    assert len(found) == 1 and expect in found[0] and found[0].startswith("[hf] ddp")


def test_the_file_is_checked_for_unknown_statuses_rows_and_columns(tmp_path: Path) -> None:
    text = (REPO / "docs" / "support-matrix.toml").read_text(encoding="utf-8")
    for bad, expect in ((text.replace('status = "yes"', 'status = "maybe"', 1), "status 'maybe'"),
                        (text + '\n[jax]\nddp = { status = "na", note = "x" }\n', "rows"),
                        (text.replace("ddp = {", "dpp = {", 1), "columns")):
        path = tmp_path / "m.toml"
        path.write_text(bad, encoding="utf-8")
        with pytest.raises(sm.MatrixError, match=expect):
            sm.load(path)


def test_the_repository_matrix_is_what_the_readme_shows() -> None:
    matrix = sm.load()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert sm.readme_block(matrix) in readme
    cited = {test for cells in matrix.values() for cell in cells.values() for test in cell.tests}
    assert sm.problems(matrix, cited, cited) == []  # the refusals it names are in their tables (make docs collects)
