"""Lightning with the README's two lines: a plain shuffled ``DataLoader`` from ``train_dataloader()``, resumed exactly.

A child (tests/procs/lightning_plain.py) fits Lightning's demo transformer with a plain
``DataLoader(shuffle=True)`` and ``callbacks=[AsymCheckCallback(root)]``, dies by SIGKILL inside a
``training_step`` (after the version of the previous step is committed), and a fresh child resumes
and fits to the end: killed in the middle of an epoch, and with the version resumed sitting exactly
at an epoch's end. Every loss after the resume and the final weights must equal those of an
uninterrupted fit without the callback, byte for byte. Loaders the callback cannot position (an
``IterableDataset`` without state, workers) are refused in ``on_train_start``, before any
``training_step``, with :class:`UnresumableDataError` naming the loader; ``inexact_data="warn"`` trains
with :class:`InexactResumeWarning` saying the same.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from asymcheck.lightning import AsymCheckCallback, InexactResumeWarning, UnresumableDataError
from asymstore import AsymStore, LocalTier
from tests.support.launch import proc_argv, proc_env

pytestmark = pytest.mark.slow

BATCHES = 6  # per epoch; 3 epochs


class _Child:
    def __init__(self, out: Path, *args: str) -> None:
        self.proc = subprocess.Popen(proc_argv("lightning_plain", "--out", str(out), *args), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=proc_env(OMP_NUM_THREADS="1"))
        self.out = out

    def wait(self, *, killed: bool = False) -> Path:
        try:
            log = self.proc.communicate(timeout=180)[0]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        want = -signal.SIGKILL if killed else 0
        assert self.proc.returncode == want, f"rc {self.proc.returncode}\n{log[-3000:]}"
        return self.out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> _Child:
    """The uninterrupted fit without the callback, started when first asked for (it runs beside the test's)."""
    return _Child(tmp_path_factory.mktemp("plain-ref"))


@pytest.fixture(scope="module")
def reference_generator(tmp_path_factory: pytest.TempPathFactory) -> _Child:
    """The uninterrupted fit whose loader shuffles with a generator of its own (``--generator``)."""
    return _Child(tmp_path_factory.mktemp("plain-ref-generator"), "--generator")


def _losses(path: Path) -> list[tuple[str, str]]:
    return [(r["key"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.parametrize(("kill", "generator"), [
    pytest.param(9, False, id="mid-epoch"),
    pytest.param(7, False, id="epoch-boundary"),
    # the cause of the Accelerate DDP stateful-loader divergence (a resume at an epoch's end losing the loader's
    # generator) does not reach Lightning: passes without a change, kept as that check (exhaustive: CI's budget)
    pytest.param(7, True, id="epoch-boundary-generator", marks=pytest.mark.exhaustive),
])
def test_plain_loader_kill_and_resume(request: pytest.FixtureRequest, tmp_path: Path, kill: int,
                                      generator: bool) -> None:
    """Killed after ``kill`` steps, resumed at ``kill - 1``: step 8 is batch 2 of epoch 1, step 6 an epoch's last.

    With a loader generator the epoch after the resumed one is shuffled by it from where the finished epoch
    left it: a version at an epoch's end must hold its state.
    """
    reference: _Child = request.getfixturevalue("reference_generator" if generator else "reference")
    extra = ["--generator"] if generator else []
    out, root = tmp_path / "run", tmp_path / "ckpt"
    _Child(out, "--dir", str(root), "--kill", str(kill), *extra).wait(killed=True)
    killed = _losses(out / "losses.jsonl")
    assert len(killed) == kill and not (out / "final.pt").exists()
    _Child(out, "--dir", str(root), *extra).wait()
    assert json.loads((out / "restored.json").read_text()) == kill - 1
    resumed = _losses(out / "losses.jsonl")[kill:]
    ref = _losses(reference.wait() / "losses.jsonl")
    assert len(ref) == 3 * BATCHES
    assert [k for k, _ in resumed] == [k for k, _ in ref[kill - 1:]]  # the resumed fit logs steps kill .. the end
    differ = [k for (k, loss), (_, want) in zip(resumed, ref[kill - 1:], strict=True) if loss != want]
    assert not differ, f"losses after the resume differ at {differ}"
    assert killed == ref[:kill]
    a, b = torch.load(reference.out / "final.pt"), torch.load(out / "final.pt")
    assert set(a) == set(b)
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"final state differs in {diff[:5]}"


# -- loaders the callback cannot position ---------------------------------------------


class _Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.randn(8, 4).unbind())


class _Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.x = torch.randn(8, 4)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class _Fit(pl.LightningModule):
    def __init__(self, loader: torch.utils.data.DataLoader[torch.Tensor]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.loader = loader
        self.steps = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        loss: torch.Tensor = self.layer(batch).square().mean()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return self.loader


def _trainer(callback: AsymCheckCallback) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])


def _steps(root: Path) -> list[int]:
    async def go() -> list[int]:
        async with AsymStore([LocalTier(root)]) as store:
            return [s for steps in store.versions().values() for s in steps]
    return asyncio.run(go()) if root.exists() else []


@pytest.mark.parametrize(("loader", "named"), [
    (lambda: torch.utils.data.DataLoader(_Stream(), batch_size=4), "reads an IterableDataset"),
    (lambda: torch.utils.data.DataLoader(_Rows(), batch_size=4, shuffle=True, num_workers=1), "num_workers=1"),
], ids=["iterable", "workers"])
def test_unpositionable_loader_refused_before_training(tmp_path: Path, loader: Any, named: str) -> None:
    module = _Fit(loader())
    with pytest.raises(UnresumableDataError, match=rf"train loader 0 \(DataLoader of _\w+\): {named}"):
        _trainer(AsymCheckCallback(tmp_path / "ckpt")).fit(module)
    assert module.steps == 0 and _steps(tmp_path / "ckpt") == []


def test_unpositionable_loader_named_when_allowed(tmp_path: Path) -> None:
    module = _Fit(torch.utils.data.DataLoader(_Stream(), batch_size=4))
    named = r"train loader 0 \(DataLoader of _Stream\): reads an IterableDataset"
    with pytest.warns(InexactResumeWarning, match=named):
        _trainer(AsymCheckCallback(tmp_path / "ckpt", inexact_data="warn")).fit(module)
    assert module.steps == 4 and max(_steps(tmp_path / "ckpt")) == 4


class _Watching(_Fit):
    """Records, at each step, what draws the indices of its loader's BatchSampler."""

    def __init__(self, loader: torch.utils.data.DataLoader[torch.Tensor]) -> None:
        super().__init__(loader)
        self.samplers: set[str] = set()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.samplers.add(type(self.loader.batch_sampler.sampler).__name__)  # type: ignore[union-attr]
        return super().training_step(batch, batch_idx)


def test_plain_loader_positioned_during_fit_only(tmp_path: Path) -> None:
    """The callback positions a plain loader through its BatchSampler's sampler during ``fit``, then gives it back."""
    loader = torch.utils.data.DataLoader(_Rows(), batch_size=4, shuffle=True)
    sampler = loader.batch_sampler.sampler  # type: ignore[union-attr]
    module = _Watching(loader)
    _trainer(AsymCheckCallback(tmp_path / "ckpt")).fit(module)
    assert module.steps == 4 and module.samplers == {"_PositionedSampler"}
    assert loader.batch_sampler.sampler is sampler  # type: ignore[union-attr]


def test_a_version_without_positions_is_refused_or_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version of a release that recorded no loader position (the key renamed while it is written): refused by
    default before any training step, resumed with a warning under ``inexact_data="warn"``."""
    import asymcheck.lightning as integration

    loader = torch.utils.data.DataLoader(_Rows(), batch_size=4, shuffle=True)
    with monkeypatch.context() as m:
        m.setattr(integration, "DATA", "an_older_release_key")
        _trainer(AsymCheckCallback(tmp_path / "ckpt")).fit(_Fit(loader))
    named = r"\(step 4\) holds no position of the plain train loader"

    def fit(**options: Any) -> tuple[_Fit, AsymCheckCallback]:
        module, callback = _Fit(loader), AsymCheckCallback(tmp_path / "ckpt", **options)
        pl.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]).fit(module)
        return module, callback

    with pytest.raises(UnresumableDataError, match=named):
        fit()
    assert max(_steps(tmp_path / "ckpt")) == 4
    with pytest.warns(InexactResumeWarning, match=named):
        module, callback = fit(inexact_data="warn")
    assert callback.restored is not None and callback.restored.step == 4
    assert module.steps == 2 and max(_steps(tmp_path / "ckpt")) == 6
