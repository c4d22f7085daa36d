"""Reserved state names follow ``<framework>.<what>``: a version with the Trainer's names of earlier releases
(``trainer_state``, ``lr_scheduler``) still resumes, bit for bit as one with today's names, and goes on with today's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from asymcheck.hf import AsymCheckCallback
from asymstore import AsymStore, LocalTier


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(root: Path, out: Path, steps: int) -> tuple[AsymCheckCallback, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
                             lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    callback = AsymCheckCallback(str(root))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_from(trainer))
    return callback, {k: v.detach().clone() for k, v in model.state_dict().items()}


async def rename_newest(src: Path, dst: Path, renames: dict[str, str]) -> int:
    """Write ``src``'s newest version into ``dst`` with its stateful objects named as an earlier release named them."""
    async with AsymStore([LocalTier(str(src))]) as store:  # type: ignore[arg-type]
        ckpt = await store.restore()
    meta = {k: v for k, v in ckpt.meta.items() if not k.startswith("asymstore")}
    meta["stateful"] = {renames.get(name, name): tree for name, tree in meta["stateful"].items()}
    async with AsymStore([LocalTier(str(dst))]) as store:  # type: ignore[arg-type]
        await store.put_many(ckpt.step, dict(ckpt.tensors))
        await store.commit(ckpt.step, meta)
    return ckpt.step


async def stateful_names(root: Path) -> set[str]:
    async with AsymStore([LocalTier(str(root))]) as store:  # type: ignore[arg-type]
        return set((await store.read_manifest()).meta["stateful"])


def test_a_version_with_the_old_trainer_names_resumes_bit_exact_and_goes_on_with_the_new(tmp_path: Path) -> None:
    new, old = tmp_path / "new", tmp_path / "old"
    train(new, tmp_path / "out0", 3)
    assert asyncio.run(stateful_names(new)) == {"hf.trainer_state", "hf.scheduler"}
    step = asyncio.run(rename_newest(new, old, {"hf.trainer_state": "trainer_state", "hf.scheduler": "lr_scheduler"}))
    assert step == 3 and asyncio.run(stateful_names(old)) == {"trainer_state", "lr_scheduler"}
    from_new, want = train(new, tmp_path / "out1", 6)
    from_old, got = train(old, tmp_path / "out2", 6)
    assert from_new.resumed_step == from_old.resumed_step == 3
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert asyncio.run(stateful_names(old)) == {"hf.trainer_state", "hf.scheduler"}  # versions after it: new names
