"""Fork server of the Accelerate tests (run as a script; never imported by pytest).

``python -m tests.procs.accel_zygote``

Importing torch, transformers, Accelerate and DeepSpeed costs seconds of CPU per process, and the
Accelerate tests start many short training processes. This server imports them once, prints
``{"ready": true}``, then reads one JSON request per line on stdin,
``{"id": ..., "argv": [...], "env": {...}, "log": path}``, and forks a child for each: a fresh process
(nothing of torch.distributed, Accelerate's state or DeepSpeed is initialised here) that sets its
environment to ``env``, sends its output to ``log`` and runs tests/procs/accel_train.py's ``main``
with ``argv``. It prints ``{"id", "pid"}`` when a child starts and ``{"id", "rc"}`` when it ends (a
negative rc: the signal that ended it). End of input: it waits for its children and exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback
from typing import Any


def preload() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeed picks its accelerator (on import)
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import torch._dynamo  # noqa: F401  (DistributedDataParallel imports it on construction: seconds)
    from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler  # noqa: F401

    import asymcheck.accelerate
    import asymcheck.deepspeed  # noqa: F401
    from tests.procs import accel_train  # noqa: F401


def child(request: dict[str, Any]) -> None:
    code = 1
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from tests.procs import accel_train

        code = accel_train.main(request["argv"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    preload()
    print(json.dumps({"ready": True}), flush=True)
    ids: dict[int, Any] = {}
    stdin = sys.stdin.fileno()
    buffer = b""
    open_input = True
    while open_input or ids:
        ready, _, _ = select.select([stdin] if open_input else [], [], [], 0.05)
        if ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                open_input = False
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if not line.strip():
                    continue
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(request)
                ids[pid] = request["id"]
                print(json.dumps({"id": request["id"], "pid": pid}), flush=True)
        while ids:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            print(json.dumps({"id": ids.pop(pid), "rc": rc}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
