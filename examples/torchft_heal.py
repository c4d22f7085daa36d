"""torchft on CPU: a replica group that joins late heals from the other group's store.

Two replica groups of one process each, torchft's lighthouse in this process, gloo between the
groups. Group 0 trains alone; group 1 starts once group 0 has committed step 3, heals from the
version group 0's store holds in memory (verified on arrival), and both train 3 more steps
together. Each group saves every committed step to its own store: host memory first, its own
disk behind it. Run it as it is: it starts both groups itself and removes what they wrote.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.torchft import StoreTransport


class Batches:
    """The group's data position: batches trained in committed steps (travels with each version)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def group(replica_id: int, lighthouse: str, root: str) -> None:
    """One replica group: train, save each committed step, heal when torchft says so."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = Batches()

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's own store
    # --8<-- [start:setup]
    store = AsymStore([host_tier(256 << 20, name="memory"), LocalTier(f"{root}/group-{replica_id}")],
                      durable="memory")                       # commit returns once the version is in memory
    transport = StoreTransport(store, replica_group=str(replica_id))
    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=1, replica_id=str(replica_id), lighthouse_addr=lighthouse,
                      store_addr="127.0.0.1", store_port=tcp.port, rank=0, world_size=1,
                      checkpoint_transport=transport, timeout=timedelta(seconds=20))
    transport.attach(manager, {"default": state_dict}, position=batches)  # + RNG and data position
    transport.save()                                          # version 0: the initial weights
    # --8<-- [end:setup]
    stop = None
    while stop is None or manager.current_step() < stop:
        # --8<-- [start:loop]
        manager.start_quorum()                                # torchft's quorum (and a heal) starts here
        inner.zero_grad()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * replica_id + batches.n))
        model(x).square().mean().backward()
        for work in [manager.allreduce(p.grad) for p in model.parameters()]:
            work.wait()
        if manager.should_commit():                           # a heal is applied here, on this thread
            inner.step()
            batches.n += 1
            transport.save()                                  # this committed step's version, in memory
        # --8<-- [end:loop]
            if manager.current_step() <= 3 or stop is not None:
                print(f"group {replica_id}: step {manager.current_step()}", flush=True)
        if stop is None and transport.healed is not None:
            stop = transport.healed.step + 3
        if stop is None and transport.served_steps:
            stop = transport.served_steps[0] + 3
    if transport.healed is not None:
        h = transport.healed
        print(f"group {replica_id}: healed step {h.step} from group {h.source_group}'s {h.source_tier} tier "
              f"({h.nbytes} bytes, verified)", flush=True)
    manager.shutdown(wait=False)
    transport.shutdown()                                      # the store's slower tiers catch up, then it closes


def main() -> None:
    from torchft._torchft import LighthouseServer

    root = tempfile.mkdtemp(prefix="asymstore-torchft-")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, __file__, "0", lighthouse.address(), root], env=env,
                                      stdout=subprocess.PIPE, text=True))
        for line in procs[0].stdout:
            print(line, end="")
            if line.strip() == "group 0: step 3":
                break
        procs.append(subprocess.Popen([sys.executable, __file__, "1", lighthouse.address(), root], env=env,
                                      stdout=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=180)[0] for p in procs]
        print("".join(outputs), end="")
        assert all(p.returncode == 0 for p in procs), outputs
        assert "group 1: healed step" in outputs[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__" and len(sys.argv) == 4:
    group(int(sys.argv[1]), sys.argv[2], sys.argv[3])
elif __name__ == "__main__":
    main()
