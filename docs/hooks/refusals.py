"""mkdocs hook: each framework guide's refused settings, rendered from ``asymcheck.integrations.settings``.

A guide says ``<!-- refusals: NAME -->`` where its table goes (``NAME`` a key of :data:`TABLES`); the
hook replaces the marker with a Markdown table of that framework's :class:`Refusal` entries and the
version its tests exercise, so the lists are kept once, in the tested constants. Registered in
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

TABLES = {"accelerate": ("ACCELERATE", "accelerate"), "hf": ("HF_TRAINER", "transformers"),
          "lightning": ("LIGHTNING", "lightning")}
"""Marker name -> (the table in settings.py, the package whose tested version it names)."""

GUIDES = {"accelerate": "guides/accelerate.md", "hf": "guides/hf-trainer.md", "lightning": "guides/lightning.md"}
"""Marker name -> the guide (under docs/) that must hold it."""


def settings() -> ModuleType:
    """``asymcheck/integrations/settings.py``, loaded from its file."""
    name = "asymcheck_docs_refusal_settings"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "asymcheck" / "integrations" / "settings.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


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
    """The mkdocs event: replace the refusal markers of a page."""
    return replace_markers(markdown, getattr(getattr(page, "file", None), "src_uri", "a page"))
