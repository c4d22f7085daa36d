"""mkdocs hook: the support matrix, rendered from ``docs/support-matrix.toml`` by ``tools/support_matrix.py``.

A page says ``<!-- support-matrix -->`` where the matrix goes: the hook puts the table there and, under
it, per framework each cell with the tests that back it or the reason it is refused. The tool is
loaded from its file (it imports nothing of the package), so the docs build imports no torch for it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- support-matrix -->"


def tool() -> ModuleType:
    """``tools/support_matrix.py``, loaded from its file."""
    name = "asymcheck_docs_support_matrix"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "support_matrix.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def render() -> str:
    """The matrix and its details, as Markdown."""
    support = tool()
    matrix = support.load()
    table: str = support.render_table(matrix, link="below, per framework")
    details: str = support.render_details(matrix)
    return f"{table}\n## Per framework\n\n{details}"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """The mkdocs event: replace the support-matrix marker of a page."""
    return markdown.replace(MARKER, render()) if MARKER in markdown else markdown
