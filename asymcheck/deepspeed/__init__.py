"""asymcheck for DeepSpeed: a CheckpointEngine over asymstore and per-iteration snapshots (ZeRO 0-3).

Per-iteration snapshots, two lines after ``deepspeed.initialize``::

    ckpt = asymcheck.deepspeed.attach(engine, "ckpt")   # hooks the engine; every rank
    start = ckpt.resume() or 0                          # collective: newest global version

``engine.save_checkpoint`` / ``load_checkpoint`` through asymstore::

    asymcheck.deepspeed.install(engine)                 # engine.checkpoint_engine = AsymCheckpointEngine
    engine.save_checkpoint("out", tag="step100")
    asymcheck.deepspeed.load_checkpoint(engine, "out")  # tag from asymstore, not the 'latest' file

Importing this package imports DeepSpeed.
"""

from asymcheck.deepspeed.attach import DeepSpeedCheckpointer, attach
from asymcheck.deepspeed.engine import AsymCheckpointEngine, install, load_checkpoint
from asymcheck.deepspeed.hooks import DeepSpeedHooks, inner_optimizer
from asymcheck.deepspeed.state import DeepSpeedState
from asymcheck.deepspeed.types import register_deepspeed_types
from asymcheck.errors import DeepSpeedExportError, NotInStoreError

__all__ = [
    "AsymCheckpointEngine",
    "DeepSpeedCheckpointer",
    "DeepSpeedExportError",
    "DeepSpeedHooks",
    "DeepSpeedState",
    "NotInStoreError",
    "attach",
    "inner_optimizer",
    "install",
    "load_checkpoint",
    "register_deepspeed_types",
]
