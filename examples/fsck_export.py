"""fsck and export from the command line, on a checkpoint the Checkpointer wrote.

Checks ``./ckpt`` with ``python -m asymstore.fsck``, exports its newest version
as safetensors and as a DCP directory with ``python -m asymstore.export`` and
loads both back; then flips one byte of the newest version and lets fsck
find it (exit 1) and repair it (exit 0), after which the previous version is
the newest restorable one.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from asymcheck import Checkpointer


def run(*args: str) -> subprocess.CompletedProcess[str]:
    print("$ python -m", " ".join(args))
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, check=False)


model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
with Checkpointer(model, optimizer, "ckpt") as ckpt:
    for _step in range(ckpt.resume() or 0, 5):
        model(torch.randn(4, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

checked = run("asymstore.fsck", "ckpt", "--deep", "--json")
report = json.loads(checked.stdout)
assert checked.returncode == 0 and report["ok"] and report["newest_restorable"] == 5, checked.stdout

assert run("asymstore.export", "ckpt", "--to", "safetensors", "model.safetensors").returncode == 0
copy = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
copy.load_state_dict(load_file("model.safetensors"))
assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), model.parameters(), strict=True))

assert run("asymstore.export", "ckpt", "--to", "dcp", "model-dcp").returncode == 0
state = {name: torch.empty_like(t) for name, t in model.state_dict().items()}
dcp.load(state, checkpoint_id="model-dcp")
assert all(torch.equal(state[name], t) for name, t in model.state_dict().items())

segment = sorted(Path("ckpt/v000000000005").glob("seg-*.bin"))[0]
data = bytearray(segment.read_bytes())
data[len(data) // 2] ^= 0x01                     # one flipped bit in the newest version
segment.write_bytes(bytes(data))
found = run("asymstore.fsck", "ckpt", "--deep")
print(found.stdout)
assert found.returncode == 1, found.returncode
repaired = run("asymstore.fsck", "ckpt", "--repair", "--json")
assert repaired.returncode == 0 and json.loads(repaired.stdout)["newest_restorable"] == 4, repaired.stdout
print("fsck and export: OK")
