"""LoRA-style fine-tune: bytes written per version and step time, with unchanged chunks referenced or rewritten.

A GPT-2 whose base is frozen and whose attention projections carry LoRA adapters (PEFT), AdamW over
the adapters only, checkpointed after every optimizer step by ``asymcheck.Checkpointer`` into a
LocalTier (keep_last=3). Methods, each run in a fresh process, interleaved (ABBA rounds):

- ``none``: no checkpoint (the baseline for step time).
- ``unchanged``: ``AsymStore(references="unchanged")`` (the default): the frozen base is written
  with the first version and referenced by every later one (format 4).
- ``off``: ``AsymStore(references="off")``: every version writes the whole state (today's bytes).
- ``known``: as ``unchanged``, with ``CommitOptions(frozen="known")``: the frozen base is also copied
  to host only once, not read again at every version.

Reported per method: median step time (after the first versions) and its ratio to ``none``; bytes
written per version, twice: as the kept versions' manifests say (their own segments and the manifest
itself, the median over the versions kept at the end, the first one never among them), and as the
kernel counted them (the process's ``write_bytes`` from ``/proc/self/io`` over the versions after
the first: ``LATEST``, the alignment of large chunks to 4 KiB pages and every other write of the
process are in it); the bytes copied from the model to host memory per version after the first
(``stats().copy_bytes``: frozen parameters known unchanged are copied once, see
docs/guides/checkpointer.md); and beside them the trainable state (adapters + their AdamW moments + the step
counters) that a version must write. Target: ``unchanged`` writes <= 1.1 x the trainable state per
version (by the manifests). Every run restores its newest version at the end and checks it bit-exact
against the live model and optimizer.

    python benches/lora_references.py                     # GPT-2 30M, LoRA r=16, 40 steps, 3 rounds
    python benches/lora_references.py --quick             # tiny model, 12 steps, 1 round (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import build_gpt2, same_bytes, write_json
from harness import add_child_flag, add_quick_flag, child_argv, rounds, run_fresh

METHODS = ["none", "unchanged", "off", "known"]
TARGET_BYTES_X_TRAINABLE = 1.10
WARMUP_VERSIONS = 2  # versions not counted: the first writes the base


def io_write_bytes() -> int:
    """Bytes this process has caused to be written to storage (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def lora_model(model_name: str, seq: int, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """GPT-2 ``model_name`` with LoRA adapters of ``rank`` on its attention and MLP projections; AdamW on them."""
    from peft import LoraConfig, get_peft_model

    base, _, _ = build_gpt2(model_name, seq)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["c_attn", "c_proj"],
                                            fan_in_fan_out=True, lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-3)


def trainable_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of what changes every step: the trainable parameters and every tensor of the optimizer's state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return params + state


def child(method: str, model_name: str, seq: int, batch: int, steps: int, rank: int, out: str) -> None:
    from asymcheck import Checkpointer
    from asymcheck.options import CommitOptions
    from asymstore import AsymStore, LocalTier
    from asymstore.format.manifest import MANIFEST_NAME
    from asymstore.format.names import parse_version_dirname
    from asymstore.format.parse import parse_manifest

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model, opt = lora_model(model_name, seq, rank)
    vocab = model.config.vocab_size
    root = Path(tempfile.mkdtemp(prefix=f"lora-{method}-", dir=os.environ.get("BENCH_DIR")))
    ckpt = None
    if method != "none":
        references = "off" if method == "off" else "unchanged"
        store = AsymStore([LocalTier(root)], keep_last=3, references=references)
        ckpt = Checkpointer(model, opt, store,
                            commits=CommitOptions(frozen="known" if method == "known" else "copy"))
    times: list[float] = []
    written: list[int] = []
    copied: list[int] = []  # bytes copied from the model to host (the copy engine's count)
    try:
        for step in range(steps):
            x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(step))
            t0 = time.perf_counter()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            if ckpt is not None and step == WARMUP_VERSIONS - 1:
                ckpt.flush()
                written.append(io_write_bytes())
                copied.append(ckpt.stats().copy_bytes)
        committed_before = WARMUP_VERSIONS
        if ckpt is not None:
            ckpt.flush()
            written.append(io_write_bytes())
            stats = ckpt.stats() if callable(ckpt.stats) else ckpt.stats
            committed = int(stats.versions_committed)
            copied.append(int(stats.copy_bytes))
            ckpt.close()
            manifests = [(root / d / MANIFEST_NAME).read_bytes() for d in sorted(os.listdir(root))
                         if parse_version_dirname(d) is not None and (root / d / MANIFEST_NAME).exists()]
            own = [parse_manifest(m).written_bytes + len(m) for m in manifests]
            async_restore = AsymStore([LocalTier(root)], read_only=True)

            import asyncio

            async def newest() -> dict[str, torch.Tensor]:
                async with async_restore as s:
                    return (await s.restore()).tensors
            restored = asyncio.run(newest())
            live = {f"model/{k}": v for k, v in model.state_dict().items()}
            exact = bool(live.keys() & restored.keys()) and all(
                same_bytes(v, restored[k]) for k, v in live.items() if k in restored)
        else:
            committed, exact = 0, True
        doc: dict[str, Any] = {
            "method": method, "step_s": statistics.median(times[WARMUP_VERSIONS + 1:]),
            "trainable_bytes": trainable_state_bytes(model, opt),
            "total_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "versions": committed, "restored_exact": exact,
        }
        if ckpt is not None and committed > committed_before:
            doc["io_bytes_per_version"] = (written[-1] - written[0]) / (committed - committed_before)
            doc["copy_bytes_per_version"] = (copied[-1] - copied[0]) / (committed - committed_before)
            doc["bytes_per_version"] = statistics.median(own)
        Path(out).write_text(json.dumps(doc))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="30m")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="lora_references.json")
    add_quick_flag(ap, "tiny GPT-2, 12 steps, one round (about a minute)")
    add_child_flag(ap, nargs=2, metavar=("METHOD", "OUT"))
    args = ap.parse_args()
    if args.quick:
        args.model, args.steps, args.rounds, args.seq = "tiny", 12, 1, 64
    if args.child:
        child(args.child[0], args.model, args.seq, args.batch, args.steps, args.rank, args.child[1])
        return
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd, method in rounds(METHODS, args.rounds):
            out = os.path.join(tmp, f"{method}-{rnd}.json")
            run = run_fresh(child_argv(__file__, "--model", args.model, "--seq", str(args.seq), "--batch",
                                       str(args.batch), "--steps", str(args.steps), "--rank", str(args.rank),
                                       "--child", method, out))
            if run.code != 0:
                raise SystemExit(f"{method} failed:\n{run.log[-4000:]}")
            results[method].append(json.loads(Path(out).read_text()) | {"loadavg_1m": run.loadavg_1m})
    base_step = statistics.median(r["step_s"] for r in results["none"])
    trainable = results["none"][0]["trainable_bytes"]
    print(f"GPT-2 {args.model} + LoRA r={args.rank}: parameters {results['none'][0]['total_param_bytes'] / 2**20:.1f} "
          f"MiB, trainable state (adapters + AdamW moments) {trainable / 2**20:.2f} MiB")
    print(f"{'method':<10} {'step ms':>8} {'x none':>7} {'MiB/version':>12} {'x trainable':>12} {'io MiB/v':>9} "
          f"{'copy MiB/v':>10} {'load':>5} exact")
    summary: dict[str, Any] = {"args": vars(args), "trainable_bytes": trainable, "methods": {}}
    for method in METHODS:
        rows = results[method]
        step = statistics.median(r["step_s"] for r in rows)
        per_version = [r["bytes_per_version"] for r in rows if "bytes_per_version" in r]
        bpv = statistics.median(per_version) if per_version else float("nan")
        io = [r["io_bytes_per_version"] for r in rows if "io_bytes_per_version" in r]
        iopv = statistics.median(io) if io else float("nan")
        cp = [r["copy_bytes_per_version"] for r in rows if "copy_bytes_per_version" in r]
        cpv = statistics.median(cp) if cp else float("nan")
        load = statistics.mean(r["loadavg_1m"] for r in rows)
        exact = all(r["restored_exact"] for r in rows)
        print(f"{method:<10} {step * 1e3:8.1f} {step / base_step:7.2f} {bpv / 2**20:12.2f} {bpv / trainable:12.2f} "
              f"{iopv / 2**20:9.2f} {cpv / 2**20:10.2f} {load:5.1f} {exact}")
        summary["methods"][method] = {"step_s": step, "step_x_none": step / base_step, "bytes_per_version": bpv,
                                      "io_bytes_per_version": iopv, "copy_bytes_per_version": cpv,
                                      "bytes_x_trainable": bpv / trainable, "loadavg_1m": load, "exact": exact,
                                      "runs": rows}
    met = summary["methods"]["unchanged"]["bytes_x_trainable"] <= TARGET_BYTES_X_TRAINABLE
    print(f"target: unchanged writes <= {TARGET_BYTES_X_TRAINABLE} x the trainable state per version: "
          f"{'met' if met else 'NOT met'}")
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
