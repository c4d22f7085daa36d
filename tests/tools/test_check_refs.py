"""tools/check_refs.py: every docstring reference of the packages resolves, and an unknown one fails the check.

The fixtures are small packages written into a temporary repository, so the checker is shown to find each kind
of rot (a role target gone, a relative module gone, a file gone, a DESIGN section) and to accept each way a
good reference is written (relative, ``~``, a title, re-exports through ``__init__`` and a lazy table,
inherited members, attributes of ``self``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.tools import load_tool

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "check_refs.py"



check_refs = load_tool("check_refs")

GOOD = {
    "pkg/__init__.py": '''
        """The package: :class:`Thing` and :func:`helper` re-exported, :class:`Lazy` lazily, :class:`Later` typed.

        See docs/guides/x.md and examples/y.py; the sub-module :mod:`.helpers`.
        """

        from typing import TYPE_CHECKING

        from pkg.core import Thing
        from pkg.helpers import helper as helper

        if TYPE_CHECKING:
            from pkg.later import Later

        _LAZY = {"Lazy": "pkg.later"}
        __getattr__ = lazy_getattr(__name__, _LAZY)
        __all__ = ["Later", "Lazy", "Thing", "helper"]
        ''',
    "pkg/helpers.py": '''
        """Helpers; :mod:`pkg.core` uses them (and :func:`~pkg.helpers.helper`)."""


        def helper() -> int:
            """One; see :func:`pkg.helper` and :meth:`pkg.Thing.run()`."""
            return 1
        ''',
    "pkg/later.py": '''
        """Loaded on first use."""


        class Lazy:
            """:meth:`go` and :meth:`pkg.Lazy.go` name the same method."""

            def go(self) -> None:
                """Go."""


        class Later:
            """Named under ``if TYPE_CHECKING:`` only."""
        ''',
    "pkg/core.py": '''
        """The core: :class:`Thing` (:class:`the thing <pkg.core.Thing>`), :mod:`.helpers`, :exc:`ValueError`.

        Benchmarked by benches/ (tests/ hold its tests), :func:`aiofiles.open` outside the package.
        """

        from pkg import helpers
        from pkg.helpers import helper

        LIMIT: int = 3
        """Never more than :data:`LIMIT`; :func:`helper` and :func:`helpers.helper` are one."""


        class Base:
            def run(self) -> None:
                """Run: :meth:`Child.run` is inherited."""


        class Thing(Base):
            """A thing: :meth:`run`, :attr:`size`, :attr:`Thing.size`, :meth:`~.Thing.grow`, :data:`.LIMIT`.

            see ``Thing.size``; see ``unknown_local.name`` (not a name of the package: left alone).
            """

            def __init__(self) -> None:
                self.size = 0
                self.owner: Base | None = None

            def grow(self) -> None:
                """Grow; see ``owner.run`` and :meth:`owner.run`."""


        class Child(Thing):
            """:meth:`grow` from its parent, :meth:`pkg.core.Child.run` from its grandparent."""
        ''',
    "docs/guides/x.md": "# x\n",
    "examples/y.py": "",
    "benches/z.py": "",
    "tests/test_pkg.py": "",
}


def _repo(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return tmp_path


def _findings(root: Path) -> list[str]:
    return [f.render(root) for f in check_refs.check(root, ("pkg",))]


def test_every_way_of_writing_a_good_reference_resolves(tmp_path: Path) -> None:
    assert _findings(_repo(tmp_path, GOOD)) == []


BAD = [
    # (docstring text on line 3 of pkg/bad.py, what the finding names)
    (":mod:`.gone`", ":mod:`.gone`"),
    (":mod:`pkg.core.Thing`", "not a module"),
    (":func:`pkg.helpers.missing`", ":func:`pkg.helpers.missing`"),
    (":class:`~pkg.Nope`", ":class:`~pkg.Nope`"),
    (":class:`Thing`", ":class:`Thing`"),  # not imported here, and no top-level name
    (":meth:`pkg.core.Thing.shrink`", ":meth:`pkg.core.Thing.shrink`"),
    (":attr:`pkg.core.Thing.weight`", ":attr:`pkg.core.Thing.weight`"),
    (":meth:`pkg.Lazy.stop`", ":meth:`pkg.Lazy.stop`"),
    (":func:`aiofiles.nothing_here`", ":func:`aiofiles.nothing_here`"),
    (":mod:`..outside`", ":mod:`..outside`"),
    ("see DESIGN §4 for why", "DESIGN §4"),
    ("see docs/guides/missing.md", "docs/guides/missing.md"),
    ("the script examples/gone.py", "examples/gone.py"),
    ("benches/nothing.py measures it", "benches/nothing.py"),
    ("tests/nowhere/test_x.py::test_y", "tests/nowhere/test_x.py"),
    ("see ``helpers.missing``", "see ``helpers.missing``"),
]


@pytest.mark.parametrize(("text", "named"), BAD, ids=[b[1] for b in BAD])
def test_an_unknown_reference_is_reported_at_its_line(tmp_path: Path, text: str, named: str) -> None:
    bad = f'"""A module.\n\nIt has {text}.\n"""\n\nfrom pkg import helpers\n'
    root = _repo(tmp_path, {**GOOD, "pkg/bad.py": bad})
    findings = _findings(root)
    assert len(findings) == 1, findings
    assert findings[0].startswith("pkg/bad.py:3: ")
    assert named in findings[0]


def test_references_in_a_method_resolve_in_its_class_and_report_their_own_line(tmp_path: Path) -> None:
    bad = '''
        """Fine: :class:`pkg.Thing`."""


        class Other:
            """Fine: :meth:`act`."""

            def act(self) -> None:
                """Fine: :meth:`act`, :meth:`Other.act`.

                Not fine: :meth:`react`.
                """
        '''
    root = _repo(tmp_path, {**GOOD, "pkg/bad.py": bad})
    assert _findings(root) == ["pkg/bad.py:10: :meth:`react` -> unknown target"]


def test_the_command_exits_1_listing_what_is_unknown_and_0_when_all_resolves(tmp_path: Path) -> None:
    root = _repo(tmp_path, {**GOOD, "pkg/bad.py": '"""See :mod:`.reshardread`."""\n'})
    run = [sys.executable, str(TOOL), "--root", str(root), "pkg"]
    failed = subprocess.run(run, capture_output=True, text=True, timeout=120, check=False)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "pkg/bad.py:1: :mod:`.reshardread` -> unknown target" in failed.stdout
    (root / "pkg" / "bad.py").write_text('"""See :mod:`.helpers`."""\n')
    passed = subprocess.run(run, capture_output=True, text=True, timeout=120, check=False)
    assert passed.returncode == 0, passed.stdout + passed.stderr


def test_every_reference_in_the_repository_resolves() -> None:
    done = subprocess.run([sys.executable, str(TOOL)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
