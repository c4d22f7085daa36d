"""Accelerate kill tests: a job under ``asymcheck.accelerate.attach`` dies by SIGKILL, a fresh one resumes, bit-exact.

Each case trains a small GPT-2 through real Accelerate on the CPU (tests/procs/accel_train.py, the loop
shape of Hugging Face's ``run_clm_no_trainer.py``: epochs over a shuffled prepared loader,
``accelerator.accumulate()``, a validation pass after each epoch) with a version every optimizer step,
SIGKILLs every process of the job inside the forward pass after a random number of optimizer steps,
then starts the job again: it resumes from the newest verified version, its loader continues the
interrupted epoch (``skip_first_batches``, after the batches already trained) and it trains to the end.
Every loss either job logged, and the final model, optimizer, scheduler and RNG states of every
process, must equal those of an uninterrupted job without asymcheck, bit for bit.

``make test`` runs: one process with ``accumulate()`` over 2 micro-steps (an epoch of 11 batches:
the epoch's last optimizer step has one), 2-process DDP (gloo) without and with ``accumulate()``, and
the DeepSpeed plugin with ZeRO-2 and ZeRO-3 on 2 processes (DeepSpeed's CPU accelerator). The other ZeRO
stages and accumulation under DeepSpeed are ``exhaustive``. ``ACCELERATE_KILL_SEED`` replays the kill
points (each case prints its own). Mixed precision: bf16 (Accelerate's CPU autocast) with ``accumulate()``,
and fp16's ``GradScaler`` with skipped steps (a few micro-batches' losses made infinite in every run: a
version is one completed optimizer step, the scaler's scale and growth tracker are in it) through
Accelerate's own scaler path on the CPU (``torch.amp.GradScaler("cpu")`` handed to the ``Accelerator``, which
makes its fp16 scaler only on GPUs); real fp16 on CUDA is a ``gpu`` test. The plugin's FSDP2 is not here:
Accelerate 1.15 runs FSDP only on GPUs (on the CPU it prepares the model with DDP). Under DDP the root holds
the replicated state in slices (each process about half of it: ``attach`` tells the Checkpointer it runs DDP).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from asymstore import AsymStore, LocalTier
from asymstore.values import Checkpoint
from tests.procs.accel_train import OVERFLOW
from tests.support.launch import proc_argv, proc_env
from tests.support.mr_harness import free_ports
from tests.support.replicas import assert_sliced, nbytes

pytestmark = pytest.mark.slow

EPOCHS = 3
KILLED = -signal.SIGKILL
SEED = int(os.environ.get("ACCELERATE_KILL_SEED", random.randrange(1 << 30)))  # replays the kill points
PARALLEL = 4  # processes at once (torch imports and fsyncs overlap; the training itself is small)


@dataclass(frozen=True)
class Config:
    mode: str  # single | ddp | ds
    world: int
    accum: int = 1
    stage: int = 2
    precision: str = "no"  # no | bf16 | fp16 (CUDA) | fp16-cpu (Accelerate's scaler path with GradScaler("cpu"))
    compile: str = "no"  # no | aot_eager | inductor: Accelerator(dynamo_plugin=TorchDynamoPlugin(backend=...))
    loader: str = "default"  # default | stateful: DataLoaderConfiguration(use_stateful_dataloader=True)
    peft: bool = False  # LoRA adapters (peft) around the model, the base frozen
    # > 0: the kill comes right after the last optimizer step of this epoch, its version made durable first
    # (``--durable``), so that the resume starts at the epoch's end; 0: a random kill point (ACCELERATE_KILL_SEED)
    epoch_end: int = 0

    @property
    def batches(self) -> int:
        """Batches per epoch and process: 44 samples in batches of 4, split between the processes (padded)."""
        return -(-11 // self.world)

    @property
    def steps(self) -> int:
        """Optimizer steps the job completes (an epoch's last step may have fewer micro-batches).

        Under fp16 the scaler skips the step of each micro-batch in ``accel_train.OVERFLOW`` (one per step,
        ``accum`` is 1 there): no version is taken for it.
        """
        skipped = len(OVERFLOW) if self.precision.startswith("fp16") else 0
        return EPOCHS * self.steps_per_epoch - skipped

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of an epoch (without skipped ones)."""
        return -(-self.batches // self.accum)

    @property
    def name(self) -> str:
        precision = "" if self.precision == "no" else f"-{self.precision}"
        compiled = "" if self.compile == "no" else f"-{self.compile}"
        loader = "" if self.loader == "default" else f"-{self.loader}"
        return (f"{self.mode}{self.stage if self.mode == 'ds' else ''}-w{self.world}-a{self.accum}{precision}{compiled}"
                f"{loader}{'-peft' if self.peft else ''}{f'-end{self.epoch_end}' if self.epoch_end else ''}")

    def args(self) -> list[str]:
        return ["--mode", self.mode, "--accum", str(self.accum), "--stage", str(self.stage),
                "--precision", self.precision, "--compile", self.compile, "--loader", self.loader,
                *(["--peft"] if self.peft else [])]


CONFIGS = [
    pytest.param(Config("single", 1, accum=2), id="single-accum2"),
    pytest.param(Config("ddp", 2), id="ddp2"),
    pytest.param(Config("ds", 2, stage=2), id="ds-zero2"),
    pytest.param(Config("single", 1), id="single", marks=pytest.mark.exhaustive),
    pytest.param(Config("ddp", 2, accum=2), id="ddp2-accum2"),
    pytest.param(Config("ds", 2, stage=0), id="ds-zero0", marks=pytest.mark.exhaustive),
    pytest.param(Config("ds", 2, stage=1), id="ds-zero1", marks=pytest.mark.exhaustive),
    # GPT-2 ties lm_head.weight to wte.weight: the ZeRO-3 capture must empty the tied name too
    pytest.param(Config("ds", 2, stage=3), id="ds-zero3"),
    pytest.param(Config("ds", 2, accum=2), id="ds-zero2-accum2", marks=pytest.mark.exhaustive),
    pytest.param(Config("single", 1, accum=2, precision="bf16"), id="single-accum2-bf16"),
    # Accelerate's fp16 GradScaler path (accelerator.backward scales, AcceleratedOptimizer steps through the scaler
    # and skips on inf): on the CPU with GradScaler("cpu") given to the Accelerator (Accelerate makes one on GPUs only)
    pytest.param(Config("single", 1, precision="fp16-cpu"), id="single-fp16-cpu-scaler"),
    pytest.param(Config("ddp", 2, precision="bf16"), id="ddp2-bf16", marks=pytest.mark.exhaustive),
    # resumed from the version of the second epoch's last step (the pass over; the redrawn order skipped whole)
    pytest.param(Config("ddp", 2, epoch_end=2), id="ddp2-epoch-end", marks=pytest.mark.exhaustive),
    pytest.param(Config("single", 1, precision="fp16"), id="single-fp16-cuda",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


class Zygote:
    """tests/procs/accel_zygote.py: forks the training processes, so torch and friends are imported once."""

    def __init__(self, log: Path) -> None:
        self._log = open(log, "w")
        self.proc = subprocess.Popen(proc_argv("accel_zygote"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=proc_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu"))
        self.pids: dict[str, int] = {}
        self.codes: dict[str, int] = {}
        self._buffer = b""
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        assert json.loads(ready or b"{}").get("ready"), f"the fork server did not start: {log.read_text()[-3000:]}"

    def submit(self, key: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": key, "argv": argv, "env": env, "log": str(log)}).encode() + b"\n")
        self.proc.stdin.flush()

    def poll(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            msg = json.loads(line)
            if "pid" in msg:
                self.pids[msg["id"]] = msg["pid"]
            else:
                self.codes[msg["id"]] = msg["rc"]

    def kill_running(self) -> None:
        for key, pid in self.pids.items():
            if key not in self.codes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._log.close()


@dataclass
class Job:
    """One launch of a configuration: ``world`` training processes (tests/procs/accel_train.py)."""

    config: Config
    out: Path
    args: list[str]
    after: list[Job] = field(default_factory=list)
    started: bool = False
    codes: list[int] = field(default_factory=list)

    def key(self, rank: int) -> str:
        return f"{self.out}#{rank}"

    def start(self, zygote: Zygote) -> None:
        port = free_ports(1)[0]
        self.out.mkdir(parents=True, exist_ok=True)
        for rank in range(self.config.world):
            env = proc_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
            if self.config.world > 1:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.config.world),
                           LOCAL_WORLD_SIZE=str(self.config.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            zygote.submit(self.key(rank), [*self.config.args(), "--out", str(self.out), *self.args], env,
                          self.out / f"log-rank{rank}")
        self.started = True

    def done(self, zygote: Zygote) -> bool:
        if not self.started or any(self.key(r) not in zygote.codes for r in range(self.config.world)):
            return False
        self.codes = [zygote.codes[self.key(r)] for r in range(self.config.world)]
        return True

    def log(self, rank: int) -> str:
        return (self.out / f"log-rank{rank}").read_text()[-4000:]

    def events(self, rank: int, kind: str) -> list[dict[str, Any]]:
        path = self.out / f"events-rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == kind]

    def losses(self, rank: int) -> dict[str, str]:
        path = self.out / f"losses-rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return {d["key"]: d["loss"] for d in map(json.loads, lines)}


def run_jobs(jobs: list[Job], base: Path, timeout: float = 600) -> None:
    """Run every job, a job only after those it comes ``after``, at most PARALLEL processes at once."""
    zygote = Zygote(base / "zygote.log")
    try:
        deadline = time.monotonic() + timeout
        while not all(j.done(zygote) for j in jobs):
            zygote.poll()
            running = sum(j.config.world for j in jobs if j.started and not j.done(zygote))
            for job in jobs:
                if not job.started and all(a.done(zygote) for a in job.after) \
                        and running + job.config.world <= max(PARALLEL, job.config.world):
                    job.start(zygote)
                    running += job.config.world
            if time.monotonic() > deadline:
                zygote.kill_running()
                raise TimeoutError("accelerate jobs did not finish in time")
            time.sleep(0.05)
    finally:
        zygote.close()


@dataclass
class Case:
    config: Config
    kill: int
    reference: Job
    killed: Job
    resumed: Job


def final(job: Job, rank: int) -> Checkpoint:
    async def read() -> Checkpoint:
        async with AsymStore([LocalTier(job.out / f"final-rank{rank}")], keep_last=None) as store:
            return await store.restore()

    return asyncio.run(read())


def assert_same_state(want: Checkpoint, got: Checkpoint, what: str) -> None:
    assert sorted(got.tensors) == sorted(want.tensors), what
    for name, x in want.tensors.items():
        y = got.tensors[name]
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {name}"
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{what}: {name}"
    assert json.loads(json.dumps(got.meta)) == json.loads(json.dumps(want.meta)), what


@dataclass
class Runs:
    cases: dict[Config, Case]
    raw: Job


RAW_TEST = "test_loader_iterated_around_the_resumable_loader_is_refused"


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every selected configuration's reference, killed and resumed jobs, run together (a few processes at once)."""
    selected = [item.callspec.params["config"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "config" in item.callspec.params]
    base = tmp_path_factory.mktemp("accelerate")
    out: dict[Config, Case] = {}
    raw = Job(Config("single", 1), base / "raw", ["--dir", str(base / "raw-ckpt"), "--raw"])
    jobs: list[Job] = [raw] if any(item.module is request.module and item.name == RAW_TEST
                                   for item in request.session.items) else []
    for config in dict.fromkeys(selected):
        if config.precision == "fp16" and not torch.cuda.is_available():
            continue  # skipped: Accelerate's fp16 on the CPU trains in fp32 without a scaler
        d = base / config.name
        if config.epoch_end:  # right after the epoch's last step, its version durable: the resume starts there
            kill, durable = config.epoch_end * config.steps_per_epoch, ["--durable"]
        else:
            kill, durable = random.Random(f"{SEED}-{config.name}").randint(3, config.steps - 3), []
        print(f"{config.name}: SIGKILL after {kill} optimizer steps (ACCELERATE_KILL_SEED={SEED})")
        ref = Job(config, d / "reference", ["--no-ckpt"])
        killed = Job(config, d / "killed", ["--dir", str(d / "ckpt"), "--kill", str(kill), *durable])
        resumed = Job(config, d / "resumed", ["--dir", str(d / "ckpt")], after=[killed])
        out[config] = Case(config, kill, ref, killed, resumed)
        jobs += [ref, killed, resumed]
    jobs.sort(key=lambda j: j.config.mode != "ds")  # the slowest (DeepSpeed) first
    run_jobs(jobs, base)
    return Runs(out, raw)


@pytest.mark.parametrize("config", CONFIGS)
def test_kill_and_resume_bit_exact(runs: Runs, config: Config) -> None:
    check_kill_and_resume(runs, config)


def check_kill_and_resume(runs: Runs, config: Config) -> None:
    """The killed and the resumed job of ``config`` logged the reference's losses, and end in its state, bit for bit."""
    case = runs.cases[config]
    what = f"{config.name}, killed after step {case.kill} (ACCELERATE_KILL_SEED={SEED})"
    for rank in range(config.world):
        assert case.reference.codes[rank] == 0, f"{what}: reference rank {rank}\n{case.reference.log(rank)}"
        assert case.killed.codes[rank] == KILLED, f"{what}: killed rank {rank}\n{case.killed.log(rank)}"
        assert case.resumed.codes[rank] == 0, f"{what}: resumed rank {rank}\n{case.resumed.log(rank)}"
    for rank in range(config.world):
        resumed = case.resumed.events(rank, "resumed")[0]
        assert 1 <= resumed["step"] <= case.kill, f"{what}: resumed at {resumed}"
        stats = case.resumed.events(rank, "stats")[0]
        # one version per optimizer step (accumulation micro-steps take none), none dropped
        assert stats["committed"] == config.steps - resumed["step"] and stats["dropped"] == 0, f"{what}: {stats}"
        assert max(max(v) for v in stats["versions"].values()) == config.steps, f"{what}: {stats}"
        # every loss either job logged is the uninterrupted job's, and together they cover it
        want = case.reference.losses(rank)
        assert len(want) == EPOCHS * (config.batches + 1), what  # micro-batches and a validation per epoch
        seen: set[str] = set()
        for job in (case.killed, case.resumed):
            for key, loss in job.losses(rank).items():
                assert loss == want[key], f"{what}: rank {rank}, loss of {key} in the {job.out.name} job"
                seen.add(key)
        assert seen == set(want), f"{what}: rank {rank} never trained {sorted(set(want) - seen)}"
        assert_same_state(final(case.reference, rank), final(case.resumed, rank), f"{what}: rank {rank}")
    if config.mode == "ddp":  # attach() told the Checkpointer Accelerate runs DDP: the replicated state in slices
        whole = final(case.reference, 0).tensors
        replicated = nbytes(v for k, v in whole.items() if k.startswith(("model/", "optim/")))
        assert_sliced(case.killed.out.parent / "ckpt", config.world, replicated, what)


def test_loader_iterated_around_the_resumable_loader_is_refused(runs: Runs) -> None:
    """A version cannot hold the position of a loader the loop iterates itself: the first step raises."""
    job = runs.raw
    assert job.codes == [0], job.log(0)
    refused = job.events(0, "refused")
    assert refused and refused[0]["error"] == "DataPositionError", job.log(0)
    assert "ckpt.loader" in refused[0]["message"]
