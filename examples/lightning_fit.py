"""Lightning: a version every optimizer step of ``Trainer.fit`` through one callback, and a resume.

A fit stops after 12 steps (as a crash would, but cleanly); a new Trainer with the callback on the
same directory resumes at step 12 and fits to 24; the result is bit-identical to one fit of 24 steps.
"""

import atexit
import shutil
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch

from asymcheck.lightning import AsymCheckCallback, ResumableLoader


# --8<-- [start:module]
class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(80, 16, generator=torch.Generator().manual_seed(0)),
                                              torch.randn(80, 1, generator=torch.Generator().manual_seed(1)))
        # ResumableLoader: a resume goes on after the batches already trained, without reading them
        return ResumableLoader(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
# --8<-- [end:module]


quiet: dict[str, Any] = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                         "enable_progress_bar": False, "enable_model_summary": False}


def fit(root: str, steps: int) -> Regression:
    """Fit ``steps`` steps from the seed, with the callback on ``root``."""
    pl.seed_everything(0, verbose=False)
    model = Regression()
    pl.Trainer(max_steps=steps, callbacks=[AsymCheckCallback(root, monitor="train_loss")], **quiet).fit(model)
    return model


root, whole_root = tempfile.mkdtemp(), tempfile.mkdtemp()
atexit.register(shutil.rmtree, root, ignore_errors=True)
atexit.register(shutil.rmtree, whole_root, ignore_errors=True)
fit(root, 12)  # a fit that stops after 12 steps: its last version is step 12

pl.seed_everything(0, verbose=False)
model = Regression()
# --8<-- [start:fit]
ckpt = AsymCheckCallback(root, monitor="train_loss")  # a version every step; keep_last=3, and the best train_loss
trainer = pl.Trainer(max_steps=24, callbacks=[ckpt], **quiet)
trainer.fit(model)  # resumes from the newest verified version in root (here step 12), fits to 24
# --8<-- [end:fit]
assert ckpt.restored is not None
print(f"resumed at step {ckpt.restored.step} from {ckpt.restored.tier}")

whole = fit(whole_root, 24)  # one uninterrupted fit of 24 steps
same = all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), whole.state_dict().values(), strict=True))
print("bit-identical to an uninterrupted fit:", same)
assert same
