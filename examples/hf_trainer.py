"""The Hugging Face Trainer with a version every optimizer step: ``asymcheck.hf.AsymCheckCallback``.

A small GPT-2 (no download, synthetic tokens, dropout on, a shuffled dataset) trains for 9 steps
with the Trainer on CPU. The first run stops after 5 steps (as a crash would; the kill tests in
tests/asymcheck/hf/ SIGKILL it instead); a second run, with a new model, Trainer and callback, resumes from
the newest version in ``ckpt/`` (no ``checkpoint-N`` directory) and trains to the end. Its logged
losses and final weights equal those of an uninterrupted run of the plain Trainer, bit for bit.
Runs in a temporary directory, removed at the end.
"""

import os
import shutil
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from asymcheck.hf import AsymCheckCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 256, (24, 16), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):
    """Ends training after ``step`` optimizer steps (it stands in for a crash)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def make_trainer(*callbacks: TrainerCallback) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir="out", max_steps=9, per_device_train_batch_size=4, logging_steps=1,
                             learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks))


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


workdir = tempfile.mkdtemp(prefix="hf-trainer-example-")
os.chdir(workdir)

reference = make_trainer()  # the uninterrupted run, without asymcheck
reference.train()

trainer = make_trainer(StopAt(5))  # the first run: it ends after 5 of its 9 steps
# --8<-- [start:callback]
ckpt = AsymCheckCallback("ckpt")                                 # a version every optimizer step
trainer.add_callback(ckpt)
trainer.train(resume_from_checkpoint=ckpt.resume_from(trainer))  # None when "ckpt" holds no version
# --8<-- [end:callback]
print(f"first run: stopped at step {trainer.state.global_step}, versions {ckpt.final_versions}")

trainer = make_trainer()  # the second run: a new model, Trainer and callback
ckpt = AsymCheckCallback("ckpt")                                 # a version every optimizer step
trainer.add_callback(ckpt)
trainer.train(resume_from_checkpoint=ckpt.resume_from(trainer))  # None when "ckpt" holds no version
print(f"second run: resumed from version {ckpt.resumed_step}, ended at step {trainer.state.global_step}")

same_losses = losses(trainer) == losses(reference)
same_weights = all(torch.equal(a, b) for a, b in zip(trainer.model.state_dict().values(),
                                                      reference.model.state_dict().values(), strict=True))
print(f"losses {'identical' if same_losses else 'DIFFER'} over {len(losses(trainer))} steps, "
      f"weights {'identical' if same_weights else 'DIFFER'} to the uninterrupted run")
os.chdir("/")
shutil.rmtree(workdir)
assert same_losses and same_weights
