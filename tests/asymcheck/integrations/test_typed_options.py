"""The integrations take the Checkpointer's typed option groups, one name for where the checkpoint lives, and drive it
through its public interface.

- mypy flags a misspelt option (group, field, flat keyword, literal) to every entry point: ``accelerate.attach``,
  ``hf.AsymCheckCallback``, ``lightning.AsymCheckCallback``, and accepts the typed and the deprecated forms;
- the typed form raises no DeprecationWarning anywhere (the Checkpointer gets groups only); the flat form warns
  once, at the user's line, naming the entry point and the group; a misspelt option is refused when the callback
  is made, not when training starts; a retention rule given both as an argument and in ``retention=`` is refused;
- ``location`` in every entry point; ``store_or_tiers=`` / ``root_or_store=`` warn, both or neither is a TypeError;
- ``LightningCheckpointer`` drives the Checkpointer through ``hooks=`` and ``driver`` and no integration calls a
  private method of the Checkpointer.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_type_hints

import pytest
import torch

import asymcheck.accelerate
import asymcheck.hf
import asymcheck.lightning
from asymcheck.errors import InvalidOptionError
from asymcheck.integrations.forward import RETENTION_ARGUMENTS, CallbackOptions, TrainerCallbackOptions
from asymcheck.options import CheckpointerOptions, PacingOptions, PreemptionOptions, RetentionOptions
from asymstore import KeepBest
from tests.support.mypy_snippets import assert_mypy_flags_exactly_the_marked_lines

ROOT = Path(__file__).resolve().parents[3]
QUIET = PreemptionOptions(preempt_on="none")


def _job() -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    """A stand-in accelerator of one process (the attributes attach() reads), a model and its optimizer."""
    from accelerate.utils import DistributedType, DynamoBackend

    acc = SimpleNamespace(distributed_type=DistributedType.NO, mixed_precision="no", parallelism_config=None,
                          use_stateful_dataloader=False, scaler=None, unwrap_model=lambda m: m,
                          state=SimpleNamespace(dynamo_plugin=SimpleNamespace(backend=DynamoBackend.NO),
                                                fsdp_plugin=None))
    model = torch.nn.Linear(4, 2)
    return acc, model, torch.optim.SGD(model.parameters(), lr=0.1)


# -- mypy catches a misspelt option to every integration ---------------------------------------

SNIPPET = '''
import torch

from asymcheck.accelerate import attach as accelerate_attach
from asymcheck.deepspeed import attach as deepspeed_attach
from asymcheck.hf import AsymCheckCallback as TrainerCallback
from asymcheck.lightning import AsymCheckCallback as LightningCallback
from asymcheck.options import PacingOptions, RetentionOptions


def build(acc: object, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    accelerate_attach(acc, model, opt, "ck", data={}, every=2, retention=RetentionOptions(keep_last=5))
    accelerate_attach(acc, model, opt, root_or_store="ck", max_overhead=None)
    accelerate_attach(acc, model, opt, "ck", pacnig=PacingOptions())  # LINE accelerate-group
    accelerate_attach(acc, model, opt, "ck", keep_lsat=5)  # LINE accelerate-flat
    accelerate_attach(acc, model, opt, "ck", retention=PacingOptions())  # LINE accelerate-type
    TrainerCallback("ck", keep_last=2, keep_best=1, retention=RetentionOptions(keep_every=5),
                    pacing=PacingOptions(max_overhead=None))
    TrainerCallback(root_or_store="ck", keep_every=5, max_overhead=None)
    TrainerCallback("ck", retension=RetentionOptions())  # LINE hf-group
    TrainerCallback("ck", max_overhaed=None)  # LINE hf-flat
    TrainerCallback("ck", pacing=RetentionOptions())  # LINE hf-type
    TrainerCallback("ck", when_busy="later")  # LINE hf-literal
    LightningCallback("ck", keep_last=2, keep_every=4, monitor="loss", pacing=PacingOptions(max_overhead=None))
    LightningCallback(root_or_store="ck", max_overhead=None)
    LightningCallback("ck", pacing=PacingOptions(max_overheed=None))  # LINE lightning-field
    LightningCallback("ck", keep_lsat=2)  # LINE lightning-flat
    LightningCallback("ck", preempt_on="never")  # LINE lightning-literal
    LightningCallback("ck", keep_best=None)  # LINE lightning-keep-best
    deepspeed_attach(object(), location="ck", retention=RetentionOptions())
    deepspeed_attach(object(), store_or_tiers="ck")
'''


def test_mypy_flags_a_misspelt_option_to_every_integration(tmp_path: Path) -> None:
    assert_mypy_flags_exactly_the_marked_lines(SNIPPET, tmp_path)


def test_the_callbacks_options_are_the_checkpointers_but_their_own_retention_arguments() -> None:
    every = set(get_type_hints(CheckpointerOptions))
    assert set(get_type_hints(CallbackOptions)) == every - set(RETENTION_ARGUMENTS)
    assert set(get_type_hints(TrainerCallbackOptions)) == every - {"keep_last", "keep_best"}
    for name in get_type_hints(CallbackOptions):
        assert get_type_hints(CallbackOptions)[name] == get_type_hints(CheckpointerOptions)[name], name


# -- at run time -----------------------------------------------------------------------------------


def test_the_typed_form_warns_nowhere_and_reaches_the_checkpointer(tmp_path: Path) -> None:
    acc, model, opt = _job()
    pacing = PacingOptions(max_overhead=None, save_on_close=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ckpt = asymcheck.accelerate.attach(acc, model, opt, tmp_path / "acc", data={}, every=2, pacing=pacing,
                                           retention=RetentionOptions(keep_last=5), preemption=QUIET)
        try:
            assert ckpt.checkpointer.every == 2
            assert ckpt.checkpointer.options.pacing == pacing
            assert ckpt.checkpointer.options.retention == RetentionOptions(keep_last=5)
        finally:
            ckpt.close()
        hf = asymcheck.hf.AsymCheckCallback(tmp_path / "hf", keep_last=2, pacing=pacing,
                                            retention=RetentionOptions(keep_every=5))
        lit = asymcheck.lightning.AsymCheckCallback(tmp_path / "pl", keep_last=2, keep_every=4, monitor="loss",
                                                    mode="max", save_top_k=2, pacing=pacing)
    assert hf.retention == RetentionOptions(keep_last=2, keep_every=5) and hf.options["pacing"] == pacing
    assert lit.retention == RetentionOptions(keep_last=2, keep_every=4, keep_best=KeepBest("loss", "max", 2))
    assert lit.options["pacing"] == pacing


def test_the_flat_form_warns_at_the_users_line_naming_the_entry_point_and_group(tmp_path: Path) -> None:
    acc, model, opt = _job()
    made: list[tuple[str, Any]] = [
        ("attach", lambda: asymcheck.accelerate.attach(acc, model, opt, tmp_path / "a", data={}, max_overhead=None,
                                                       preempt_on="none")),
        ("AsymCheckCallback", lambda: asymcheck.hf.AsymCheckCallback(tmp_path / "h", max_overhead=None)),
        ("AsymCheckCallback", lambda: asymcheck.lightning.AsymCheckCallback(tmp_path / "l", max_overhead=None)),
    ]
    for caller, make in made:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            obj = make()
        deprecations = [w for w in seen if issubclass(w.category, DeprecationWarning)]
        assert [Path(w.filename).name for w in deprecations] == [Path(__file__).name] * len(deprecations), \
            [(w.filename, str(w.message)) for w in deprecations]
        texts = [str(w.message) for w in deprecations]
        assert any(t.startswith(f"{caller}(max_overhead=...)") and "pacing=PacingOptions" in t for t in texts), texts
        assert not any(t.startswith("Checkpointer(") for t in texts), texts  # the Checkpointer got groups only
        if hasattr(obj, "close"):
            obj.close()
        else:
            assert obj.options["pacing"].max_overhead is None


def test_a_misspelt_or_doubled_option_is_refused_when_the_callback_is_made(tmp_path: Path) -> None:
    for cls in (asymcheck.hf.AsymCheckCallback, asymcheck.lightning.AsymCheckCallback):
        with pytest.raises(TypeError, match="keep_lsat"):
            cls(tmp_path, keep_lsat=2)  # type: ignore[call-arg]
        with pytest.raises(InvalidOptionError, match="keep_last=2 beside retention=RetentionOptions"):
            cls(tmp_path, keep_last=2, retention=RetentionOptions(keep_last=5))
        with pytest.raises(InvalidOptionError, match="max_overhead= beside pacing="):
            cls(tmp_path, pacing=PacingOptions(), max_overhead=None)  # type: ignore[call-arg]
    with pytest.raises(InvalidOptionError, match="keep_every=3 beside retention=RetentionOptions"):
        asymcheck.lightning.AsymCheckCallback(tmp_path, keep_every=3, retention=RetentionOptions(keep_every=7))
    with pytest.raises(InvalidOptionError, match=r"keep_best=.* beside retention=RetentionOptions"):
        asymcheck.hf.AsymCheckCallback(tmp_path, keep_best=KeepBest("eval_loss", "min", 1),
                                       retention=RetentionOptions(keep_best=KeepBest("eval_acc", "max", 1)))
    acc, model, opt = _job()
    with pytest.raises(TypeError, match="pacnig"):
        asymcheck.accelerate.attach(acc, model, opt, tmp_path / "a", data={}, pacnig=None)  # type: ignore[call-arg]
    assert not any(tmp_path.iterdir())  # nothing opened


def test_location_is_the_one_name_and_the_former_names_warn(tmp_path: Path) -> None:
    import asymcheck.deepspeed

    acc, model, opt = _job()
    with pytest.warns(DeprecationWarning, match=r"AsymCheckCallback\(root_or_store=\.\.\.\) is deprecated"):
        hf = asymcheck.hf.AsymCheckCallback(root_or_store=tmp_path / "h")
    with pytest.warns(DeprecationWarning, match=r"AsymCheckCallback\(root_or_store=\.\.\.\) is deprecated"):
        lit = asymcheck.lightning.AsymCheckCallback(root_or_store=tmp_path / "l")
    assert hf.location == tmp_path / "h" and lit.location == tmp_path / "l"
    with pytest.warns(DeprecationWarning, match=r"root_or_store is now AsymCheckCallback.location"):
        assert lit.root_or_store == tmp_path / "l"
    assert asymcheck.lightning.AsymCheckCallback(location=tmp_path / "k").location == tmp_path / "k"
    with pytest.warns(DeprecationWarning, match=r"attach\(root_or_store=\.\.\.\) is deprecated"):
        asymcheck.accelerate.attach(acc, model, opt, root_or_store=tmp_path / "a", data={}, preemption=QUIET).close()
    assert (tmp_path / "a").is_dir()
    with pytest.warns(DeprecationWarning, match=r"attach\(store_or_tiers=\.\.\.\) is deprecated"), \
            pytest.raises(AttributeError):  # the former name is taken before the engine is looked at
        asymcheck.deepspeed.attach(object(), store_or_tiers=tmp_path / "d")
    from asymcheck import Checkpointer

    with pytest.warns(DeprecationWarning, match=r"Checkpointer\(store_or_tiers=\.\.\.\) is deprecated"):
        Checkpointer(model, opt, store_or_tiers=tmp_path / "c", preemption=QUIET).close()
    assert (tmp_path / "c").is_dir()
    with pytest.raises(TypeError, match="both location= and its former name store_or_tiers="):
        Checkpointer(model, opt, tmp_path, store_or_tiers=tmp_path, preemption=QUIET)
    with pytest.raises(TypeError, match="missing the argument 'location'"):
        Checkpointer(model, opt, preemption=QUIET)
    Checkpointer(model, opt, location=tmp_path / "k", preemption=QUIET).close()
    assert (tmp_path / "k").is_dir()
    for make in (lambda: asymcheck.hf.AsymCheckCallback(tmp_path, root_or_store=tmp_path),
                 lambda: asymcheck.lightning.AsymCheckCallback(tmp_path, root_or_store=tmp_path),
                 lambda: asymcheck.accelerate.attach(acc, model, opt, tmp_path, root_or_store=tmp_path),
                 lambda: asymcheck.deepspeed.attach(object(), tmp_path, store_or_tiers=tmp_path)):
        with pytest.raises(TypeError, match="both location= and its former name"):
            make()
    for make in (asymcheck.hf.AsymCheckCallback, asymcheck.lightning.AsymCheckCallback,
                 lambda: asymcheck.accelerate.attach(acc, model, opt), lambda: asymcheck.deepspeed.attach(object())):
        with pytest.raises(TypeError, match="missing the argument 'location'"):
            make()


# -- the public driver interface ---------------------------------------------------------------


def test_lightning_checkpointer_drives_through_hooks_and_driver(tmp_path: Path) -> None:
    from asymcheck.lightning import LightningCheckpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ckpt = LightningCheckpointer(model, opt, tmp_path, preemption=QUIET,
                                     pacing=PacingOptions(max_overhead=None, save_on_close=False))
    forward = sum(len(m._forward_pre_hooks) for m in model.modules())
    assert (forward, len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (3, 1, 1)
    for _ in range(4):  # as Lightning runs it: the closure's forward and backward, then the callback's before_step
        model(torch.randn(2, 4)).sum().backward()
        ckpt.before_step()
        opt.step()
        opt.zero_grad()
    ckpt.close()
    assert ckpt.final_versions is not None
    assert [sorted(vs) for vs in ckpt.final_versions.values()] == [[2, 3, 4]]  # sealed by before_step, kept 3
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0 and not opt._optimizer_step_post_hooks


SOURCES = ["asymcheck/accelerate.py", "asymcheck/hf.py", "asymcheck/lightning.py",
           *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "asymcheck/integrations").glob("*.py"))),
           *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "asymcheck/deepspeed").glob("*.py")))]


@pytest.mark.parametrize("source", SOURCES)
def test_no_integration_calls_a_private_method_of_the_checkpointer(source: str) -> None:
    text = (ROOT / source).read_text()
    found = [m.group(0) for m in re.finditer(r"\b(?:self|ckpt|stale|checkpointer)\._(?:on_\w+|hooks|driver|cycle)\b",
                                             text)]
    assert not found, f"{source}: {found}"
