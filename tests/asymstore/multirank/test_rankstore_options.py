"""A RankStore's options for this rank's own store are typed (StoreOptions): mypy catches a misspelt one."""

from __future__ import annotations

from pathlib import Path

import pytest

from asymstore.multirank import RankStore
from asymstore.store import StoreOptions
from tests.support.mypy_snippets import assert_mypy_flags_exactly_the_marked_lines

SNIPPET = '''
from typing import Unpack

from asymcheck.deepspeed.engine import AsymCheckpointEngine
from asymstore import open_store
from asymstore.multirank import RankStore
from asymstore.store import StoreOptions


def build() -> None:
    RankStore("ck", rank=0, world_size=1, segment_bytes=1 << 20, compression="never", backlog=2)
    RankStore("ck", rank=0, world_size=1, segmnet_bytes=1 << 20)  # LINE rank-name
    RankStore("ck", rank=0, world_size=1, compression="sometimes")  # LINE rank-type
    RankStore("ck", rank=0, world_size=1, retention_floor=lambda: 3)  # LINE rank-floor
    AsymCheckpointEngine(None, keep_last=2, compression="never", restore_timeout_s=5.0)
    AsymCheckpointEngine(None, compresion="never")  # LINE engine-name
    open_store("ck", segment_bytes=1 << 20, kv=None)
    open_store("ck", segment_byte=1 << 20)  # LINE open-name


def forward(**options: Unpack[StoreOptions]) -> None:
    RankStore("ck", rank=0, world_size=1, **options)
'''


def test_mypy_reports_a_misspelt_rankstore_option_and_accepts_the_right_ones(tmp_path: Path) -> None:
    assert_mypy_flags_exactly_the_marked_lines(SNIPPET, tmp_path)


def test_a_rankstores_options_reach_its_own_store(tmp_path: Path) -> None:
    options: StoreOptions = {"segment_bytes": 1 << 20, "compression": "never", "backlog": 2}
    store = RankStore(tmp_path, rank=0, world_size=1, **options)
    assert (store.local.segment_bytes, store.local.compression, store.local.backlog) == (1 << 20, "never", 2)
    with pytest.raises(TypeError):
        RankStore(tmp_path, rank=0, world_size=1, **{"segmnet_bytes": 1})  # type: ignore[arg-type]
