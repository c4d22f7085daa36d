"""Quickstart: a checkpoint every iteration of a plain training loop, then a resume.

The training block below is the README's quickstart, word for word. It writes
``./ckpt``; run it twice and the second run resumes where the first ended.
"""

import torch

from asymcheck import Checkpointer

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
steps = 20


def batch(step: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(step))


with Checkpointer(model, optimizer, "ckpt", stateful={"sched": scheduler}) as ckpt:
    start = ckpt.resume() or 0          # newest verified version loaded into the live objects, or None
    for step in range(start, steps):
        loss = model(batch(step)).square().mean()
        loss.backward()
        optimizer.step()                # the only stall: what is left of the previous step's snapshot
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
# leaving the with block captures and commits the final step

# A new process would do the same: build the objects, then resume.
fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=10, gamma=0.9)
with Checkpointer(fresh, fresh_optimizer, "ckpt", stateful={"sched": fresh_scheduler}) as again:
    resumed = again.resume()
    print(f"resumed at step {resumed} from {again.restored.tier if again.restored else None}")
    assert resumed == steps, resumed
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
print("bit-exact: OK")
