"""Memory budgets and the ``model`` search mode, measured for real on CPU.

No oracle here: the CPU tracker counts the tensors a real training step allocates, so a budget
is a real limit and the true maximum is found by probing every candidate with the same tracker.
"""

from __future__ import annotations

from collections import OrderedDict, UserDict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.memory import CpuPeakTracker, measure_peak, resident_bytes, tensor_bytes
from retune.search.largest import MemoryModel, SearchPlan, SearchResult, plan_search, run_model_search
from tests.helpers.lightning_ns import pl

MiB = 2**20


def test_cpu_tracker_matches_an_analytic_count() -> None:
    # forward keeps x, x @ W (until relu returns) and relu's output; backward adds relu's grad;
    # W's grad is D x D. Both phases peak at three B x D float32 tensors plus W's grad.
    batch, dim = 4096, 256
    weight = torch.randn(dim, dim, requires_grad=True)
    with CpuPeakTracker() as tracker:
        x = torch.randn(batch, dim)
        (x @ weight).relu().sum().backward()
    analytic = 3 * batch * dim * 4 + dim * dim * 4
    assert abs(tracker.peak_bytes - analytic) <= 0.10 * analytic


def test_cpu_tracker_releases_freed_storages_and_ignores_views() -> None:
    with CpuPeakTracker() as tracker:
        a = torch.empty(1000, 1000)
        view = a[:10]
        a.add_(1)  # in place: no new storage
        b = torch.empty(1000, 1000)
        del a, view
        c = torch.empty(250, 1000)
    assert tracker.peak_bytes == 8_000_000
    assert tracker.live_bytes == 5_000_000
    del b, c


def test_resident_bytes_counts_params_buffers_and_optimizer_state_once() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.BatchNorm1d(100))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 100)).sum().backward()
    opt.step()
    params = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert resident_bytes(model, [opt]) == params + buffers + state


def test_tensor_bytes_walks_every_batch_container_lightning_moves() -> None:
    # Hugging Face's BatchEncoding is a UserDict, which torch's pytree treats as one opaque leaf
    ids = torch.zeros(4, 16, dtype=torch.long)  # 512 bytes
    mask = torch.ones(4, 16, dtype=torch.long)  # 512 bytes
    labels = torch.zeros(4, dtype=torch.long)  # 32 bytes

    @dataclass
    class Batch:
        inputs: Any
        labels: torch.Tensor
        name: str = "b"

    batch = UserDict({"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert tensor_bytes(batch) == 1056
    assert tensor_bytes(Batch(inputs=batch, labels=labels)) == 1056  # the labels' storage counts once
    assert tensor_bytes([{"x": ids[:2]}, (mask, None, 3, "text")]) == 1024  # a view counts its storage
    assert tensor_bytes(OrderedDict(a=ids)) == 512 and tensor_bytes(object()) == 0
    looped: dict[str, Any] = {"ids": ids}
    looped["self"] = looped
    assert tensor_bytes(looped) == 512


class WideMLP(pl.LightningModule):  # type: ignore[misc,name-defined]
    """A model whose step memory really grows with the batch size (wide activations, Adam state)."""

    def __init__(self, batch_size: int = 4, frozen: bool = False, n: int = 4096) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.backbone = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.head = nn.Linear(256, 10)
        if frozen:
            self.backbone.requires_grad_(False)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _fit(schedule: dict[str, Any], model: WideMLP, epochs: int = 1) -> ScheduledBatchSizeFinder:
    finder = ScheduledBatchSizeFinder(schedule, verbose=False)
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=2,
    )
    trainer.fit(model)
    return finder


def _schedule(mode: str, budget: str | None, **search: Any) -> dict[str, Any]:
    return {
        "search": {"mode": mode, "margin": 0.0, "steps_per_trial": 1, **search},
        "memory": {"budget": budget},
        "triggers": [{"kind": "fit_start"}],
    }


@pytest.mark.parametrize("mode", ["binsearch", "power", "model"])
def test_budget_is_respected(mode: str) -> None:
    pl.seed_everything(0)
    finder = _fit(_schedule(mode, "4MiB"), WideMLP())
    event = finder.history[0]
    assert event.budget_bytes == 4 * MiB and event.mode == mode
    assert len(event.peak_bytes) == len(event.trials)
    for (size, fits), peak in zip(event.trials, event.peak_bytes, strict=True):
        assert peak is not None
        assert fits == (peak <= 4 * MiB), (size, peak)
    chosen = [peak for (size, _), peak in zip(event.trials, event.peak_bytes, strict=True) if size == finder.batch_size]
    assert chosen and all(p is not None and p <= 4 * MiB for p in chosen)


def test_model_mode_lands_on_the_binsearch_maximum_in_few_trials() -> None:
    pl.seed_everything(0)
    exact = _fit(_schedule("binsearch", "4MiB"), WideMLP()).history[0]
    pl.seed_everything(0)
    model = _fit(_schedule("model", "4MiB"), WideMLP()).history[0]
    assert model.batch_size_after == exact.batch_size_after
    # small batches here peak in the optimizer step (flat), larger ones in backward: the line needs
    # a few corrections, still far fewer probes than bisection
    assert len(model.trials) <= 6
    assert len(model.trials) * 2 <= len(exact.trials)


def test_model_mode_without_a_budget_falls_back_to_binsearch_on_cpu() -> None:
    pl.seed_everything(0)
    finder = _fit(
        {"search": {"mode": "model", "max_val": 64}, "triggers": [{"kind": "fit_start"}]},
        WideMLP(),
    )
    event = finder.history[0]
    assert event.mode == "binsearch"
    assert "fell back to binsearch" in event.note
    assert event.budget_bytes is None


def test_measure_peak_reports_the_step_peak_including_resident_state() -> None:
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with measure_peak(torch.device("cpu"), model, [opt]) as reading:
        model(torch.randn(1024, 256)).sum().backward()
        opt.step()
    assert reading.source == "cpu-tracker"
    assert reading.peak_bytes is not None
    resident = sum(p.numel() * 4 for p in model.parameters())
    assert reading.peak_bytes >= resident + 2 * 1024 * 256 * 4


# -- the model-mode search on synthetic memory curves ---------------------------------------------


def _curve(fixed: float, per_sample: float, limit: int, quadratic: float = 0.0):  # type: ignore[no-untyped-def]
    def measure(size: int) -> tuple[bool, int]:
        peak = int(fixed + per_sample * size + quadratic * size * size)
        return peak <= limit, peak

    def true_max() -> int:
        return max((s for s in range(1, 9000) if measure(s)[0]), default=0)

    return measure, true_max()


@pytest.mark.parametrize(
    ("fixed", "per_sample", "quadratic"),
    [(1e6, 1000, 0.0), (5e5, 3333, 0.0), (2e6, 700, 0.0), (1e6, 1000, 0.3), (1e6, 900, 0.05), (2.5e6, 1000, 0.0)],
)
def test_model_search_never_exceeds_and_finds_the_maximum(fixed: float, per_sample: float, quadratic: float) -> None:
    limit = 3_000_000
    measure, true_max = _curve(fixed, per_sample, limit, quadratic)
    result = run_model_search(SearchPlan("model", 2, 25, 0.0, 8192), measure, limit)
    assert result.size == true_max
    assert all(fits == measure(size)[0] for size, fits in result.trials)
    if quadratic == 0.0:
        assert len(result.trials) <= 3  # two points, one verifying probe


def test_model_search_retune_reuses_the_slope_and_needs_few_trials() -> None:
    limit = 3_000_000
    cold_measure, _ = _curve(1e6, 1000, limit)
    cold = run_model_search(SearchPlan("model", 2, 25, 0.0, 8192), cold_measure, limit)
    assert cold.model == MemoryModel(pytest.approx(1e6), pytest.approx(1000))
    after_unfreeze, true_max = _curve(1.4e6, 3000, limit)
    plan = SearchPlan("model", cold.max_fitting or 1, 25, 0.0, 8192, known_fail=cold.min_failing)
    retune = run_model_search(plan, after_unfreeze, limit, prior=cold.model)
    assert retune.size == true_max
    assert len(retune.trials) <= 3


def test_model_search_handles_real_ooms_without_peaks() -> None:
    def measure(size: int) -> tuple[bool, int | None]:
        if size > 700:
            return False, None  # a real OOM: no statistic
        return True, int(1e6 + 1000 * size)

    result = run_model_search(SearchPlan("model", 2, 25, 0.0, 8192), measure, 3_000_000)
    assert result.size == 700
    assert all(fits == (size <= 700) for size, fits in result.trials)


def test_model_search_reports_nothing_fits() -> None:
    result = run_model_search(SearchPlan("model", 8, 25, 0.0, 8192), lambda s: (False, int(5e6 + s)), 3_000_000)
    assert result.size is None
    assert min(t.batch_size for t in result.trials) == 1


def test_model_retune_after_unfreeze_measures_up_the_curve_past_a_flat_peak() -> None:
    # Memory after an unfreeze: the optimizer step's peak (2 MB) is flat up to 200 samples, then the
    # activations take over at 4 kB per sample; a real OOM (no peak) above the 4 MB capacity. The
    # re-tune plan measures old max / 8 and then old max / 4: both on the growing part, so the line
    # through them is exact and its prediction is the answer. Measuring old max / 16 instead (flat)
    # would underestimate the slope and overshoot into OOMs (the benchmark's MLP took 6 trials so).
    capacity = 4_000_000

    def measure(size: int) -> tuple[bool, int | None]:
        peak = max(2_000_000, 1_200_000 + 4000 * size)
        return (True, peak) if peak <= capacity else (False, None)

    previous = SearchResult(size=2067, max_fitting=2067, min_failing=2068, trials=[])
    plan = plan_search(
        mode="model",
        init_val=2,
        max_trials=25,
        margin=0.0,
        max_val=8192,
        dataset_len=None,
        warm_start=True,
        previous=previous,
        direction="down",
    )
    result = run_model_search(plan, measure, capacity)
    assert result.size == 700
    assert [t.batch_size for t in result.trials] == [258, 516, 700]


def test_model_search_at_the_cap_keeps_the_cap_and_below_it_applies_the_margin() -> None:
    """``model`` mode: a cap reached within the limit is the size itself; a size the limit stopped is cut."""
    limit = 1_000_000
    fits_everything, _ = _curve(fixed=1000, per_sample=100, limit=limit)  # 9990 would fit; the cap is 64
    plan = SearchPlan(mode="model", start=2, max_trials=25, margin=0.05, upper=64)
    assert run_model_search(plan, fits_everything, limit).size == 64
    tight, _ = _curve(fixed=1000, per_sample=100, limit=1000 + 100 * 40)  # 40 fits, 41 does not
    result = run_model_search(plan, tight, 1000 + 100 * 40)
    assert result.max_fitting == 40 and result.size == int(40 * 0.95)
    no_margin = SearchPlan(mode="model", start=2, max_trials=25, margin=0.0, upper=64)
    assert run_model_search(no_margin, tight, 1000 + 100 * 40).size == 40
    capped_at_the_limit, _ = _curve(fixed=1000, per_sample=100, limit=1000 + 100 * 64)  # 64 fits exactly
    assert run_model_search(plan, capped_at_the_limit, 1000 + 100 * 64).size == 64


def test_the_tracker_counts_the_device_it_is_given_only() -> None:
    """A probe's tracker counts host memory (a device's allocator keeps its own statistics); a trace's counts
    the fakes on the module's device (issue 29: CUDA fakes were invisible to a host-memory tracker)."""
    from retune.memory import CpuPeakTracker

    with CpuPeakTracker() as host, CpuPeakTracker("meta") as meta:
        kept = [torch.empty(1000, device="meta"), torch.empty(10)]
    assert (host.peak_bytes, meta.peak_bytes) == (40, 4000)
    del kept


def test_the_tracker_counts_several_devices_where_given_several() -> None:
    """An update measured on meta tensors keeps its scalar state on the CPU (retune.prediction.meta_update)."""
    from retune.memory import CpuPeakTracker

    with CpuPeakTracker(("meta", "cpu")) as both:
        kept = [torch.empty(1000, device="meta"), torch.empty(10)]
    assert both.peak_bytes == 4040
    del kept


def test_a_tensor_made_from_python_data_is_counted() -> None:
    """``torch.tensor(...)`` reaches the dispatcher as ``lift_fresh`` of itself (no operator allocated it): it is
    new memory all the same (Adam's ``step`` scalars), as a fake trace counts it; a view of it is not."""
    from retune.memory import CpuPeakTracker

    with CpuPeakTracker() as tracker:
        made = [torch.tensor(0.0), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)]
        view = made[1][1:]
    assert tracker.peak_bytes == 4 + 24
    del made, view


def test_a_tensor_over_numpy_memory_is_not_counted_as_new() -> None:
    """``torch.from_numpy``/``torch.as_tensor(ndarray)`` reach the dispatcher as ``lift_fresh`` too, of an alias of
    the array's memory (not torch's to count: a table read three rows at a time would count whole); a copy of an
    array (``torch.tensor(ndarray)``) is new memory, once."""
    import numpy as np

    from retune.memory import CpuPeakTracker

    table = np.zeros((1000, 1000), dtype=np.float32)  # 4 MB made before the probe
    with CpuPeakTracker() as tracker:
        aliases = [torch.from_numpy(table[:3]), torch.as_tensor(table)]
    assert tracker.peak_bytes == 0
    with CpuPeakTracker() as tracker:
        copy = torch.tensor(table[:3])
    assert tracker.peak_bytes == 3 * 1000 * 4
    del aliases, copy


def test_a_trace_counts_numpy_memory_and_fresh_tensors_as_a_probe_does() -> None:
    """Inside a fake trace the same operators make fakes, new storages: the rule reads the input, so a trace counts
    what a probe counts (a NumPy table's alias: nothing; a tensor made from Python data: its bytes)."""
    import numpy as np
    from torch._subclasses.fake_tensor import FakeTensorMode

    from retune.memory import CpuPeakTracker

    table = np.zeros((1000, 1000), dtype=np.float32)
    with FakeTensorMode(), CpuPeakTracker() as traced:
        made = [torch.from_numpy(table), torch.tensor([1.0, 2.0])]
    assert traced.peak_bytes == 8
    del made


def test_own_need_is_the_peak_beyond_what_the_block_left_alive() -> None:
    """An update that creates state (kept) and temporaries (freed): its need once the state exists is the
    temporaries' peak alone, whatever the order; storages are told apart by when they were counted, not by
    address (a freed temporary's address is reused)."""
    from retune.memory import CpuPeakTracker

    with CpuPeakTracker() as tracker:
        tracker.log_new_storages()
        first = torch.empty(1000)  # state, 4000 bytes, kept
        temporary = torch.empty(2000)  # 8000 bytes, freed
        del temporary
        second = torch.empty(1000)  # state, kept
        need = tracker.own_need(0)
    assert need == 8000 and first.numel() == second.numel() == 1000


def test_sparse_gradients_are_counted_by_their_parts() -> None:
    """Found by review: ``nn.Embedding(sparse=True)`` makes sparse gradients, which have no storage of their own;
    the tracker asked for one and the run died with a bare ``NotImplementedError`` under any CPU budget. Their
    indices and values are counted."""
    embedding = nn.Embedding(1000, 64, sparse=True)
    ids = torch.randint(0, 1000, (32, 8), generator=torch.Generator().manual_seed(0))
    with CpuPeakTracker() as tracker:
        embedding(ids).sum().backward()
    grad = embedding.weight.grad
    assert grad is not None and grad.is_sparse
    parts = grad._indices().numel() * 8 + grad._values().numel() * 4  # int64 indices, float32 values
    assert tracker.peak_bytes >= parts
    assert tracker.peak_bytes < embedding.weight.numel() * 4  # not a dense gradient's


def test_accumulated_sparse_gradients_stay_counted() -> None:
    """Found by review: a sparse gradient accumulated in place (``grad += new``, a second backward) holds new
    indices and values in the same tensor; read after the operator, they looked like its input's and went
    uncounted while the old ones were freed: 0 live bytes against 135,168 of gradient."""
    from retune.memory import gradient_bytes

    embedding = nn.Embedding(10000, 64, sparse=True)
    ids = torch.randint(0, 10000, (256,), generator=torch.Generator().manual_seed(0))
    with CpuPeakTracker() as tracker:
        for _ in range(3):
            embedding(ids).sum().backward()
            assert tracker.live_bytes >= gradient_bytes(embedding) > 0


class SparseEmbedding(pl.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4
        self.embedding = nn.Embedding(5000, 64, sparse=True)
        self.head = nn.Linear(64, 10)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randint(0, 5000, (1024, 8), generator=g), torch.randint(0, 10, (1024,)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self.head(self.embedding(ids).mean(1)), y)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("predict", ["off", "auto"])
def test_a_model_with_sparse_gradients_is_searched_under_a_cpu_budget(predict: str) -> None:
    schedule = {"search": {"predict": predict}, "memory": {"budget": "3MiB"}, "triggers": [{"kind": "fit_start"}]}
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    pl.Trainer(
        callbacks=[finder], max_epochs=1, limit_train_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    ).fit(SparseEmbedding())  # fmt: skip
    event = finder.history[0]
    assert event.batch_size_after is not None and event.batch_size_after > 4
    assert any(fits for _, fits in event.trials) and all(p is None or p > 0 for p in event.peak_bytes)
