"""TorchTitan kill test: a job under ``AsymCheckManager`` dies by SIGKILL, a fresh one resumes it, bit-exact.

TorchTitan 0.3's training entry point needs CUDA and triton (``import torchtitan.train`` fails on a CPU
build); tests/procs/titan_train.py drives the manager as ``Trainer.train`` does, with TorchTitan's own
``OptimizersContainer`` (``default_adamw``), ``LRSchedulersContainer`` (warmup and linear decay),
``HuggingFaceTextDataLoader`` (its tokenizer over a local text dataset, tests/support/titan_assets.py) and
the trainer's ``train_state``, two micro-batches per step and dropout.
The job is SIGKILLed inside the forward pass after a random number of steps (``TITAN_KILL_SEED``
replays it), started again: it resumes from the newest verified version and trains to the end, exporting
the last step as Hugging Face safetensors (``last_save_in_hf``). Every loss either job logged, and the
final model, AdamW state, param groups, LR scheduler, train state and RNG state, must equal those of an
uninterrupted job (the manager disabled), bit for bit. The full entry point on a GPU: test_entrypoint.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.launch import proc_argv, proc_env
from tests.support.titan_assets import make_assets

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is not installed")

pytestmark = pytest.mark.slow

STEPS = 8
SEED = int(os.environ.get("TITAN_KILL_SEED", random.randrange(1 << 30)))


@dataclass
class Job:
    out: Path
    code: int

    def log(self) -> str:
        return (self.out / "log").read_text()[-4000:]

    def events(self, kind: str) -> list[dict[str, Any]]:
        path = self.out / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == kind]

    def losses(self) -> dict[int, str]:
        path = self.out / "losses.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return {d["step"]: d["loss"] for d in map(json.loads, lines)}

    def final(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        from safetensors.torch import load_file

        return load_file(self.out / "final.safetensors"), json.loads((self.out / "final.json").read_text())


def start(out: Path, *args: str) -> tuple[Path, subprocess.Popen[bytes]]:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log", "wb")
    assets = out.parent / "assets"
    proc = subprocess.Popen(proc_argv("titan_train", "--out", str(out), "--steps", str(STEPS), "--assets", str(assets),
                                      *args), stdout=log, stderr=subprocess.STDOUT,
                            env=proc_env(OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(out / "hf-cache"),
                                         HF_HUB_OFFLINE="1"))
    return out, proc


@dataclass
class Runs:
    kill: int
    dump: Path
    reference: Job
    killed: Job
    resumed: Job


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("torchtitan")
    kill = random.Random(SEED).randint(3, STEPS - 3)
    print(f"SIGKILL after {kill} steps (TITAN_KILL_SEED={SEED})")
    dump = base / "dump"
    make_assets(base / "assets")
    started = [start(base / "reference"), start(base / "killed", "--dir", str(dump), "--kill", str(kill))]
    done = [Job(out, proc.wait(timeout=300)) for out, proc in started]
    out, proc = start(base / "resumed", "--dir", str(dump), "--hf")
    resumed = Job(out, proc.wait(timeout=300))
    return Runs(kill, dump, done[0], done[1], resumed)


def test_kill_and_resume_bit_exact(runs: Runs) -> None:
    """The killed and the resumed job logged the reference's losses and end in its state, bit for bit."""
    what = f"killed after step {runs.kill} (TITAN_KILL_SEED={SEED})"
    assert runs.reference.code == 0, runs.reference.log()
    assert runs.killed.code == -signal.SIGKILL, f"{what}\n{runs.killed.log()}"
    assert runs.resumed.code == 0, f"{what}\n{runs.resumed.log()}"
    [resumed] = runs.resumed.events("resumed")
    assert 1 <= resumed["step"] <= runs.kill, f"{what}: {resumed}"
    assert resumed["ntokens_seen"] == resumed["step"] * 2 * 2 * 16, resumed  # the train state came back too
    [stats] = runs.resumed.events("stats")
    assert stats["committed"] == STEPS - resumed["step"] and stats["dropped"] == 0, f"{what}: {stats}"
    assert max(max(v) for v in stats["versions"].values()) == STEPS, stats
    want = runs.reference.losses()
    assert sorted(want) == list(range(1, STEPS + 1))
    seen: set[int] = set()
    for job in (runs.killed, runs.resumed):
        for step, loss in job.losses().items():
            assert loss == want[step], f"{what}: loss of step {step} in the {job.out.name} job"
            seen.add(step)
    assert seen == set(want), what
    (ref_t, ref_meta), (got_t, got_meta) = runs.reference.final(), runs.resumed.final()
    assert sorted(got_t) == sorted(ref_t)
    for name, x in ref_t.items():
        y = got_t[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{what}: {name}"
    assert got_meta == ref_meta, what


def test_last_step_exported_as_hugging_face_safetensors(runs: Runs) -> None:
    """``last_save_in_hf``: the last step's model, renamed by the adapter, cast to bfloat16, with its index."""
    from safetensors.torch import load_file

    from tests.support.titan_parts import HF_NAMES

    assert runs.resumed.code == 0, runs.resumed.log()
    out = runs.dump / "checkpoint_hf" / f"step-{STEPS}"
    got = load_file(out / "model.safetensors")
    ref_t, _ = runs.reference.final()
    model = {k.removeprefix("model/"): v for k, v in ref_t.items() if k.startswith("model/")}
    assert sorted(got) == sorted(HF_NAMES.get(k, "model." + k) for k in model)
    for key, value in model.items():
        hf = got[HF_NAMES.get(key, "model." + key)]
        assert hf.dtype == torch.bfloat16 and torch.equal(hf, value.to(torch.bfloat16)), key
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict.fromkeys(sorted(got), "model.safetensors")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert sorted(os.listdir(out.parent)) == [f"step-{STEPS}"]  # nothing left half-written beside it
