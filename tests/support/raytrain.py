"""What the Ray Train tests share: the uninterrupted reference run, and the Ray processes a program left behind."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def uninterrupted(make_model: Callable[[], torch.nn.Module],
                  batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                  steps: int) -> tuple[list[float], dict[str, list[float]]]:
    """Rank 0's losses and the final parameters of the 2-rank DDP run, without Ray, in this process.

    DDP divides each rank's gradient by the world size and gloo sums the two: exactly ``g0 / 2 + g1 / 2``.
    One thread, as Ray's workers (``OMP_NUM_THREADS=1``).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(steps):
            grads = []
            for rank in (0, 1):
                x, y = batch(rank, step)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
                if rank == 0:
                    losses.append(loss.item())
                optimizer.zero_grad(set_to_none=True)
            for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
                p.grad = g0 / 2 + g1 / 2
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return losses, {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def processes_naming(work: str) -> list[int]:
    """Processes (not this one) whose command line or environment names ``work``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if work.encode() in cmdline or work.encode() in environ:
            found.append(int(entry))
    return found


@contextmanager
def ray_workdir(prefix: str) -> Iterator[str]:
    """A short directory for a Ray program (its socket paths live under it); no process may outlive it naming it.

    On the way out it waits up to 15 s for such processes to end, ends the ones left (SIGKILL, by pid: the
    program's Ray processes), removes the directory, then fails if there were any.
    """
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield path
    finally:
        deadline = time.monotonic() + 15.0
        left = processes_naming(path)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = processes_naming(path)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(path, ignore_errors=True)
        assert not left, f"Ray processes outlived the program: {left}"
