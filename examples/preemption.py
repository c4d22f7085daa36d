"""Preemption: SIGTERM in the middle of training, the newest completed step flushed, then a resume.

The program installs its own SIGTERM handler before the Checkpointer; the
Checkpointer records the signal, flushes the newest completed step at its
next hook, then calls that handler. Here the process sends SIGTERM to itself,
as a scheduler would. It writes ``./ckpt``.
"""

import os
import signal
import types

import torch

from asymcheck import Checkpointer
from asymcheck.options import PreemptionOptions

stop = False


def on_sigterm(signum: int, frame: types.FrameType | None) -> None:
    global stop
    stop = True                          # the program's own handler, called after the flush


signal.signal(signal.SIGTERM, on_sigterm)

model = torch.nn.Linear(32, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with Checkpointer(model, optimizer, "ckpt", preemption=PreemptionOptions(preempt_deadline_s=25.0)) as ckpt:
    start = ckpt.resume() or 0
    for step in range(start, 1000):
        if step == start + 7:
            os.kill(os.getpid(), signal.SIGTERM)   # what the scheduler does
        loss = model(torch.randn(4, 32)).square().mean()  # this forward's hook flushes, then on_sigterm runs
        if stop:
            break
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(ckpt.preempted)                # PreemptionRecord(reason='SIGTERM', step=..., durable=True, ...)

record = ckpt.preempted
assert record is not None and record.durable and record.step == start + 7, record
fresh = torch.nn.Linear(32, 8)
with Checkpointer(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), "ckpt") as again:
    assert again.resume() == record.step
    assert torch.equal(fresh.weight, model.weight)
print(f"preempted at step {record.step}, resumed at step {record.step}: OK")
