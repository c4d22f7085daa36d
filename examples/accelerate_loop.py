"""Accelerate: a version every optimizer step of a ``run_clm_no_trainer.py``-shaped loop, a crash, a resume.

Run as it is, it runs its training part below three times, each a fresh process (as
``accelerate launch`` would start it), under a temporary directory removed at the end: once to the
end; once killed by SIGKILL after 9 optimizer steps, in the middle of an epoch; and once more in
that run's directory, where it resumes from the newest version (the loader goes on after the
batches already trained, without reading them) and trains to the end. Every loss of the killed and
resumed runs must equal the uninterrupted run's, bit for bit. A small GPT-2 on synthetic tokens,
gradient accumulation over 2 micro-batches.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

import asymcheck.accelerate

EPOCHS = 3
ROLE = os.environ.get("ACCELERATE_EXAMPLE_ROLE")  # full | crash | resume; unset: run the three


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 44

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def run(role: str, workdir: str) -> subprocess.Popen:
    os.makedirs(workdir, exist_ok=True)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=workdir,
                            env={**os.environ, "ACCELERATE_EXAMPLE_ROLE": role})


def losses(workdir: str, role: str) -> list[str]:
    with open(f"{workdir}/losses-{role}.json") as f:
        return json.load(f)


if __name__ == "__main__" and ROLE is None:
    with tempfile.TemporaryDirectory() as tmp:
        full, crash = run("full", f"{tmp}/full"), run("crash", f"{tmp}/job")
        print(f"uninterrupted run: exit status {full.wait()}; killed run: exit status {crash.wait()}")
        print(f"resumed run: exit status {run('resume', f'{tmp}/job').wait()}")
        want = losses(f"{tmp}/full", "full")
        killed, resumed = losses(f"{tmp}/job", "crash"), losses(f"{tmp}/job", "resume")
        assert killed == want[:len(killed)] and resumed == want[len(want) - len(resumed):], "a loss differs"
        print(f"{len(killed)} + {len(resumed)} micro-batches, every loss equal to the uninterrupted run's")
    sys.exit(0)

# the training script: one process of the job
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
set_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                   bos_token_id=0, eos_token_id=0))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
train_dataloader = torch.utils.data.DataLoader(Tokens(), batch_size=4, shuffle=True)
lr_scheduler = get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=EPOCHS * 6)
model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)

# --8<-- [start:attach]
ckpt = asymcheck.accelerate.attach(accelerator, model, optimizer, "ckpt", scheduler=lr_scheduler, data=train_dataloader)
completed_steps = ckpt.resume() or 0    # optimizer steps of the newest verified version; None on a fresh start
starting_epoch = ckpt.loader.epoch      # the epoch that version was taken in
# --8<-- [end:attach]
print(f"{ROLE}: starting at optimizer step {completed_steps}, epoch {starting_epoch}, after its batch "
      f"{ckpt.loader.batches}")
trained = []
# --8<-- [start:loop]
for epoch in range(starting_epoch, EPOCHS):
    model.train()
    accelerator.print(f"epoch {epoch}")
    for batch in ckpt.loader:           # was: train_dataloader, or skip_first_batches(train_dataloader, n)
        with accelerator.accumulate(model):
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
        # --8<-- [end:loop]
        trained.append(outputs.loss.item().hex())
        if ROLE == "crash" and completed_steps == 9:
            with open(f"losses-{ROLE}.json", "w") as f:
                json.dump(trained, f)
            ckpt.flush()  # not needed: it only makes where this demo resumes deterministic
            os.kill(os.getpid(), signal.SIGKILL)
ckpt.close()                            # commits the last step
with open(f"losses-{ROLE}.json", "w") as f:
    json.dump(trained, f)
