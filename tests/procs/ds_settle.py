"""A child of tests/asymcheck/deepspeed/test_settle.py: one process, a real DeepSpeed engine (ZeRO-2, CPU, gloo).

``python -m tests.procs.ds_settle --mode MODE --dir CKPT --out OUT.json`` (``RANK`` in OUT is the process's rank)

The DeepSpeed adapter's hooks deliver a completed ``engine.step()`` late (at the next forward of the root
module); each mode reads the Checkpointer between the engine's step and that forward:

- ``metrics``: ``ckpt.log_metrics({"m": s})`` right after step ``s``, with ``keep_last=1`` and
  ``keep_best=KeepBest("m", "min")`` (step 1 is the best); writes the global versions kept and their metrics.
- ``submodule``: the forwards call the root module's children directly (the root's forward pre-hook never
  fires); writes ``ckpt.step`` after close, the versions, and what a fresh engine resumed from the newest
  version holds (the step ``resume()`` returned, the engine's ``global_steps``).
- ``functional``: as ``submodule``, the forward computed from the parameters with ``torch.nn.functional``
  (no module's forward runs at all: only the next engine step can deliver the last one).
- ``late-resume``: a first run commits versions 1 and 2; a second takes one engine step, then calls
  ``ckpt.resume()`` (too late: the step ran), one more step, close; writes what ``resume()`` did (the
  error's class, or the step resumed), the global versions and the engine's ``global_steps``.
- ``preempt`` (2 ranks: ``RANK``, ``WORLD_SIZE``... in the environment): after 3 steps rank 0 calls
  ``ckpt.preempt()`` right after ``engine.step()``, rank 1 after a validation forward (which delivers the
  step); writes, per rank, the flush's record and the ERRORs ``asymcheck.policy.preempt`` logged.
- ``accelerate``: Accelerate's DeepSpeed plugin (``accelerator.backward`` runs ``engine.step()``); writes
  ``ckpt.step`` read right after each optimizer step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
STEPS = 3


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _engine() -> Any:
    import deepspeed

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))


def metrics(root: str) -> dict[str, Any]:
    import asymcheck.deepspeed as ads
    from asymcheck.options import PacingOptions, RetentionOptions
    from asymstore import KeepBest
    from asymstore.multirank.globaldir import read_global

    engine = _engine()
    ckpt = ads.attach(engine, root, pacing=PacingOptions(max_overhead=None),
                      retention=RetentionOptions(keep_last=1, keep_best=KeepBest("m", "min")))
    ckpt.resume()
    for i in range(STEPS):
        engine.backward(engine(_batch(i)).square().mean())
        engine.step()
        ckpt.log_metrics({"m": float(i + 1)})  # the metric of step i + 1, right after it
    ckpt.close()
    steps = ckpt.rank_store.global_steps()
    return {"versions": steps,
            "metrics": {str(s): read_global(os.path.join(root, "global"), s).meta.get("metrics") for s in steps}}


def _through_children(engine: Any, x: torch.Tensor) -> torch.Tensor:
    for child in engine.module:  # the root module's forward (and its pre-hooks) never runs
        x = child(x)
    return x


def _functional(engine: Any, x: torch.Tensor) -> torch.Tensor:
    first, last = engine.module[0], engine.module[2]  # no module's forward runs
    return torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, first.weight, first.bias)),
                                      last.weight, last.bias)


def submodule(root: str, functional: bool = False) -> dict[str, Any]:
    import asymcheck.deepspeed as ads
    from asymcheck.options import PacingOptions

    engine = _engine()
    ckpt = ads.attach(engine, root, pacing=PacingOptions(max_overhead=None))
    ckpt.resume()
    for i in range(STEPS):
        out = (_functional if functional else _through_children)(engine, _batch(i))
        engine.backward(out.square().mean())
        engine.step()
    ckpt.close()
    closed_step, versions = ckpt.step, ckpt.rank_store.global_steps()
    again = _engine()
    resumed = ads.attach(again, root)
    step = resumed.resume()
    resumed.close()
    return {"step": closed_step, "versions": versions, "engine_steps": int(engine.global_steps),
            "resumed": step, "resumed_engine_steps": int(again.global_steps)}


def late_resume(root: str) -> dict[str, Any]:
    import asymcheck.deepspeed as ads
    from asymcheck.options import PacingOptions

    first = _engine()
    with ads.attach(first, root, pacing=PacingOptions(max_overhead=None)) as ckpt:
        ckpt.resume()
        for i in range(2):
            first.backward(first(_batch(i)).square().mean())
            first.step()
    engine = _engine()
    ckpt = ads.attach(engine, root, pacing=PacingOptions(max_overhead=None))
    engine.backward(engine(_batch(7)).square().mean())
    engine.step()  # a step of this run, then the resume: it must refuse (nothing loaded)
    try:
        outcome: Any = ckpt.resume()
    except Exception as exc:
        outcome = type(exc).__name__
    engine.backward(engine(_batch(8)).square().mean())
    engine.step()
    try:
        ckpt.close()
    except Exception as exc:  # the plain adapter's step raises StepConflictError on a store ahead of the run
        logger.info("close: %r", exc)
    return {"outcome": outcome, "versions": ckpt.rank_store.global_steps(), "engine_steps": int(engine.global_steps)}


def preempt(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import asymcheck.deepspeed as ads
    from asymcheck.options import PacingOptions

    errors: list[str] = []

    class Errors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record.getMessage())

    logging.getLogger("asymcheck.policy.preempt").addHandler(Errors(logging.ERROR))
    engine = _engine()
    ckpt = ads.attach(engine, root, pacing=PacingOptions(max_overhead=None))
    ckpt.resume()
    for i in range(STEPS):
        engine.backward(engine(_batch(i)).square().mean())
        engine.step()
    if dist.get_rank() == 1:  # a validation forward: the adapter delivers the step here
        with torch.no_grad():
            engine(_batch(99))
    record = ckpt.preempt()  # collective: every rank, after the same optimizer step
    return {"step": record.step, "durable": record.durable, "global_step": record.global_step, "errors": errors}


def accelerate(root: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import asymcheck.accelerate as aa
    from asymcheck.options import PacingOptions

    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1)
    plugin.deepspeed_config.update({"train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True,
                                    "steps_per_print": 10**6})
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model = _model()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = aa.attach(accelerator, model, opt, root, pacing=PacingOptions(max_overhead=None))
    ckpt.resume()
    seen = []
    for i in range(STEPS):
        accelerator.backward(model(_batch(i)).square().mean())  # runs engine.step()
        opt.step()
        opt.zero_grad()
        seen.append(ckpt.step)  # optimizer steps completed: i + 1
    ckpt.close()
    return {"seen": seen, "step": ckpt.step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["metrics", "submodule", "functional", "late-resume", "preempt",
                                           "accelerate"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.mode != "accelerate":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    modes = {"metrics": metrics, "submodule": submodule, "functional": lambda root: submodule(root, True),
             "late-resume": late_resume, "preempt": preempt, "accelerate": accelerate}
    result = modes[args.mode](args.dir)
    Path(args.out.replace("RANK", os.environ.get("RANK", "0"))).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
