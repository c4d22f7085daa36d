"""Two loops the hooks cannot read alone: ``ckpt.mark()`` and ``with ckpt.editing():``.

The first loop runs a validation forward in training mode after the step
(BatchNorm statistics move, dropout draws from the RNG): ``mark()`` at the end
of the loop body takes the version's small state there. The second keeps an
EMA of the weights and evaluates with the EMA weights swapped into the model:
``editing()`` finishes the pending copy first, so no version is dropped.
Writes ``./ckpt-mark`` and ``./ckpt-ema``.
"""

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from asymcheck import Checkpointer


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Dropout(0.1),
                               torch.nn.Linear(32, 4))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def evaluate(model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        loss = model(torch.randn(8, 16)).square().mean().item()
    model.train()
    return loss


# 1. A validation forward in training mode, grad enabled, before scheduler.step(): mark() ends the body.
model = make_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
with Checkpointer(model, optimizer, "ckpt-mark", stateful={"sched": scheduler}) as ckpt:
    # --8<-- [start:mark]
    for _step in range(ckpt.resume() or 0, 12):
        train_step(model, optimizer)                  # forward, backward, optimizer.step()
        val_loss = model(torch.randn(8, 16)).square().mean()  # training mode, grad enabled: looks like t+1
        scheduler.step()
        ckpt.mark()                                   # buffers, RNG, data, stateful, param groups taken here
    # --8<-- [end:mark]
    assert ckpt.stats().versions_dropped == 0

# 2. EMA evaluation with the EMA weights swapped in between steps: inside editing().
model = make_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
with Checkpointer(model, optimizer, "ckpt-ema", stateful={"ema": ema}) as ckpt:
    # --8<-- [start:editing]
    for _step in range(ckpt.resume() or 0, 12):
        train_step(model, optimizer)
        ema.update_parameters(model)                  # ema is in stateful=
        with ckpt.editing(), torch.no_grad():         # the version keeps the values of the step
            originals = [p.clone() for p in model.parameters()]
            for p, averaged in zip(model.parameters(), ema.module.parameters(), strict=True):
                p.copy_(averaged)                     # EMA weights swapped in
            evaluate(model)                           # no_grad + eval() forward
            for p, original in zip(model.parameters(), originals, strict=True):
                p.copy_(original)                     # originals back
    # --8<-- [end:editing]
    assert ckpt.stats().versions_dropped == 0
print("mark() and editing(): no version dropped: OK")
