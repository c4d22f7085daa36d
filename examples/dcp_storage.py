"""DCP storage: ``torch.distributed.checkpoint`` (``dcp.save``, ``async_save``, ``load``) into asymstore versions.

Trains a small model with AdamW for 6 steps and a ``dcp.async_save`` of every step into a memory tier and a
disk tier, resumes a fresh model from the newest version with ``dcp.load`` (bit-identical), loads an older
step by its number, and checks the directory with ``python -m asymstore.fsck``. The three lines the DCP guide
opens with come first. Writes ``./quick`` and ``./ckpt`` (``check_snippets.py`` runs it in a temporary directory).
"""

import subprocess
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from asymstore import LocalTier, host_tier
from asymstore.dcp import StorageReader, StorageWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: DCP without a group

# the three lines: any state dict DCP takes, saved and loaded through the store
state_dict = {"model": torch.nn.Linear(16, 4).state_dict(), "epoch": 3}
writer = StorageWriter("quick")                              # a directory, tiers, an AsymStore or a RankStore
dcp.save(state_dict, storage_writer=writer)                  # or dcp.async_save: one verified version per save
dcp.load(state_dict, storage_reader=StorageReader(writer))   # the newest version that verifies; DCP reshards
writer.close()

STEPS = 6


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, object]:
    model_sd, optim_sd = get_state_dict(model, optimizer)  # AdamW's state keyed by parameter names
    return {"model": model_sd, "optim": optim_sd, "step": step}


model, optimizer = make()
# --8<-- [start:save]
writer = StorageWriter([host_tier(capacity_bytes=256 << 20), LocalTier("ckpt")], keep_last=3)
future = None
for step in range(STEPS):
    train_step(model, optimizer, step)
    state = app_state(model, optimizer, step)       # DCP stages a CPU copy before async_save returns
    if future is not None:
        future.result()                             # one save at a time per writer
    future = dcp.async_save(state, storage_writer=writer, checkpoint_id=str(step))  # the version's step
if future is not None:
    future.result()
writer.close()                                      # waits until the disk tier holds what the memory tier does
# --8<-- [end:save]

# --8<-- [start:load]
resumed, resumed_optimizer = make()
state = app_state(resumed, resumed_optimizer, -1)   # destinations: their shapes (and shards) say what to read
reader = StorageReader("ckpt")                      # read-only: no lock, a writer may be saving there meanwhile
dcp.load(state, storage_reader=reader)              # the newest version that verifies, every chunk checked
set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
print(f"loaded step {reader.step} (its state says step {state['step']}); skipped: {reader.fallbacks or 'nothing'}")
# --8<-- [end:load]

for name, value in model.state_dict().items():
    assert torch.equal(value, resumed.state_dict()[name]), name
for pid, moments in optimizer.state_dict()["state"].items():
    for key, value in moments.items():
        assert torch.equal(value, resumed_optimizer.state_dict()["state"][pid][key]), (pid, key)
print("model and AdamW state bit-identical to the live ones")

# --8<-- [start:older]
print("steps kept:", reader.steps())                # keep_last=3: the newest three
dcp.load(state, storage_reader=reader, checkpoint_id="4")   # exactly this step
assert reader.step == 4 and state["step"] == 4
reader.close()
# --8<-- [end:older]

# --8<-- [start:idiom]
for step in range(STEPS, STEPS + 3):                # DCP's recipe: a new writer for every save, never closed
    train_step(model, optimizer, step)
    dcp.save(app_state(model, optimizer, step), storage_writer=StorageWriter("ckpt", keep_last=3),
             checkpoint_id=f"checkpoint_step{step}")   # the version's step: 6, then 7, then 8
StorageWriter("ckpt", keep_last=3).close()          # closes the store they shared (else the process's exit does)
with StorageReader("ckpt") as reader:
    print("steps kept:", reader.steps())            # [8, 7, 6]
    assert reader.steps() == [8, 7, 6]
# --8<-- [end:idiom]

done = subprocess.run([sys.executable, "-m", "asymstore.fsck", "ckpt"], capture_output=True, text=True, check=False)
print(done.stdout.strip())
assert done.returncode == 0, done.stdout + done.stderr
