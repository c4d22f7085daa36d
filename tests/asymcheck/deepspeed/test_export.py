"""asymcheck.deepspeed.export refuses what it cannot export, and never writes outside its output directory."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")

from asymcheck.deepspeed.export import _inside, find_root, main
from asymcheck.errors import DeepSpeedExportError


def test_a_directory_without_a_multirank_root_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DeepSpeedExportError, match="no multi-rank"):
        find_root(str(tmp_path))
    assert main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "no multi-rank" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["../evil.pt", "/etc/passwd", "a/../../b.pt", ".", "a/../.."])
def test_file_names_from_a_manifest_never_leave_the_output(tmp_path: Path, key: str) -> None:
    with pytest.raises(DeepSpeedExportError, match="would leave"):
        _inside(str(tmp_path), key)
    name = "tag/mp_rank_00_model_states.pt"
    assert _inside(str(tmp_path), name) == str(tmp_path / name)
