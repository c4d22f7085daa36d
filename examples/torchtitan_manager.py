"""TorchTitan: ``asymcheck.torchtitan.AsymCheckManager`` chosen in TorchTitan's job config, a version every step.

The config registry function at the top is what a TorchTitan job uses (``--module mypkg.configs --config
llama3_debugmodel_asymcheck``); TorchTitan's llama3 models need CUDA and triton, so the rest of this example
builds the manager the way TorchTitan's trainer builds it, with TorchTitan's own optimizer and LR-scheduler
containers on the CPU, trains 4 steps in the trainer's order, resumes a fresh job from the newest version
(bit-identical) and exports that version as Hugging Face safetensors. Writes ``./outputs``
(``check_snippets.py`` runs it in a temporary directory).
"""

import logging
from typing import Any

import torch
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from asymcheck.torchtitan import AsymCheckManager, export_hf

logging.getLogger().setLevel(logging.ERROR)  # TorchTitan's config warns about fields it does not use here


# --8<-- [start:config]
def llama3_debugmodel_asymcheck() -> Any:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.checkpoint = AsymCheckManager.Config(enable=True, interval=1, folder="checkpoint")  # every step
    config.training.disable_cuda_graphs = True  # the snapshot hooks run in the forward and backward
    return config
# --8<-- [end:config]


class TrainState:
    """What TorchTitan's trainer hands the manager as ``train_state`` (its own ``state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def job(config: AsymCheckManager.Config) -> tuple[torch.nn.Module, TrainState, Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=4)
    state = TrainState()
    # what TorchTitan's Trainer.__init__ does with config.checkpoint
    manager = config.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
                           states={"train_state": state}, sd_adapter=None, base_folder="outputs")
    return model, state, optimizers, lr_schedulers, manager


config = AsymCheckManager.Config(enable=True, interval=1, folder="checkpoint")
model, state, optimizers, lr_schedulers, manager = job(config)
manager.load()  # a fresh start: False
while state.step < 4:  # Trainer.train's order
    state.step += 1
    optimizers.zero_grad()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(state.step))
    model(x).square().mean().backward()
    manager.maybe_wait_for_staging()
    optimizers.step()
    lr_schedulers.step()
    manager.save(state.step, last_step=state.step == 4)
manager.close()  # commits the last step

model2, state2, _, lr2, manager2 = job(config)
assert manager2.load() and state2.step == 4 and lr2.state_dict() == {"last_epoch": 4}
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True))
manager2.close()

# --8<-- [start:export]
summary = export_hf("outputs/checkpoint", "outputs/hf/step-4", dtype="bfloat16")  # sd_adapter=: HF names
# --8<-- [end:export]
assert summary["step"] == 4 and summary["tensors"] == 4
print("resumed step", state2.step, "exported", summary["out"])
