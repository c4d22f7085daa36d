"""TorchTitan's own training entry point with ``AsymCheckManager``: killed, resumed, bit-exact (a ``gpu`` test).

``torchrun -m torchtitan.train --module tests.support.titan_config --config llama3_debugmodel_asymcheck``: the
llama3 debug model (fused QKV, selective activation checkpointing) trains on a local tokenizer and text
dataset (tests/support/titan_assets.py) with TorchTitan's deterministic mode, a version every step. The
killed job SIGKILLs itself right after ``save`` of step ``KILL`` (a test subclass of the manager injects
it), the same command then resumes from the newest verified version and trains to the end. Its last
version must equal that of an uninterrupted run bit for bit (every tensor: model, AdamW, RNG, the data
loader's position, and the meta: train state, scheduler, param groups), and the last step is exported as
Hugging Face safetensors through the llama3 state-dict adapter (``from_hf`` of it gives the version's model).
TorchTitan 0.3 needs CUDA and triton; on a CPU machine this test is skipped (tests/asymcheck/torchtitan/
test_kill.py drives the manager there with TorchTitan's own state objects).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import proc_env
from tests.support.mr_harness import free_ports
from tests.support.titan_assets import make_assets

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="TorchTitan's trainer needs CUDA")]

STEPS = 12
KILL = 7


def train(base: Path, dump: Path, tag: str, *extra: str) -> subprocess.CompletedProcess[bytes]:
    """Run TorchTitan's entry point once (one GPU) into ``dump``; its output goes to ``base/<tag>.log``."""
    tokenizer, data = base / "assets" / "tokenizer", base / "assets" / "c4"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1",
           f"--master_port={free_ports(1)[0]}", "--max_restarts=0",
           "-m", "torchtitan.train", "--module", "tests.support.titan_config", "--config",
           "llama3_debugmodel_asymcheck", "--dump_folder", str(dump), "--hf_assets_path", str(tokenizer),
           "--dataloader.dataset_path", str(data), "--training.steps", str(STEPS), "--training.seq_len", "256",
           "--training.local_batch_size", "4", "--debug.seed", "42", "--debug.deterministic",
           "--metrics.log_freq", "1", *extra]
    env = proc_env(HF_DATASETS_CACHE=str(base / "hf-cache"), HF_HUB_OFFLINE="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    with open(base / f"{tag}.log", "wb") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600, check=False)


def last_version(root: Path) -> tuple[int, dict[str, torch.Tensor], dict[str, object]]:
    from asymstore import AsymStore, LocalTier

    async def read() -> tuple[int, dict[str, torch.Tensor], dict[str, object]]:
        async with AsymStore([LocalTier(root)], keep_last=None) as store:
            ckpt = await store.restore()
            return ckpt.step, dict(ckpt.tensors), dict(ckpt.meta)

    return asyncio.run(read())


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("triton", reason="TorchTitan's models import triton")
    root = tmp_path_factory.mktemp("titan-entry")
    make_assets(root / "assets")
    ref = train(root, root / "reference", "reference")
    assert ref.returncode == 0, (root / "reference.log").read_text()[-6000:]
    killed = train(root, root / "run", "killed", "--checkpoint.kill_at", str(KILL))
    assert killed.returncode != 0, (root / "killed.log").read_text()[-6000:]
    newest, _, _ = last_version(root / "run" / "checkpoint")
    (root / "killed-newest").write_text(str(newest))
    resumed = train(root, root / "run", "resumed")
    assert resumed.returncode == 0, (root / "resumed.log").read_text()[-6000:]
    return root


def test_entry_point_killed_and_resumed_ends_bit_exact(base: Path) -> None:
    killed_at = int((base / "killed-newest").read_text())
    assert 1 <= killed_at < KILL, killed_at  # KILL's version is sealed at the next step, which never came
    resumed_log = (base / "resumed.log").read_text()
    assert "asymcheck: resumed step" in resumed_log, resumed_log[-3000:]
    step_resumed = int(resumed_log.split("asymcheck: resumed step")[1].split()[0])
    assert step_resumed == killed_at  # the newest verified version
    ref_step, ref_t, ref_meta = last_version(base / "reference" / "checkpoint")
    got_step, got_t, got_meta = last_version(base / "run" / "checkpoint")
    assert ref_step == got_step == STEPS
    assert sorted(got_t) == sorted(ref_t)
    for name, x in ref_t.items():
        y = got_t[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name
    assert json.loads(json.dumps(got_meta)) == json.loads(json.dumps(ref_meta))
    assert got_meta["stateful"]["torchtitan.train_state"]["step"] == STEPS  # type: ignore[index]


def test_entry_point_exports_the_last_step_as_hugging_face_safetensors(base: Path) -> None:
    from safetensors.torch import load_file

    out = base / "run" / "checkpoint_hf" / f"step-{STEPS}"
    hf = load_file(out / "model.safetensors")
    assert "model.embed_tokens.weight" in hf and "lm_head.weight" in hf
    assert any(k.endswith("self_attn.q_proj.weight") for k in hf)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf)
    _, tensors, _ = last_version(base / "run" / "checkpoint")
    model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    adapter = spec.state_dict_adapter(spec.model, None)
    back = adapter.from_hf(hf)
    assert set(back) <= set(model)
    for key, value in back.items():
        assert torch.equal(value, model[key].to(value.dtype)), key
    assert os.listdir(out.parent) == [f"step-{STEPS}"]
