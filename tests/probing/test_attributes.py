"""A search leaves nothing in a module's own attributes: Lightning 2.x's way to gather a step's outputs for an
epoch-end hook (a list on the module) holds the run's steps only, and a counter the step rebinds
(``self.steps_seen += 1``) counts the run's steps only.

Before, every probe step appended its loss there too (the epoch's mean included the probes' losses), and a
fake-tensor trace appended a fake tensor: the epoch-end ``torch.stack`` raised "Mixing fake modes".
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.probing.attributes import ModuleAttributes, attributes_kept
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.varlen import trainer as quiet_trainer


class _Gathers(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Gathers each step's loss in ``training_step_outputs`` and, at each epoch's end, their values."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(1024, 32, generator=g), torch.randint(0, 10, (1024,), generator=g))
        self.training_step_outputs: list[torch.Tensor] = []
        self.seen: dict[int, int] = {}  # batch_idx -> batch size, per real step
        self.epochs: list[list[float]] = []
        self.steps_seen = 0  # a plain counter, rebound each step: a warm-up by step count reads it

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.steps_seen += 1
        loss = min(1.0, self.steps_seen / 10) * F.cross_entropy(self.net(x), y)
        self.training_step_outputs.append(loss.detach())
        self.seen[batch_idx] = int(x.shape[0])
        self.last_loss = loss.detach()
        return loss

    def on_train_epoch_end(self) -> None:
        stacked = torch.stack(self.training_step_outputs)  # a fake tensor among them raised here
        self.epochs.append([float(v) for v in stacked])
        self.training_step_outputs.clear()

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _run(predict: str | None, batch_size: int = 4) -> tuple[_Gathers, ScheduledBatchSizeFinder | None]:
    seed(0)
    model = _Gathers(batch_size)
    finder = None
    if predict is not None:
        schedule = {
            # the cap fits: both searches apply it, so a run without them at that size trains the same batches
            "search": {"mode": "binsearch", "steps_per_trial": 2, "predict": predict, "max_val": 64},
            "memory": {"budget": "64MiB"},
            "triggers": [{"kind": "fit_start"}, {"kind": "epoch", "at": [1]}],
        }
        finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    quiet_trainer([] if finder is None else [finder], 2, limit_train_batches=3).fit(model)
    return model, finder


@pytest.mark.parametrize("predict", ["off", "auto"])
def test_the_outputs_a_step_gathers_on_the_module_are_the_runs_alone(predict: str) -> None:
    searched, finder = _run(predict, batch_size=64)  # it starts at the size the searches find: nothing reloads
    assert finder is not None and len(finder.history) == 2
    sizes = {e.batch_size_after for e in finder.history}
    assert sizes == {64}, sizes
    assert sum(len(e.trials) for e in finder.history) >= 2  # real probe steps ran (and gathered nothing)
    if predict == "auto":
        assert [e.prediction for e in finder.history] == ["predicted", "predicted"]
    plain, _ = _run(None, batch_size=sizes.pop())
    assert searched.epochs == plain.epochs and [len(e) for e in searched.epochs] == [3, 3]
    assert searched.seen == plain.seen
    assert torch.equal(searched.last_loss, plain.last_loss)
    # a rebound attribute is put back too: the probes' steps counted 16 where the run's 6 were (a search whose
    # size did not change then ended 0.08 away in the weights of a step-count warm-up)
    assert searched.steps_seen == plain.steps_seen == 6


def test_module_attributes_are_put_back_in_place() -> None:
    """Contents of public containers in place (the same objects), attributes a step made removed, rebound ones
    named again; private attributes and ``hparams`` left as they are."""
    module = nn.Sequential(nn.Linear(2, 2))
    outputs: list[int] = [1]
    cache: dict[str, int] = {"a": 1}
    module[0].outputs, module.cache, module._private = outputs, cache, []  # type: ignore[assignment]
    with attributes_kept(module):
        module[0].outputs.append(2)
        module.cache["b"] = 2
        module.cache = {}  # rebound
        module.made = 1
        module._private.append(3)
    assert module[0].outputs is outputs and outputs == [1]
    assert module.cache is cache and cache == {"a": 1}
    assert not hasattr(module, "made") and module._private == [3]
    kept = ModuleAttributes.capture(module)  # containers only: a rebinding stays
    module.cache = {"c": 3}
    kept.restore()
    assert module.cache == {"c": 3} and cache == {"a": 1}


class _Refuses(dict):  # type: ignore[type-arg]
    """A dict subclass that refuses changes, as Hugging Face's ``ModelOutput`` refuses ``update``."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("You cannot use update on this instance")


def test_containers_of_other_types_are_left_alone_and_a_restore_never_raises() -> None:
    """Only plain lists, dicts, sets (and ``OrderedDict``, ``defaultdict``) are put back, and only where they
    changed: a ``ModelOutput`` kept on the module (a dict subclass that refuses ``update``) broke every search,
    emptied by the restore that then raised."""
    module = nn.Linear(2, 2)
    module.last_output = _Refuses(logits=1)  # type: ignore[assignment]
    module.outputs = [1]  # type: ignore[assignment]
    kept = ModuleAttributes.capture(module)
    module.last_output["extra"] = 2  # type: ignore[index]
    module.outputs.append(2)  # type: ignore[union-attr]
    kept.restore()
    assert dict(module.last_output) == {"logits": 1, "extra": 2}  # not a plain dict: as the step left it
    assert module.outputs == [1]
    unchanged = ModuleAttributes.capture(module)
    unchanged.restore()  # nothing changed: nothing touched
    assert module.outputs == [1]
