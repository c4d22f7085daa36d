"""DCP's stager: ``dcp.async_save(..., async_stager=asymcheck.dcp.Stager(optimizer))``.

Trains a small model (with BatchNorm, whose buffers every forward changes) with AdamW for 6 steps and a
``dcp.async_save`` of every step into a directory through ``asymstore.dcp.StorageWriter``, its staging copy
taken by ``asymcheck.dcp.Stager``: the optimizer's tensors are copied into reused host slots while the next
forward and backward run, and the optimizer's next step waits for what is left. Every saved step is then loaded
and compared with a deep copy of the state taken right after that step (bit-identical), and the stager's
counters are printed. Writes ``./ckpt`` (``check_snippets.py`` runs it in a temporary directory).
"""

import copy
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from asymcheck.dcp import Stager
from asymstore.dcp import StorageReader, StorageWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: DCP without a group

STEPS = 6


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, object]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step}


model, optimizer = make()
taken = {}
# --8<-- [start:stager]
writer = StorageWriter("ckpt", keep_last=None)
stager = Stager(optimizer)                      # host slots, reused; hooks the optimizer's step
response = None
for step in range(STEPS):
    train_step(model, optimizer, step)          # its step pre-hook waits for the previous copy, if unfinished
    state = app_state(model, optimizer, step)
    if response is not None:
        response.upload_completion.result()     # one save at a time per writer
    taken[step] = copy.deepcopy(state)          # (for the check below: the state right after the step)
    response = dcp.async_save(state, storage_writer=writer, async_stager=stager, checkpoint_id=str(step))
if response is not None:
    response.upload_completion.result()         # the copy finishes by itself: no further step needed
stager.close()
writer.close()
# --8<-- [end:stager]

stats = stager.stats()
print(f"{stats.stages} stages, {stats.failed} failed; {stats.background_bytes} bytes copied in the background, "
      f"{stats.inline_bytes} inside stage(); {stats.host_bytes} bytes of host slots; "
      f"{stats.stage_s:.4f} s in stage(), {stats.step_wait_s:.4f} s waited in step pre-hooks")
assert stats.stages == STEPS and stats.failed == 0

with StorageReader("ckpt") as reader:
    assert reader.steps() == list(range(STEPS - 1, -1, -1))
    for step in range(STEPS):
        fresh, fresh_optimizer = make()
        train_step(fresh, fresh_optimizer, 1000)  # AdamW's state exists, with other values
        state = app_state(fresh, fresh_optimizer, -1)
        dcp.load(state, storage_reader=reader, checkpoint_id=str(step))
        want = taken[step]
        for name, value in want["model"].items():  # type: ignore[attr-defined]
            assert torch.equal(state["model"][name], value), (step, name)  # type: ignore[index]
        for name, moments in want["optim"]["state"].items():  # type: ignore[index]
            for key, value in moments.items():
                assert torch.equal(state["optim"]["state"][name][key], value), (step, name, key)  # type: ignore[index]
        assert state["step"] == step
print(f"every step of {STEPS} loaded bit-identical to the state right after it")
