"""Host slots: one buffer per slot, reused by every version that fits; huge pages advised where the kernel allows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asymcheck.options import CommitOptions
from asymcheck.snapshot.hostpool import HUGE_MIN_BYTES, HUGE_PAGE, PAGE, HostSlot, huge_pages_available, thp_mode
from asymcheck.state.trainstate import TrainingState
from tests.support.asymcheck_train import (
    equal_state,
    make_model,
    make_opt,
    open_ckpt,
    read_versions,
    step_once,
    tensors_of,
)

BIG = HUGE_MIN_BYTES + (1 << 20)


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    with open("/proc/self/smaps") as f:
        text = f.read()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= address < hi:
            line = next(x for x in block.splitlines() if x.startswith("VmFlags:"))
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(str(f)) == "always"
    assert thp_mode(str(tmp_path / "missing")) == "never"


def test_a_slot_keeps_its_buffer_for_every_version_that_fits() -> None:
    slot = HostSlot(0, pin=False)
    slot.arrange([torch.ones(BIG // 4)])
    ptr = slot.buffer.data_ptr()
    slot.arrange([torch.ones(1000), torch.ones(BIG // 8)])  # smaller: same memory
    slot.arrange([torch.ones(BIG // 4)])
    assert slot.buffer.data_ptr() == ptr and slot.allocations == 1
    slot.arrange([torch.ones(BIG // 2)])  # larger: grows once
    assert slot.allocations == 2 and slot.capacity >= BIG * 2


@pytest.mark.skipif(not huge_pages_available(), reason="transparent huge pages are off on this kernel")
def test_a_large_slot_is_advised_huge_pages_and_huge_page_aligned() -> None:
    slot = HostSlot(0, pin=False)
    slot.arrange([torch.ones(BIG // 4)])
    assert slot.huge
    assert slot.buffer.data_ptr() % HUGE_PAGE == 0
    assert "hg" in vm_flags(slot.buffer.data_ptr())  # MADV_HUGEPAGE on the mapping
    src = torch.arange(BIG // 4, dtype=torch.float32)
    slot.region(0).copy_(src.view(torch.uint8))
    assert torch.equal(slot.view(0, src), src)


def test_a_small_slot_uses_base_pages_on_a_page() -> None:
    slot = HostSlot(0, pin=False)
    slot.arrange([torch.ones(1000)])
    assert not slot.huge
    assert slot.buffer.data_ptr() % PAGE == 0


def test_checkpointer_reuses_its_slots_across_versions(tmp_path: Path) -> None:
    """Every version of a run lands in the same (huge-page) buffers, and each is still its step's state."""
    model = make_model(hidden=1024)  # about 13 MiB of state with AdamW: above HUGE_MIN_BYTES
    opt, _ = make_opt(model)
    states = {}
    ptrs: list[set[int]] = []
    with open_ckpt(model, opt, tmp_path, commits=CommitOptions(host_slots=2)) as ckpt:  # both slots in turn
        pool = ckpt._pool
        for it in range(6):
            step_once(model, opt, it)
            states[ckpt.step] = tensors_of(model.state_dict())
            if it >= 2:  # both slots used by now
                ptrs.append({s.buffer.data_ptr() for s in pool._slots})
    assert all(p == ptrs[0] for p in ptrs)
    assert [s.allocations for s in pool._slots] == [1, 1]
    assert all(s.huge == huge_pages_available() for s in pool._slots)
    versions = read_versions(tmp_path)
    assert len(versions) >= 5
    for step, version in versions.items():
        fresh = make_model(seed=1, hidden=1024)
        TrainingState(fresh, make_opt(fresh)[0], {}).load(version.tensors, version.meta)
        equal_state(states[step], fresh.state_dict(), f"step {step}")


_LAYOUT = st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]),
                             st.lists(st.integers(0, 70), min_size=0, max_size=3)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts=st.lists(_LAYOUT, min_size=1, max_size=6), big=st.integers(0, 5))
def test_the_views_of_a_slot_follow_its_layout(layouts: list[list[tuple[torch.dtype, list[int]]]], big: int) -> None:
    # versions laid out in turn (tensors added, dropped, reshaped, retyped; the buffer grown): each view has
    # its tensor's dtype and shape and sits on its region of the current buffer (bytes written there read
    # back), and a version laid out as the one before gets the very same views (made once per layout)
    slot = HostSlot(0, pin=False)
    gen = torch.Generator().manual_seed(len(layouts))
    previous: tuple[list[tuple[torch.dtype, tuple[int, ...]]], list[torch.Tensor]] | None = None
    for k, layout in enumerate(layouts):
        # the buffer grown: one tensor of 20,000 elements (its shape replaced, never multiplied: 70 * 70 * 70 * 20,000
        # int64 would be 55 GB)
        srcs = [torch.zeros([20000] if k == big and j == 0 else shape, dtype=dtype)
                for j, (dtype, shape) in enumerate(layout)]
        slot.arrange(srcs)
        key = [(t.dtype, tuple(t.shape)) for t in srcs]
        views = [slot.view(i, t) for i, t in enumerate(srcs)]
        for i, (t, v) in enumerate(zip(srcs, views, strict=True)):
            assert v.dtype == t.dtype and v.shape == t.shape
            if slot.sizes[i]:
                assert v.data_ptr() == slot.buffer.data_ptr() + slot.offsets[i]
                data = torch.randint(0, 256, (slot.sizes[i],), dtype=torch.uint8, generator=gen)
                slot.region(i).copy_(data)
                assert torch.equal(v.reshape(-1).view(torch.uint8), data)
        if previous is not None and previous[0] == key:
            assert all(a is b for a, b, t in zip(previous[1], views, srcs, strict=True) if t.numel())
        previous = (key, views)
