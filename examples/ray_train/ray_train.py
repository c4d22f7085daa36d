"""Ray Train: a TorchTrainer of 2 CPU workers takes a version every step; a worker is killed and Ray resumes it.

It starts a local Ray (2 CPUs, no dashboard), trains a small MLP under DDP (gloo, the process group Ray
sets up) with a version every step on a shared root, and kills rank 1's worker process (``os._exit``)
after step ``--kill-at`` of the first attempt. Ray's ``FailureConfig(max_failures=1)`` restarts the
worker group; the new workers resume from the newest version that verifies and train to the end.
Ray's final checkpoint is a pointer to the final version. Run it as it is (it removes what it wrote), or
with ``--root``, ``--out`` (a JSON of what each attempt did, for tests/asymcheck/ray/) and ``--kill-at 0``
(no kill). Not run by examples/check_snippets.py (a Ray cluster costs ~30 s): its test runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import ray
import ray.train
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.nn.parallel import DistributedDataParallel

import asymcheck.ray


def make_model() -> torch.nn.Module:
    """The same initial model on every worker (DDP broadcasts rank 0's anyway)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step`` (a function of both: the data position is the step)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_loop(config: dict[str, Any]) -> None:
    """Every worker: DDP over Ray's process group, a version every step."""
    rank = ray.train.get_context().get_world_rank()
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # --8<-- [start:loop]
    with asymcheck.ray.RayCheckpointer(model, optimizer, config["root"]) as ckpt:
        start = ckpt.resume() or 0              # after a restart: the newest version that verifies
        die_after(optimizer, config, rank)      # (the fault this example injects)
        for step in range(start, config["steps"]):
            x, y = batch(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % config["report_every"] == 0:  # same steps on every worker: both are barriers
                ckpt.report({"loss": loss.item()})  # Ray gets a pointer to the newest published version
                ckpt.check_preemption()             # Ray's drain notice: every rank flushes the same step
            # --8<-- [end:loop]
            record(config, rank, {"start": start, "step": step + 1, "loss": loss.item()})
    if rank == 0:
        params = {name: p.detach().flatten().tolist() for name, p in model.module.named_parameters()}
        record(config, rank, {"final": ckpt.step, "params": params})


def die_after(optimizer: torch.optim.Optimizer, config: dict[str, Any], rank: int) -> None:
    """The fault: rank 1's process exits after optimizer step ``kill_at`` of the first attempt only."""
    marker = os.path.join(config["root"], "..", "killed-once")
    if not config["kill_at"] or rank != 1 or os.path.exists(marker):
        return
    done = [0]

    def hook(*_: Any) -> None:
        done[0] += 1
        if done[0] == config["kill_at"]:
            open(marker, "w").close()
            os._exit(1)  # as a SIGKILL would: no cleanup, no exception

    optimizer.register_step_post_hook(hook)


def record(config: dict[str, Any], rank: int, line: dict[str, Any]) -> None:
    """Append what happened to ``out`` (one JSON line per event; rank 0 only)."""
    if rank == 0 and config["out"]:
        with open(config["out"], "a", encoding="utf-8") as f:
            f.write(json.dumps({**line, "t": time.time()}) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="the checkpoint root (default: a temporary directory, removed)")
    parser.add_argument("--out", default="", help="append what each attempt did to this file, as JSON lines")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=3, help="kill rank 1 after this step of the first attempt")
    parser.add_argument("--report-every", type=int, default=2, help="steps between reports to Ray")
    parser.add_argument("--work", help="an empty directory for Ray's files (short: Ray's sockets live under it)")
    args = parser.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    root = os.path.abspath(args.root or os.path.join(work, "shared", "ckpt"))
    os.makedirs(root, exist_ok=True)
    # Ray Train V2 takes one report per poll of its controller (every 2 s by default): poll faster here
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    try:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=78 << 20, _temp_dir=f"{work}/r",
                 log_to_driver=False, configure_logging=False)
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"root": root, "steps": args.steps, "kill_at": args.kill_at, "out": args.out,
                               "report_every": args.report_every},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(storage_path=f"{work}/ray", name="ray_train",
                                 failure_config=FailureConfig(max_failures=1)))
        result = trainer.fit()
        assert result.checkpoint is not None, "Ray reported no checkpoint"
        pointer = asymcheck.ray.read_pointer(result.checkpoint)
        print(f"trained {args.steps} steps; Ray's checkpoint names step {pointer.step} of {pointer.root} "
              f"(loss {pointer.metrics.get('loss')})", flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps({"pointer": {"root": pointer.root, "step": pointer.step,
                                                "world_size": pointer.world_size}}) + "\n")
        return 0 if pointer.step == args.steps else 1
    finally:
        ray.shutdown()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
