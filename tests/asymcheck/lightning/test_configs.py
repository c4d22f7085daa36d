"""Lightning in the configurations users train in: a compiled module, a PEFT model, torchdata's StatefulDataLoader.

Each is the small GPT-2 child of test_callback.py (tests/procs/lightning_train.py) in one process (``[1]``) and
under ``strategy="ddp"`` on 2 processes (``[2]``, every rank; the compiled one exhaustive), killed by
SIGKILL inside ``training_step`` at a drawn step (``LIGHTNING_KILL_SEED`` replays it), fitted again with the
same command, and compared with an uninterrupted fit without the callback: every loss either child logged
(training and validation) and the final parameters, optimizer state, scheduler, RNG, global step and epoch,
bit for bit; each checks that the second child resumed.

- ``--compile aot_eager``: ``trainer.fit(torch.compile(module, backend="aot_eager"))``; Lightning unwraps
  ``_orig_mod`` and compiles the module's ``training_step`` and ``validation_step``. The test checks that the
  fit ran compiled (Dynamo captured graphs, and more of them under the callback: its hooks are graph breaks
  inside the compiled step) and that the callback's hooks copied bytes during the compiled forwards.
- ``--peft``: the GPT-2 wrapped by ``peft.get_peft_model`` (LoRA on ``c_attn``, LoRA dropout), AdamW over the
  adapters only: a version holds the whole PeftModel and the adapters' optimizer state.

Under ``fullgraph=True`` (a tiny module whose ``training_step`` Dynamo captures whole, in-process) the callback
hooks only the optimizer's step and copies there; a fit stopped and resumed by a new Trainer equals an
uninterrupted one. Refused, typed, before anything is written: another partitioning or manual optimization under
``fullgraph=True``, and torchdata's ``StatefulDataLoader`` as the train loader (killed and resumed across an epoch
boundary, its later epochs were shuffled differently: Lightning restores it before any callback hook).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from asymcheck.errors import InvalidOptionError
from asymcheck.lightning import AsymCheckCallback, UnsupportedLightningConfigError
from asymcheck.options import PacingOptions, PartitionOptions
from asymstore.multirank.globaldir import list_global_steps
from tests.asymcheck.lightning.test_callback import (
    DDP_STEPS,
    STEPS,
    _check_same,
    _Launch,
    _resumed_step,
    kill_point,
)

pytestmark = pytest.mark.slow


def _kill_and_resume(tmp_path: Path, name: str, *args: str, kill: int | None = None,
                     ddp: bool = False) -> tuple[Path, Path]:
    """Reference, killed child and resumed child of one configuration; returns (reference out, resumed out).

    ``ddp``: ``strategy="ddp"`` on 2 processes, every rank killed at the same drawn step; the final states of both.
    """
    ref = _Launch(tmp_path / "ref", *args, ddp=ddp)
    kill = kill_point(name, DDP_STEPS if ddp else STEPS, first=3 if ddp else 2) if kill is None else kill
    out, root = tmp_path / "run", tmp_path / "ckpt"
    # --flush: the sealed versions commit before the kill, so the resume takes the version of the step before
    # it whatever the machine's load (on a loaded machine version 1's commit could still be running at a kill
    # after 2 steps: the second fit then started fresh, correctly, and this test could not tell a resume)
    _Launch(out, "--dir", str(root), "--kill", str(kill), "--flush", *args,
            ddp=ddp).wait(killed=(kill, signal.SIGKILL))
    _Launch(out, "--dir", str(root), *args, ddp=ddp).wait()
    reference = ref.wait()
    _check_same(reference, out, 2 if ddp else 1)
    assert _resumed_step(out) == kill - 1
    if ddp:  # the fit really ran under DDP on 2 processes, over a multi-rank root
        for rank in (0, 1):
            ran = json.loads((reference / f"config-rank{rank}.json").read_text())
            assert ran["strategy"] == "DDPStrategy" and ran["world_size"] == 2, ran
        assert list_global_steps(str(root / "global"))[-1] == DDP_STEPS
    return reference, out


@pytest.mark.exhaustive  # ~1 min ([1]), ~2 min ([2]): make test-all (CI budget); HF and Accelerate compile in make test
@pytest.mark.parametrize("ranks", [1, 2])
def test_compiled_kill_and_resume(tmp_path: Path, ranks: int) -> None:
    """A LightningModule compiled with ``torch.compile(module, backend="aot_eager")`` passed to ``trainer.fit``.

    ``[2]``: under DDP on 2 processes (Lightning compiles the module's steps, DDP wraps the module), every rank.
    """
    name = "compiled" if ranks == 1 else "compiled_ddp"
    reference, out = _kill_and_resume(tmp_path, name, "--compile", "aot_eager", ddp=ranks == 2)
    for rank in range(ranks):
        plain = json.loads((reference / f"compiled-rank{rank}.json").read_text())
        hooked = json.loads((out / f"compiled-rank{rank}.json").read_text())
        for ran in (plain, hooked):  # the compiled wrapper was fitted, Lightning unwrapped it, Dynamo captured graphs
            assert ran["wrapper"] == "OptimizedModule" and ran["unwrapped"] == "Model" and ran["graphs"] >= 1, ran
        assert hooked["graphs"] > plain["graphs"], (plain, hooked)  # the callback's hooks break the compiled graphs
        copied = json.loads((out / f"stats-rank{rank}.json").read_text())
        assert copied["forward_bytes"] > 0, copied  # the hooks inside the compiled forwards copied the versions


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.exhaustive)])  # [2]: ~30 s (CI budget)
def test_peft_kill_and_resume(tmp_path: Path, ranks: int) -> None:
    """A LoRA model (peft) inside the LightningModule: the whole PeftModel and the adapters' optimizer state.

    ``[2]``: under DDP on 2 processes (DDP wraps the PeftModel; only the adapters have gradients to reduce).
    """
    name = "peft" if ranks == 1 else "peft_ddp"
    reference, _ = _kill_and_resume(tmp_path, name, "--peft", ddp=ranks == 2)
    for rank in range(ranks):
        final = torch.load(reference / f"final-rank{rank}.pt")
        lora = [k for k in final if k.startswith("model/") and "lora_A" in k]
        assert lora, "no LoRA adapter in the model"
        # AdamW steps the adapters only: 2 layers x (lora_A, lora_B) in c_attn
        assert len({k.split("/")[1] for k in final if k.startswith("opt/")}) == 4


class _Tiny(pl.LightningModule):
    """Two linear layers whose ``training_step`` Dynamo captures whole (``fullgraph=True``)."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.b(torch.relu(self.a(batch[0]))).square().mean()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        data = torch.randn(32, 4, generator=torch.Generator().manual_seed(3))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)  # see _tiny_fit


def _tiny_fit(steps: int, callbacks: list[pl.Callback], *, manual: bool = False) -> tuple[_Tiny, pl.Trainer]:
    """Fit the compiled module ``steps`` steps (a fit resumed from a finished fit's last version: an unshuffled
    loader, see the guide's Limits)."""
    pl.seed_everything(0, verbose=False)
    module = _Tiny(manual)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(torch.compile(module, backend="aot_eager", fullgraph=True))  # type: ignore[arg-type]
    return module, trainer


def test_compiled_fullgraph_copies_at_the_step_and_resumes_exactly(tmp_path: Path) -> None:
    """``fullgraph=True``: only the optimizer's step hooks (a hook in the graph is an error), the copy at the step.

    A fit of 6 steps, then a new Trainer and module fitting to 10 resume from its version 6; the weights equal
    an uninterrupted compiled fit of 10 steps (without the step hooks' routing, the first forward raises).
    """
    first = AsymCheckCallback(tmp_path / "ckpt", pacing=PacingOptions(max_overhead=None))
    _tiny_fit(6, [first])
    stats = first.stats()
    assert stats is not None and stats.steps and all(r.forward_bytes == r.backward_bytes == 0 for r in stats.steps)
    assert sum(r.boundary_bytes for r in stats.steps) > 0  # copied at the step boundary
    second = AsymCheckCallback(tmp_path / "ckpt", pacing=PacingOptions(max_overhead=None))
    resumed, _ = _tiny_fit(10, [second])
    assert second.restored is not None and second.restored.step == 6
    reference, _ = _tiny_fit(10, [])
    for (name, a), (_, b) in zip(resumed.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_compiled_fullgraph_refusals(tmp_path: Path) -> None:
    """Under ``fullgraph=True``: another partitioning is an InvalidOptionError, manual optimization refused, typed."""
    asked = AsymCheckCallback(tmp_path / "a", partitions=PartitionOptions(partitioning="asymmetric"))
    with pytest.raises(InvalidOptionError, match="fullgraph"):
        _tiny_fit(2, [asked])
    with pytest.raises(UnsupportedLightningConfigError, match=r"fullgraph=True\) with manual optimization"):
        _tiny_fit(2, [AsymCheckCallback(tmp_path / "b")], manual=True)
    for d in ("a", "b"):
        assert not any((tmp_path / d).rglob("v*"))


class _Stateful(_Tiny):
    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader
        data = torch.randn(32, 4, generator=torch.Generator().manual_seed(3))
        return StatefulDataLoader(torch.utils.data.TensorDataset(data), batch_size=4, shuffle=True,
                                  generator=torch.Generator().manual_seed(7))


def test_stateful_loader_refused(tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader as the train loader: refused, typed, before the first training step.

    Lightning restores it from its loop state inside ``fit`` before any callback hook, one generator draw short:
    killed and resumed (tests/procs/lightning_train.py ``--sloader``), the epochs after the resume were
    shuffled differently from the uninterrupted fit. Nothing is trained, no version is written.
    """
    module = _Stateful()
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[AsymCheckCallback(tmp_path / "ckpt")])
    with pytest.raises(UnsupportedLightningConfigError, match=r"StatefulDataLoader.*shuffled differently"):
        trainer.fit(module)
    assert trainer.global_step == 0
    assert not any((tmp_path / "ckpt").rglob("v*"))
