"""Ray's preemption notice: a head and 2 one-CPU nodes on this machine, rank 1's node drained mid-training.

``python -m tests.procs.ray_preempt WORK STEPS NOTICE_AT``: a ``TorchTrainer`` of 2 CPU workers (one per node,
DDP over gloo) trains ``STEPS`` steps with an ``asymcheck.ray.RayCheckpointer`` under ``WORK/shared/ckpt``,
reporting and asking for a preemption notice after every step. When rank 0 has completed step ``NOTICE_AT``
of the first attempt, this driver asks Ray's GCS to drain rank 1's node for preemption with a deadline
(what a cloud's spot reclaim does through Ray's autoscaler), removes the node at the deadline and adds a
fresh one. Ray Train's watcher marks the workers, ``check_preemption()`` flushes the newest completed step on
both ranks and waits; Ray restarts the group on the new node at the deadline and the run resumes. Every
event goes to ``WORK/out.jsonl`` (rank 0): the attempt's start, each step's loss.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import ray
import ray.train
import torch
from ray.cluster_utils import Cluster
from ray.core.generated import autoscaler_pb2
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.nn.parallel import DistributedDataParallel

from asymcheck.ray import RayCheckpointer

DEADLINE_S = 4.0


def make_model() -> torch.nn.Module:
    """The same initial model on every worker."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_loop(config: dict[str, Any]) -> None:
    """Every worker; rank 0 asks for the drain after step NOTICE_AT of the first attempt."""
    work = config["work"]
    rank = ray.train.get_context().get_world_rank()
    with open(f"{work}/node-{rank}", "w") as f:
        f.write(ray.get_runtime_context().get_node_id())
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = not os.path.exists(f"{work}/drain-now")
    with RayCheckpointer(model, optimizer, f"{work}/shared/ckpt") as ckpt:
        start = ckpt.resume() or 0
        out(work, rank, {"start": start})
        for step in range(start, config["steps"]):
            x, y = batch(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            out(work, rank, {"start": start, "step": step + 1, "loss": loss.item()})
            if first and rank == 0 and step + 1 == config["notice_at"]:
                open(f"{work}/drain-now", "w").close()
            ckpt.report({"loss": loss.item()})
            ckpt.check_preemption()
            time.sleep(0.05)  # a longer step: the notice lands well before the end
    params = {name: p.detach().flatten().tolist() for name, p in model.module.named_parameters()}
    out(work, rank, {"final": ckpt.step, "params": params})


def out(work: str, rank: int, line: dict[str, Any]) -> None:
    """Append ``line`` to ``WORK/out.jsonl`` (rank 0)."""
    if rank == 0:
        with open(f"{work}/out.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({**line, "t": time.time()}) + "\n")


def preempt(cluster: Cluster, work: str, done: threading.Event) -> None:
    """Drain rank 1's node once rank 0 asks, remove it at the deadline, add a fresh node (the main thread)."""
    while not os.path.exists(f"{work}/drain-now"):
        if done.wait(0.05):
            return
    with open(f"{work}/node-1") as f:
        node_id = f.read().strip()
    deadline = time.time() + DEADLINE_S
    gcs = ray._raylet.GcsClient(address=cluster.address)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "test: spot reclaim", int(deadline * 1000))
    with open(f"{work}/drained", "w") as f:
        json.dump({"accepted": accepted, "why": why, "node": node_id, "deadline": deadline}, f)
    time.sleep(max(0.0, deadline - time.time()))
    for node in list(cluster.worker_nodes):
        if node.unique_id == node_id:
            cluster.remove_node(node, allow_graceful=False)
    cluster.add_node(num_cpus=1, object_store_memory=78 << 20)


def main(work: str, steps: int, notice_at: int) -> int:
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "0.2"
    os.environ["RAY_TMPDIR"] = work  # every Ray file of this cluster under WORK (Cluster ignores temp_dir for some)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": 78 << 20})
    done = threading.Event()
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=78 << 20)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        trainer = TorchTrainer(
            train_loop, train_loop_config={"work": work, "steps": steps, "notice_at": notice_at},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=f"{work}/ray", name="preempt",
                                 failure_config=FailureConfig(max_failures=0)))
        failed: list[BaseException] = []

        def fit() -> None:
            try:
                trainer.fit()
            except BaseException as exc:  # reported below, on the main thread
                failed.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=fit, daemon=True)
        thread.start()
        preempt(cluster, work, done)  # on the main thread: Ray adds nodes only there (signal handlers)
        thread.join()
        if failed:
            raise failed[0]
        return 0
    finally:
        done.set()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
