"""mkdocs hook: each framework guide's refused settings and the support matrix, rendered from their data.

A guide says ``<!-- refusals: NAME -->`` where its table goes (``NAME`` a key of :data:`TABLES`); the
hook replaces the marker with a Markdown table of that framework's :class:`Refusal` entries and the
version its tests exercise, so the lists are kept once, in the tested constants. A page saying
``<!-- support-matrix -->`` gets the support matrix of ``docs/support-matrix.toml`` (rendered by
``tools/support_matrix.py``, which checks it). Registered in
mkdocs.yml (``hooks:``). ``settings.py`` is loaded from its file: it imports nothing of the package,
so the docs build does not import torch for it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*refusals:\s*([\w-]+)\s*-->")
MATRIX = "<!-- support-matrix -->"

TABLES = {"accelerate": ("ACCELERATE", "accelerate"), "hf": ("HF_TRAINER", "transformers"),
          "lightning": ("LIGHTNING", "lightning"), "torchtitan": ("TORCHTITAN", "torchtitan"),
          "ray": ("RAY", "ray")}
"""Marker name -> (the table in settings.py, the package whose tested version it names)."""

GUIDES = {"accelerate": "guides/accelerate.md", "hf": "guides/hf-trainer.md", "lightning": "guides/lightning.md",
          "torchtitan": "guides/torchtitan.md", "ray": "guides/ray.md"}
"""Marker name -> the guide (under docs/) that must hold it."""


def tool() -> ModuleType:
    """``tools/support_matrix.py``, loaded from its file (it loads ``settings.py`` from its file in turn)."""
    name = "asymcheck_docs_support_matrix"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "support_matrix.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def settings() -> ModuleType:
    """``asymcheck/integrations/settings.py``, loaded from its file (no torch imported for it)."""
    loaded: ModuleType = tool().settings()
    return loaded


def support_matrix() -> str:
    """The support matrix, then per framework each cell's tests or reason (``docs/support-matrix.toml``)."""
    support = tool()
    matrix = support.load()
    table: str = support.render_table(matrix, link="below, per framework")
    details: str = support.render_details(matrix)
    return f"{table}\n## Per framework\n\n{details}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(name: str) -> str:
    """The Markdown table of the refusals of ``name`` (a key of :data:`TABLES`).

    Raises:
        KeyError: no such table.
    """
    table, package = TABLES[name]
    module = settings()
    major, minor = module.TESTED[package]
    lines = ["| Setting | Why it is refused |", "| --- | --- |"]
    for entry in getattr(module, table):
        setting = f"{package} other than {major}.{minor}.x" if entry.setting == "version" else entry.setting
        lines.append(f"| `{_cell(setting)}` | {_cell(entry.why)} |")
    return "\n".join(lines) + "\n"


def replace_markers(markdown: str, where: str = "a page") -> str:
    """``markdown`` with each refusal marker replaced by its table.

    Raises:
        ValueError: a marker names no table.
    """

    def table(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise ValueError(f"{where}: <!-- refusals: {name} --> names no table (known: {', '.join(TABLES)})")
        return render(name)

    return MARKER.sub(table, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """The mkdocs event: replace the refusal markers and the support-matrix marker of a page."""
    markdown = replace_markers(markdown, getattr(getattr(page, "file", None), "src_uri", "a page"))
    return markdown.replace(MATRIX, support_matrix()) if MATRIX in markdown else markdown
