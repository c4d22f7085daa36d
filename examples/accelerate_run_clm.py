"""Accelerate: the lines the guide adds to Hugging Face's ``run_clm_no_trainer.py``, run as that script runs them.

The training part below keeps the stock script's shape where the guide's lines touch it: its
``--output_dir`` defaults to None (the stock script creates the directory only when it is given),
``--max_train_steps`` ends the loop, and the resume block is the guide's. Run as it is, it starts the
script twice without ``--output_dir``, each a fresh process under a temporary working directory: once
for 4 optimizer steps, once more for 8, which must resume after step 4 from the versions the first
run left under ``./asymcheck`` and train 4 steps more.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

# --8<-- [start:import]
import asymcheck.accelerate

# --8<-- [end:import]

if __name__ == "__main__" and len(sys.argv) == 1:
    with tempfile.TemporaryDirectory() as tmp:
        for steps, first in (("4", 0), ("8", 4)):
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--max_train_steps", steps],
                                  cwd=tmp, capture_output=True, text=True, check=False)
            print(done.stdout, end="")
            assert done.returncode == 0, done.stderr[-3000:]
            assert f"starting at optimizer step {first}\n" in done.stdout, done.stdout
    print("the second run resumed after the first run's 4 optimizer steps, with --output_dir left out")
    sys.exit(0)

# the script, as run_clm_no_trainer.py parses and prepares (its arguments that matter here)
parser = argparse.ArgumentParser()
parser.add_argument("--output_dir", type=str, default=None, help="Where to store the final model.")
parser.add_argument("--max_train_steps", type=int, default=None)
parser.add_argument("--num_train_epochs", type=int, default=3)
parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
args = parser.parse_args()
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.gradient_accumulation_steps)
set_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))
ids = torch.randint(0, 128, (24, 16), generator=torch.Generator().manual_seed(1))
train_dataset = [{"input_ids": x, "labels": x} for x in ids]
train_dataloader = torch.utils.data.DataLoader(train_dataset, shuffle=True, batch_size=4)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
lr_scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=24)
model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, lr_scheduler)

# --8<-- [start:resume]
ckpt = asymcheck.accelerate.attach(accelerator, model, optimizer,
                                   os.path.join(args.output_dir or ".", "asymcheck"),  # --output_dir may be None
                                   scheduler=lr_scheduler, data=train_dataloader)
completed_steps = ckpt.resume() or 0
starting_epoch = ckpt.loader.epoch
# --8<-- [end:resume]
print(f"starting at optimizer step {completed_steps}")
for epoch in range(starting_epoch, args.num_train_epochs):
    model.train()
    accelerator.print(f"epoch {epoch}")
    for batch in ckpt.loader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
        if completed_steps >= args.max_train_steps:
            break
    if completed_steps >= args.max_train_steps:
        break
# --8<-- [start:close]
ckpt.close()
# --8<-- [end:close]
print(f"stopped after optimizer step {completed_steps}")
