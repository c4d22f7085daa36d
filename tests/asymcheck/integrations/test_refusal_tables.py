"""The refused settings are kept once, in asymcheck.integrations.settings, and rendered into the guides.

The mkdocs hook (docs/hooks/refusals.py) replaces ``<!-- refusals: NAME -->`` with the table of that
framework; every framework guide holds its marker, and no other copy of a list is left in the module
docstrings of the framework modules.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from asymcheck.integrations import settings

ROOT = Path(__file__).resolve().parents[3]


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("refusals_hook", ROOT / "docs" / "hooks" / "refusals.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLES = {"accelerate": (settings.ACCELERATE, "accelerate"), "hf": (settings.HF_TRAINER, "transformers"),
          "lightning": (settings.LIGHTNING, "lightning"), "torchtitan": (settings.TORCHTITAN, "torchtitan"),
          "ray": (settings.RAY, "ray")}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_hook_renders_every_refusal_of_each_table(name: str) -> None:
    hook = _hook()
    table, package = TABLES[name]
    page = f"# Guide\n\nbefore\n\n<!-- refusals: {name} -->\n\nafter\n"
    out = hook.on_page_markdown(page, page=None, config=None, files=None)
    assert "<!--" not in out and out.startswith("# Guide\n\nbefore\n\n| Setting |") and out.endswith("\nafter\n")
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert len(rows) == len(table)
    major, minor = settings.TESTED[package]
    for row, entry in zip(rows, table, strict=True):
        setting = f"{package} other than {major}.{minor}.x" if entry.setting == "version" else entry.setting
        assert row == f"| `{setting}` | {entry.why.replace('|', chr(92) + '|')} |"


def test_an_unknown_marker_fails_the_build() -> None:
    with pytest.raises(ValueError, match="names no table"):
        _hook().replace_markers("<!-- refusals: deepspeed -->")


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_framework_guide_holds_its_marker_once(name: str) -> None:
    hook = _hook()
    text = (ROOT / "docs" / hook.GUIDES[name]).read_text()
    assert text.count(f"<!-- refusals: {name} -->") == 1
    assert set(hook.GUIDES) == set(hook.TABLES) == set(TABLES)


@pytest.mark.parametrize("module", ["accelerate", "hf", "lightning", "torchtitan", "ray"])
def test_the_framework_modules_link_their_guide_instead_of_a_list(module: str) -> None:
    if module == "torchtitan":
        pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is not installed")
    imported = importlib.import_module(f"asymcheck.{module}")
    doc = imported.__doc__ or ""
    guide = {"accelerate": "accelerate", "hf": "hf-trainer", "lightning": "lightning",
             "torchtitan": "torchtitan", "ray": "ray"}[module]
    assert f"docs/guides/{guide}.md" in doc
    assert len(doc.strip().splitlines()) <= 16, len(doc.strip().splitlines())
    table = TABLES["hf" if module == "hf" else module][0]
    listed = [e.setting for e in table if e.setting != "version" and len(e.setting) > 8 and e.setting in doc]
    assert not listed, f"asymcheck.{module}'s docstring repeats refusals {listed}: link the guide instead"
