"""The settings each framework integration refuses, and why: data the checks use and the guides render.

Per framework a tuple of :class:`Refusal` (the setting, the reason), and the ``major.minor`` of the
framework the tests exercise (:data:`TESTED`; any other version is refused, see
:func:`asymcheck.integrations.support.untested_version`). A check names the setting as it finds it
(``fsdp_version=1``) followed by the reason: :meth:`Refusal.line`.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ACCELERATE", "HF_TRAINER", "LIGHTNING", "RAY", "TESTED", "TORCHTITAN", "Refusal", "refusal"]


class Refusal(NamedTuple):
    """One refused setting of a framework integration.

    Attributes:
        setting: the setting as users write it (``"fsdp_version"``, ``"fp16=True"``).
        why: why its state would be missed, or why it is untested.
    """

    setting: str
    why: str

    def line(self, found: str | None = None) -> str:
        """The refusal as a check reports it: ``found`` (default: the setting), then the reason in parentheses."""
        return f"{self.setting if found is None else found} ({self.why})"


TESTED: dict[str, tuple[int, int]] = {
    "accelerate": (1, 15),  # pyproject.toml: accelerate>=1.15,<1.16
    "transformers": (5, 24),  # transformers>=5.24,<5.25
    "lightning": (2, 6),  # lightning>=2.6,<2.7
    "torchtitan": (0, 3),  # torchtitan>=0.3,<0.4
    "ray": (2, 60),  # ray[train]>=2.60,<2.61
}
"""Per framework (its package name), the ``major.minor`` the tests exercise."""

ACCELERATE: tuple[Refusal, ...] = (
    Refusal("version", "only the tested major.minor of accelerate is supported"),
    Refusal("distributed_type", "one process, DDP and DeepSpeed are supported"),
    Refusal("fsdp_version", "FSDP1's flat parameters are not captured; FSDP2 is the sharded route: "
            "FullyShardedDataParallelPlugin(fsdp_version=2)"),
    Refusal("fsdp_version=2", "Accelerate 1.15 runs FSDP on GPUs only (on the CPU it ignores the plugin and prepares "
            "DDP, which is supported) and its FSDP2 route is not yet tested on a GPU; the Checkpointer's FSDP2 path "
            "is, in your own loop with fully_shard"),
    Refusal("dynamo_backend under DeepSpeed", "torch.compile of the DeepSpeed engine is untested through attach(); "
            "one process and DDP compile"),
    Refusal("TorchDynamoPlugin(use_regional_compilation=True)",
            "untested: it replaces the model's repeated blocks with compiled wrappers, which renames their "
            "parameters; compile the whole model (the default)"),
    Refusal("mixed_precision=fp8", "TransformerEngine / MS-AMP state is not captured"),
    Refusal("parallelism_config", "only data parallelism is supported"),
)
"""What :func:`asymcheck.accelerate.attach` refuses (under DeepSpeed also what the DeepSpeed adapter refuses)."""

HF_TRAINER: tuple[Refusal, ...] = (
    Refusal("version", "only the tested major.minor of transformers is supported"),
    Refusal("fsdp", "use the FSDP2 path of asymcheck.Checkpointer in your own loop"),
    Refusal("fp16=True under DDP or DeepSpeed", "untested: fp16 is tested in one process (Accelerate's GradScaler "
            "and its state in every version, skipped steps included); under DeepSpeed its own loss scaler is not "
            "captured by the callback"),
    Refusal("auto_find_batch_size=True", "the Trainer restarts its loop with another batch size"),
    Refusal("ignore_data_skip=True", "the data position would not be restored"),
    Refusal("accelerator_config.use_seedable_sampler=False",
            "the train sampler's own generator decides each epoch's order and is not in the version: the epochs "
            "after a resume would be shuffled anew"),
    Refusal("train_sampling_strategy='group_by_length'",
            "LengthGroupedSampler draws an epoch's order from the global RNG when the epoch starts; the Trainer "
            "resumes inside an epoch with other RNG states, so the rest of the epoch would come in a new order"),
    Refusal("torch_compile=True under DeepSpeed", "torch.compile of the DeepSpeed engine is untested through the "
            "callback; one process compiles (the hooks run eagerly at graph breaks)"),
    Refusal("n_gpu", "torch.nn.DataParallel"),
    Refusal("a PEFT model under DeepSpeed", "untested: a PEFT model is tested in one process and under DDP (the "
            "adapters, their optimizer state and the frozen base's fingerprint); under DeepSpeed the Trainer loads the "
            "engine's module from the resume directory"),
)
"""What :class:`asymcheck.hf.AsymCheckCallback` refuses (under DeepSpeed also what the DeepSpeed adapter refuses)."""

LIGHTNING: tuple[Refusal, ...] = (
    Refusal("version", "only the tested major.minor of lightning is supported"),
    Refusal("configure_optimizers", "no optimizer of the module's parameters (configure_optimizers returned None): "
            "Lightning steps a stand-in optimizer, and nothing is trained"),
    Refusal("precision", "32-true, 64-true, bf16-mixed and 16-mixed are supported; 16-true, bf16-true and the "
            "other plugins' precisions are untested"),
    Refusal("fit(ckpt_path=...)",
            "Lightning's restore would replace the version's state after the callback loaded it: resume from the "
            "store, or AsymCheckCallback(resume=False) on a fresh directory"),
    Refusal("strategy", "one device, DDP, ModelParallelStrategy (FSDP2) and DeepSpeedStrategy are supported"),
    Refusal("FSDPStrategy", "FSDP1: its FlatParameters are not the module's tensors the Checkpointer copies, and "
            "torch's sharded get_state_dict/set_state_dict path for FSDP1 runs collectives and copies the whole "
            "state at every version (not wired); FSDP2 is captured: strategy=ModelParallelStrategy("
            "data_parallel_size=N, tensor_parallel_size=1) with fully_shard in configure_model"),
    Refusal("DeepSpeedStrategy(stage=3)", "untested through Lightning (it builds the module under ZeRO-3's "
            "partitioned init); stages 0-2 go to asymcheck.deepspeed"),
    Refusal("DeepSpeedStrategy with precision", "32-true is tested; DeepSpeed's own fp16 loss scaler and bf16 "
            "through Lightning are not"),
    Refusal("DeepSpeedStrategy with manual optimization", "untested: Lightning steps the DeepSpeed engine itself "
            "under automatic optimization, the case tested"),
    Refusal("DeepSpeedStrategy with accumulate_grad_batches>1",
            "DeepSpeed counts the micro-batches itself, across the ends of epochs, while Lightning's global_step "
            "counts whole accumulations within each epoch: the engine's optimizer steps (the versions) and "
            "Lightning's loop state disagree (3 epochs of 7 batches with 2: 10 engine steps, global_step 9), and a "
            "fit killed after 5 steps and resumed from version 4 diverged from the uninterrupted fit in the next "
            "epoch; accumulate with accumulate_grad_batches=1 and a larger batch, or under DDP (tested)"),
    Refusal("ddp_spawn", "strategy='ddp_spawn', 'ddp_fork', 'ddp_notebook' (a DDPStrategy whose start_method is not "
            "'popen'): untested; the fit runs in processes the strategy starts and ends itself, and the callback's "
            "errors reach the launching process only as the launcher re-raises them; use strategy='ddp' "
            "(the launching script runs once per process; tested)"),
    Refusal("StatefulDataLoader",
            "torchdata's StatefulDataLoader as a train loader: Lightning loads its state and makes its iterator "
            "inside fit, before any callback hook, and torchdata's restore leaves the loader's generator one draw "
            "short (or, resumed at an epoch's end, draws the next epoch before the version's RNG states are back): "
            "every epoch after a resume would be shuffled differently from the uninterrupted fit. Return a plain "
            "DataLoader (positioned by the callback) or asymcheck.lightning.ResumableLoader(loader); raised in "
            "on_train_start, before the first training step"),
    Refusal("torch.compile(fullgraph=True) with manual optimization",
            "under fullgraph=True only the optimizer's step hooks can run, and manual optimization's versions are "
            "sealed per training_step across optimizers by hooks inside the model; compile without fullgraph"),
    Refusal("ModelParallelStrategy(tensor_parallel_size>1)",
            "tensor parallelism is untested: for FSDP2 use ModelParallelStrategy(data_parallel_size=N, "
            "tensor_parallel_size=1) and fully_shard over device_mesh['data_parallel'] in configure_model"),
)
"""What :class:`asymcheck.lightning.AsymCheckCallback` refuses when ``fit`` starts."""

RAY: tuple[Refusal, ...] = (
    Refusal("version", "only the tested major.minor of ray is supported"),
    Refusal("RAY_TRAIN_V2_ENABLED=0", "Ray Train V1 is untested (V2 is the default of ray 2.60: its "
            "get_checkpoint, report barrier and preemption notices are the ones relied on)"),
    Refusal("TorchConfig(init_method='tcp')", "the workers get no MASTER_ADDR / MASTER_PORT, and the ranks of a "
            "multi-rank root agree through the job's TCPStore found there; use the default init_method='env'"),
    Refusal("no torch.distributed process group", "several Ray Train workers without the process group a "
            "TorchTrainer sets up (a bare DataParallelTrainer): the ranks could not agree on a version"),
    Refusal("a URI root", "a multi-rank root is a directory every worker sees (a shared filesystem); Ray's "
            "storage_path may be a URI, the root of the versions may not"),
    Refusal("outside a Ray Train worker", "RayCheckpointer reads Ray Train's context (ranks, checkpoint, "
            "preemption notices): build it inside the training function"),
)
"""What :class:`asymcheck.ray.RayCheckpointer` refuses when it is built."""


TORCHTITAN: tuple[Refusal, ...] = (
    Refusal("version", "only the tested major.minor of torchtitan is supported"),
    Refusal("pipeline parallelism", "several model parts (pipeline stages) are untested: one model part, under FSDP2, "
            "tensor parallelism or one device, is what a version captures"),
    Refusal("several optimizers", "an OptimizersContainer holding more than one optimizer (param groups of several "
            "optimizer names, or several model parts) is untested: give every group to one optimizer"),
    Refusal("checkpoint.load_step", "a version is the newest that verifies (an older one is taken only when the "
            "newer ones do not verify); load another step with python -m asymstore.export or asymstore.dcp"),
    Refusal("checkpoint.initial_load_path", "a first load from TorchTitan's own checkpoint folder or Hugging Face "
            "weights is not wired: start from them with TorchTitan's CheckpointManager, or load the weights into "
            "the model before training"),
    Refusal("checkpoint.initial_load_in_hf", "see checkpoint.initial_load_path"),
    Refusal("checkpoint.create_seed_checkpoint", "a seed checkpoint is TorchTitan's CheckpointManager's job: "
            "every version here is a whole training state"),
    Refusal("checkpoint.load_only", "the hooks take a version every interval: there is no read-only mode"),
    Refusal("training.disable_cuda_graphs=False", "on NVIDIA CUDA TorchTitan captures the forward and backward as one "
            "CUDA graph and replays it without Python: the hooks that copy a version during them would not run in a "
            "replay, and copies issued while it is captured would be captured into it; run with "
            "--training.disable_cuda_graphs (off NVIDIA CUDA TorchTitan runs eagerly anyway)"),
    Refusal("checkpoint.exclude_from_loading=['optimizer']", "a version loads the model and its optimizer together "
            "(the optimizer's state is read in place with the parameters)"),
    Refusal("checkpoint.exclude_from_loading=['train_state']", "versions are numbered by the optimizer steps done, "
            "which the trainer's step must go on from: a resumed model with the trainer's step back at 0 would "
            "save steps the store already holds"),
)
"""What :class:`asymcheck.torchtitan.AsymCheckManager` refuses when the trainer builds it."""


def refusal(table: tuple[Refusal, ...], setting: str) -> Refusal:
    """The entry of ``table`` for ``setting``.

    Raises:
        KeyError: ``table`` has no such entry.
    """
    for entry in table:
        if entry.setting == setting:
            return entry
    raise KeyError(setting)
