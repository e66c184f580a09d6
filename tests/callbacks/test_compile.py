"""A ``torch.compile``d model stays compiled in training whatever the schedule (issue 15, item 2).

Dynamo refuses to compile a frame while a user ``TorchDispatchMode`` is active and then marks that
code object skipped for the rest of the process. retune's CPU tracker is such a mode, so before the
fix a compiled module whose first call fell inside a budgeted probe trained uncompiled, silently.
The backend is ``aot_eager`` wrapped in a counter: real dynamo guards and graphs without compiling
kernels, so each test runs in a couple of seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.memory import CpuPeakTracker, measure_peak
from tests.helpers.lightning_ns import pl, seed


class CountingBackend:
    """``aot_eager`` that counts its compiles and every call of a compiled graph."""

    def __init__(self) -> None:
        self.compiles = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compiles += 1
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def _stance() -> str:
    return str(torch._dynamo.eval_frame._stance.stance)


def test_first_call_under_the_tracker_leaves_the_module_compilable_and_counts_its_memory() -> None:
    torch.manual_seed(0)
    net = _net()
    backend = CountingBackend()
    compiled = torch.compile(net, backend=backend)
    x = torch.randn(128, 64)
    with CpuPeakTracker() as tracker:
        compiled(x).sum().backward()
    assert backend.compiles == 0, "the probe runs the module's code eagerly"
    net.zero_grad(set_to_none=True)  # each measured step allocates its gradients afresh
    with CpuPeakTracker() as eager:
        net(x).sum().backward()
    assert tracker.peak_bytes == eager.peak_bytes > 128 * 256 * 4, "the whole step is counted"
    assert _stance() == "default"

    compiled(x).sum().backward()  # outside the tracker: dynamo compiles it now
    assert backend.compiles == 1 and backend.calls == 1
    assert counters["stats"]["unique_graphs"] == 1
    net.zero_grad(set_to_none=True)
    with CpuPeakTracker() as again:
        compiled(x).sum().backward()  # cached compiled code is not run under the tracker either
    assert backend.calls == 1 and again.peak_bytes == eager.peak_bytes


def test_the_tracker_restores_the_callers_stance_even_when_the_block_raises() -> None:
    with torch.compiler.set_stance("eager_on_recompile"):
        with pytest.raises(RuntimeError, match="boom"), measure_peak(torch.device("cpu"), _net(), []):
            assert _stance() == "force_eager"
            raise RuntimeError("boom")
        assert _stance() == "eager_on_recompile"
    assert _stance() == "default"


class CompiledMLP(pl.LightningModule):  # type: ignore[misc,name-defined]
    """The compiled submodule is first called by whatever runs first: a probe or a training step."""

    def __init__(self, backend: CountingBackend, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = torch.compile(_net(), backend=backend)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(4096, 64, generator=g), torch.randint(0, 10, (4096,), generator=g))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize(("mode", "budget"), [("binsearch", "1MiB"), ("model", "1MiB"), ("binsearch", None)])
def test_a_compiled_model_trains_compiled_when_its_first_call_is_a_probe(mode: str, budget: str | None) -> None:
    seed(0)
    backend = CountingBackend()
    model = CompiledMLP(backend)
    initial = [p.detach().clone() for p in model.parameters()]
    schedule = {
        "search": {"mode": mode, "steps_per_trial": 1, "max_val": 512, "margin": 0.0},
        "memory": {"budget": budget},
        "triggers": [{"kind": "fit_start"}],
    }
    finder = ScheduledBatchSizeFinder(schedule, verbose=False)
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=3,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)

    (event,) = finder.history
    assert len(event.trials) >= 3
    assert trainer.global_step == 3
    assert backend.compiles >= 1 and counters["stats"]["unique_graphs"] >= 1, "the model was compiled"
    if budget is None:
        # no tracker: the probes run the compiled graph too
        assert backend.calls > trainer.global_step
    else:
        # the probes ran eagerly under the tracker; every training step ran the compiled graph
        assert backend.calls == trainer.global_step
        assert all(peak is not None for peak in event.peak_bytes)
        assert all(fits == (peak <= 2**20) for (_, fits), peak in zip(event.trials, event.peak_bytes, strict=True))
        assert 1 < finder.batch_size < 512, "the budget, not the cap, set the size"
    assert any(not torch.equal(a, b) for a, b in zip(initial, model.parameters(), strict=True)), "it trained"


def test_a_compiled_lightning_module_trains_compiled_under_a_budget() -> None:
    # Lightning unwraps torch.compile(module) and compiles its forward and *_step methods in place (both stacks)
    seed(0)
    backend = CountingBackend()
    model = CompiledMLP(CountingBackend())
    model.net = model.net._orig_mod  # only the whole module is compiled here
    schedule = {
        "search": {"mode": "binsearch", "steps_per_trial": 1, "max_val": 512, "margin": 0.0},
        "memory": {"budget": "1MiB"},
        "triggers": [{"kind": "fit_start"}],
    }
    finder = ScheduledBatchSizeFinder(schedule, verbose=False)
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=3,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(torch.compile(model, backend=backend))
    (event,) = finder.history
    assert 1 < finder.batch_size < 512 and all(peak is not None for peak in event.peak_bytes)
    assert backend.compiles >= 1, "the module was compiled"
    assert backend.calls == trainer.global_step == 3, "the probes ran eagerly, every training step compiled"
