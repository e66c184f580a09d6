"""Search benchmark: retune (power, binsearch, model) against Lightning's BatchSizeFinder (power, binsearch).

Every run trains on CPU inside the same simulated device (:mod:`tests.benchmarks.oracle_device`), a
``TorchDispatchMode`` with a fixed capacity that raises the real CUDA out-of-memory error, so both
libraries search the same memory curve and the true maximum batch size is known exactly.

Scenarios: an MLP, a small CNN and a small transformer encoder, each a ``backbone`` + ``head``
LightningModule trained with AdamW. Phases:

* **cold**: the search at fit start, backbone frozen by ``BackboneFinetuning``;
* **re-tune**: the search after ``BackboneFinetuning`` unfreezes the backbone at epoch 1. retune
  re-tunes inside the running fit (trigger ``trainable_params_changed``). Lightning's documented
  mid-run recipe runs zero batches once training has started (Lightning issue #21903, see
  tests/callbacks/test_unfreeze.py), so its only working option is a new fit on the unfrozen model, searched
  from ``init_val``: that is what its "re-tune" rows measure, against that state's own true maximum.

The true maximum of each search point is the largest batch size whose ``steps_per_trial`` real
training steps from that exact state do not raise an OOM on the simulated device. It is located
with retune's ``Prober`` as the harness (peaks measured with the capacity lifted, a secant search on
them), then verified with the capacity in force: the maximum fits, maximum + 1 fails, and every size
from maximum - 3 to maximum + 3 gives the expected answer.

Run: ``python -m tests.benchmarks.bench_search`` (writes tests/benchmarks/results/search.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import pytorch_lightning.tuner.batch_size_scaling as lightning_scaling
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import BackboneFinetuning, BatchSizeFinder
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import retune
from retune import ScheduledBatchSizeFinder
from retune.errors import RetuneError
from retune.probing.prober import Prober
from tests.benchmarks.oracle_device import CapacityOracle, host_memory, simulated_device, to_device

RESULTS = Path(__file__).parent / "results"
STEPS_PER_TRIAL = 3
INIT_VAL = 2
MAX_TRIALS = 25
MAX_VAL = 8192
N_SAMPLES = 8192
UNFREEZE_AT = 1
SEED = 1234
RETUNE_MODES = ("binsearch", "power", "model")  # binsearch first: its fit locates the true maxima
LIGHTNING_MODES = ("power", "binsearch")

# -- scenarios -----------------------------------------------------------------------------------


class FineTuneModule(pl.LightningModule):
    """``backbone`` + ``head`` classifier over random in-memory data, AdamW over the trainable parameters."""

    def __init__(self, backbone: nn.Module, head: nn.Module, data: TensorDataset, batch_size: int = INIT_VAL) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.data = data
        self.batch_size = batch_size
        self.steps_run = 0  # training_step calls, probes included
        self.trained_sizes: list[int] = []  # batch sizes of the real (loop) training steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.trained_sizes.append(int(batch[0].shape[0]))

    def train_dataloader(self) -> DataLoader:
        # one indexing op per batch (the dataset takes a list of indices) instead of one per sample:
        # the same batch as the default collate, without thousands of dispatched ops per batch
        sampler = HostBatchSampler(RandomSampler(self.data), batch_size=self.batch_size, drop_last=False)
        return DataLoader(self.data, sampler=sampler, batch_size=None)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # the host-to-device transfer of a GPU run: from here on the batch is charged to the device
        return to_device(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class HostTensorDataset(TensorDataset):
    """Batches are assembled in host memory, as a dataloader does on a GPU machine."""

    def __getitem__(self, index: Any) -> Any:
        with host_memory():
            return super().__getitem__(index)


class HostBatchSampler(BatchSampler):
    """Index lists drawn in host memory (the sampler's ``randperm`` is no device memory either)."""

    def __iter__(self) -> Iterator[list[int]]:
        with host_memory():
            batches = list(super().__iter__())
        yield from batches


class MeanPooledEncoder(nn.Module):
    def __init__(self, vocab: int, d_model: int, nhead: int, ff: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(tokens) + self.position).mean(dim=1)


def _mlp() -> FineTuneModule:
    g = torch.Generator().manual_seed(0)
    data = HostTensorDataset(torch.randn(N_SAMPLES, 128, generator=g), torch.randint(0, 10, (N_SAMPLES,), generator=g))
    backbone = nn.Sequential(
        nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU()
    )
    return FineTuneModule(backbone, nn.Linear(256, 10), data)


def _cnn() -> FineTuneModule:
    g = torch.Generator().manual_seed(0)
    data = HostTensorDataset(
        torch.randn(N_SAMPLES, 3, 32, 32, generator=g), torch.randint(0, 10, (N_SAMPLES,), generator=g)
    )
    # GroupNorm, not BatchNorm: BackboneFinetuning freezes with train_bn=True, which would leave
    # BatchNorm layers trainable and make the "frozen" backbone backpropagate end to end.
    backbone = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )  # fmt: skip
    return FineTuneModule(backbone, nn.Linear(8, 10), data)


def _transformer() -> FineTuneModule:
    g = torch.Generator().manual_seed(0)
    seq_len = 32
    data = HostTensorDataset(
        torch.randint(0, 1000, (N_SAMPLES, seq_len), generator=g), torch.randint(0, 10, (N_SAMPLES,), generator=g)
    )
    backbone = MeanPooledEncoder(vocab=1000, d_model=64, nhead=4, ff=128, layers=2, seq_len=seq_len)
    return FineTuneModule(backbone, nn.Linear(64, 10), data)


@dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[], FineTuneModule]
    capacity: int
    """Bytes of the simulated device. Chosen so the frozen maximum is in the high hundreds to ~2000 and
    the unfrozen one a few times smaller, and so that both boundaries have hundreds of bytes of slack
    on either side: a probe session leaves a few scalars alive (24 bytes per probe, see the README),
    and a boundary a few bytes from the capacity would move with the number of probes run before."""
    description: str


SCENARIOS = (
    Scenario("mlp", _mlp, 5_999_200, "MLP 128-256-256-256 + linear head"),
    Scenario("cnn", _cnn, 28_700_000, "CNN 3x32x32, 4 conv 3x3 x8 at 16x16 (GroupNorm) + linear head"),
    Scenario("transformer", _transformer, 43_340_000, "TransformerEncoder d=64 h=4 ff=128 x2, seq 32 + head"),
)

# -- the true maximum ----------------------------------------------------------------------------


@dataclass
class TrueMax:
    size: int
    probes: int
    verified: list[tuple[int, bool]]
    peaks: dict[int, int]
    """Oracle peak (bytes) of each size probed with the capacity lifted."""
    tracker_peaks: dict[int, int | None]
    """retune's own measured peak (CpuPeakTracker + resident bytes) of the same probes."""
    seconds: float
    consistent: bool = True
    note: str = ""
    method: str = "located"
    """``located``: secant search on peaks + scan; ``checked``: a maximum found in an identical (or, for
    Lightning's new fit, closely related) state, re-checked here: it fits and one more does not."""


def true_maximum(trainer: Any, module: FineTuneModule, oracle: CapacityOracle, upper: int) -> TrueMax:
    """The largest size whose probe steps fit, located on measured peaks and verified around the boundary."""
    started = time.perf_counter()
    before = module.batch_size
    capacity = oracle.capacity
    prober = Prober(trainer, module, "batch_size", STEPS_PER_TRIAL, budget_bytes=None)
    peaks: dict[int, int] = {}
    tracker: dict[int, int | None] = {}
    probes = 0
    live_before = oracle.live_bytes
    with prober.session():

        def peak_at(size: int) -> int:
            nonlocal probes
            if size not in peaks:
                probes += 1
                oracle.capacity = 1 << 62  # lifted: every size runs, and its exact peak is recorded
                oracle.reset_peak()
                try:
                    ok, measured = prober.measure(size)
                finally:
                    oracle.capacity = capacity
                assert ok, f"a probe at {size} failed with the capacity lifted"
                peaks[size], tracker[size] = oracle.peak, measured
            return peaks[size]

        located = _locate(peak_at, peaks, capacity, upper)
        verified: dict[int, bool] = {}

        def check(size: int) -> None:
            nonlocal probes
            probes += 1
            verified[size] = prober.fits(size)  # with the capacity in force

        lo, hi = max(1, located - 3), min(upper, located + 3)
        for candidate in range(lo, hi + 1):
            check(candidate)
        while not verified[lo] and lo > 1 and len(verified) < 30:  # boundary below the scan: extend it
            lo -= 1
            check(lo)
        while verified[hi] and hi < upper and len(verified) < 30:  # boundary above the scan
            hi += 1
            check(hi)
    module.batch_size = before
    scan = sorted(verified.items())
    answers = [ok for _, ok in scan]
    size = max((s for s, ok in scan if ok), default=0)
    consistent = answers == sorted(answers, reverse=True) and abs(size - located) <= 1
    notes = []
    if size != located:
        slack = capacity - peaks[located] if located in peaks else None
        notes.append(
            f"the scan with the capacity in force gives {size}, the lifted-capacity peaks {located} "
            f"(slack at {located}: {slack} bytes)"
        )
    leaked = oracle.live_bytes - live_before
    if abs(leaked) > 1024:  # a few scalars (a probe's logged metrics) are noise
        notes.append(f"live bytes changed by {leaked} across the harness probes")
    note = "; ".join(notes)
    return TrueMax(size, probes, scan, peaks, tracker, time.perf_counter() - started, consistent, note)


def _locate(peak_at: Callable[[int], int], peaks: dict[int, int], capacity: int, upper: int) -> int:
    """Largest size with ``peak <= capacity``: secant steps on the measured peaks (growth capped at 4x
    while nothing has failed), bisection whenever the secant stops halving the bracket."""
    for start in (min(32, upper), min(256, upper)):
        peak_at(start)
    slow = 0
    for _ in range(60):
        fitting = sorted(s for s, p in peaks.items() if p <= capacity)
        lo = max(fitting, default=0)
        hi = min((s for s, p in peaks.items() if p > capacity), default=upper + 1)
        if hi - lo <= 1:
            return lo
        if lo == 0:
            candidate = max(1, hi // 2)
        elif slow >= 2:
            candidate, slow = (lo + hi) // 2, 0
        else:
            a, b = (lo, hi) if hi <= upper else (fitting[-2], lo)
            slope = (peaks[b] - peaks[a]) / (b - a)
            candidate = a + int((capacity - peaks[a]) // slope) if slope > 0 else 4 * lo
            if hi > upper:
                candidate = min(candidate, 4 * lo)
            candidate = max(lo + 1, min(hi - 1, candidate))
        fits = peak_at(candidate) <= capacity
        width, new_width = hi - lo, (hi - candidate if fits else candidate - lo)
        slow = slow + 1 if new_width > width // 2 else 0
    raise RuntimeError("true-maximum search did not converge")


def boundary_holds(trainer: Any, module: FineTuneModule, size: int) -> bool:
    """Re-check a maximum found in an identical state elsewhere: ``size`` fits, ``size + 1`` does not."""
    before = module.batch_size
    prober = Prober(trainer, module, "batch_size", STEPS_PER_TRIAL, budget_bytes=None)
    with prober.session() as fits:
        ok = fits(size) and not fits(size + 1)
    module.batch_size = before
    return ok


class TrueMaxHarness(pl.Callback):
    """Computes (or re-checks) the true maximum at epoch 0 (cold) and at the unfreeze epoch.

    Listed after BackboneFinetuning, so it sees the epoch's unfrozen state; retune's finder moves
    itself to the end of ``trainer.callbacks``, so this runs right before retune's search.
    """

    def __init__(self, device: dict[str, CapacityOracle], known: dict[str, TrueMax]) -> None:
        self.device = device  # {"oracle": ...}, filled in once the fit has entered the simulated device
        self.known = known
        self.found: dict[str, TrueMax] = {}

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        phase = {0: "cold", UNFREEZE_AT: "retune"}.get(trainer.current_epoch)
        if phase is None:
            return
        self.found[phase] = establish(trainer, pl_module, self.device["oracle"], self.known.get(phase))


def establish(trainer: Any, module: FineTuneModule, oracle: CapacityOracle, known: TrueMax | None) -> TrueMax:
    if known is not None:
        if boundary_holds(trainer, module, known.size):
            return replace(known, probes=2, verified=[(known.size, True), (known.size + 1, False)], method="checked")
        found = true_maximum(trainer, module, oracle, MAX_VAL)
        found.note = f"differs from the maximum found in the reference state ({known.size})"
        return found
    return true_maximum(trainer, module, oracle, MAX_VAL)


# -- the runs ------------------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    phase: str
    method: str
    trials: int
    probe_steps: int
    steps_run: int
    found: int | None
    true_max: int
    seconds: float
    training_ok: bool
    note: str = ""
    trial_sizes: list[tuple[int, bool]] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return None if self.found is None else self.found / self.true_max


class MeasuredFinder(ScheduledBatchSizeFinder):
    """retune's finder, timed from outside exactly like Lightning's (wall clock around the search)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.measured: list[dict[str, Any]] = []
        self._trials: list[tuple[int, bool]] = []

    def _search(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        steps, started = pl_module.steps_run, time.perf_counter()
        self._trials = []
        try:
            super()._search(trainer, pl_module, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - started
            self.measured.append({"seconds": seconds, "steps": pl_module.steps_run - steps, "trials": self._trials})

    def _report_trial(self, size: int, fits: bool, *args: Any, **kwargs: Any) -> None:
        self._trials.append((size, fits))
        super()._report_trial(size, fits, *args, **kwargs)


class LightningTrials:
    """Counts Lightning's trials: each one is one call of ``_try_loop_run``."""

    def __init__(self) -> None:
        self.count = 0
        self.sizes: list[tuple[int, bool]] = []
        self._original = lightning_scaling._try_loop_run

    def __enter__(self) -> LightningTrials:
        def counted(trainer: Any, params: Any) -> None:
            self.count += 1
            size = int(trainer.lightning_module.batch_size)
            try:
                self._original(trainer, params)
            except BaseException:
                self.sizes.append((size, False))
                raise
            self.sizes.append((size, True))

        lightning_scaling._try_loop_run = counted
        return self

    def __exit__(self, *exc: object) -> None:
        lightning_scaling._try_loop_run = self._original


class MeasuredBatchSizeFinder(BatchSizeFinder):
    """Lightning's finder, unchanged, with a harness hook before the search and a timer around it."""

    def __init__(self, before_search: Callable[[Any, Any], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.before_search = before_search
        self.seconds = 0.0
        self.trials = 0
        self.trial_sizes: list[tuple[int, bool]] = []
        self.steps = 0

    def scale_batch_size(self, trainer: Any, pl_module: Any) -> None:
        self.before_search(trainer, pl_module)
        steps = pl_module.steps_run
        with LightningTrials() as trials:
            started = time.perf_counter()
            try:
                super().scale_batch_size(trainer, pl_module)
            finally:
                self.seconds = time.perf_counter() - started
                self.trials = trials.count
                self.trial_sizes = trials.sizes
                self.steps = pl_module.steps_run - steps


def _trainer(callbacks: list[Any], epochs: int, root: str) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )


def run_retune(scenario: Scenario, mode: str, known: dict[str, TrueMax], root: str) -> tuple[list[Row], dict[str, Any]]:
    pl.seed_everything(SEED, verbose=False)
    module = scenario.build()
    schedule = {
        "search": {
            "mode": mode,
            "init_val": INIT_VAL,
            "steps_per_trial": STEPS_PER_TRIAL,
            "max_trials": MAX_TRIALS,
            "margin": 0.0,
            "max_val": MAX_VAL,
        },
        # model mode needs a limit to predict against: the simulated device's capacity, in bytes
        "memory": {"budget": f"{scenario.capacity}B" if mode == "model" else None},
        "triggers": [{"kind": "fit_start"}, {"kind": "trainable_params_changed"}],
    }
    finder = MeasuredFinder(schedule, verbose=False)
    device: dict[str, CapacityOracle] = {}
    harness = TrueMaxHarness(device, known)
    trainer = _trainer([BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_AT), harness, finder], 2, root)
    with simulated_device(scenario.capacity, [module]) as oracle:
        device["oracle"] = oracle
        try:
            trainer.fit(module)
            ok, note = True, ""
        except torch.OutOfMemoryError as exc:
            ok, note = False, f"training step OOM after the search: {str(exc)[:160]}"
        except RetuneError as exc:
            ok, note = False, f"search failed: {exc}"
    rows = []
    for index, phase in enumerate(("cold", "retune")):
        if index >= len(finder.measured):
            continue
        measured = finder.measured[index]
        event = finder.history[index] if index < len(finder.history) else None
        trials: list[tuple[int, bool]] = measured["trials"]
        found = None if event is None else event.batch_size_after
        trained = module.trained_sizes[index] if index < len(module.trained_sizes) else None
        rows.append(
            Row(
                scenario.name,
                phase,
                f"retune-{mode}",
                len(trials),
                len(trials) * STEPS_PER_TRIAL,
                measured["steps"],
                found,
                harness.found[phase].size,
                measured["seconds"],
                trained is not None and trained == found,
                "" if trained == found else note or f"the step after the search trained {trained}",
                trials,
            )
        )
    extra = {
        "events": [e.to_dict() for e in finder.history],
        "oracle_ooms": oracle.ooms,
        "fit_ok": ok,
        "fit_note": note,
    }
    return rows, {"truth": harness.found, **extra}


def run_lightning(
    scenario: Scenario, mode: str, unfrozen: bool, known: TrueMax | None, root: str
) -> tuple[Row, TrueMax, dict[str, Any]]:
    """A fresh fit with Lightning's BatchSizeFinder: backbone frozen (cold) or unfrozen from the start."""
    pl.seed_everything(SEED, verbose=False)
    module = scenario.build()
    holder: dict[str, Any] = {}

    def before_search(trainer: Any, pl_module: Any) -> None:
        holder["truth"] = establish(trainer, pl_module, holder["oracle"], known)

    finder = MeasuredBatchSizeFinder(
        before_search,
        mode=mode,
        steps_per_trial=STEPS_PER_TRIAL,
        init_val=INIT_VAL,
        max_trials=MAX_TRIALS,
        margin=0.0,
        max_val=MAX_VAL,
    )
    callbacks: list[Any] = [finder]
    if not unfrozen:  # frozen for the whole (one-epoch) fit
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=10))
    trainer = _trainer(callbacks, 1, root)
    note = ""
    with simulated_device(scenario.capacity, [module]) as oracle:
        holder["oracle"] = oracle
        try:
            trainer.fit(module)
            ok = True
        except torch.OutOfMemoryError as exc:
            ok, note = False, f"training step OOM after the search: {str(exc)[:120]}"
    truth: TrueMax = holder["truth"]
    found = finder.optimal_batch_size
    phase = "retune" if unfrozen else "cold"
    label = f"lightning-{mode}" + (" (new fit)" if unfrozen else "")
    row = Row(
        scenario.name,
        phase,
        label,
        finder.trials,
        finder.trials * STEPS_PER_TRIAL,
        finder.steps,
        found,
        truth.size,
        finder.seconds,
        ok and bool(module.trained_sizes) and module.trained_sizes[-1] == found,  # the loop's real step is the last
        note,
        finder.trial_sizes,
    )
    return row, truth, {"oracle_ooms": oracle.ooms, "fit_ok": ok, "fit_note": note}


# -- report --------------------------------------------------------------------------------------

COLUMNS = ("scenario", "phase", "method", "trials", "probe steps", "found", "true max", "found/true", "seconds")


def _fmt_row(row: Row) -> list[str]:
    ratio = "-" if row.ratio is None else f"{row.ratio:.3f}"
    flag = "" if row.training_ok else " !"
    return [
        row.scenario,
        row.phase,
        row.method,
        str(row.trials),
        str(row.probe_steps),
        f"{row.found}{flag}",
        str(row.true_max),
        ratio,
        f"{row.seconds:.2f}",
    ]


def _table(header: tuple[str, ...], lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def medians(rows: list[Row]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.phase, row.method), []).append(row)
    out = []
    for (phase, method), members in groups.items():
        ratios = [r.ratio for r in members if r.ratio is not None]
        out.append(
            {
                "phase": phase,
                "method": method,
                "scenarios": len(members),
                "trials": statistics.median(r.trials for r in members),
                "probe_steps": statistics.median(r.probe_steps for r in members),
                "found_over_true": statistics.median(ratios) if ratios else None,
                "seconds": statistics.median(r.seconds for r in members),
            }
        )
    return out


def check_targets(rows: list[Row], meds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def median_of(phase: str, method: str) -> float:
        return next(m["trials"] for m in meds if m["phase"] == phase and m["method"] == method)

    ours = [r for r in rows if r.method.startswith("retune-")]
    exact = [r for r in ours if r.method in ("retune-binsearch", "retune-model")]
    cold_model = median_of("cold", "retune-model")
    retune_model = median_of("retune", "retune-model")
    below = [f"{r.scenario}/{r.phase}/{r.method}={r.ratio:.3f}" for r in exact if (r.ratio or 0) < 0.95]
    above = [f"{r.scenario}/{r.phase}/{r.method}: {r.found}>{r.true_max}" for r in ours if (r.found or 0) > r.true_max]
    failed = [f"{r.scenario}/{r.phase}/{r.method}" for r in ours if not r.training_ok]
    return [
        {"target": "cold search, model mode: median trials <= 5", "value": cold_model, "pass": cold_model <= 5},
        {
            "target": "re-tune after unfreeze, model mode: median trials <= 3",
            "value": retune_model,
            "pass": retune_model <= 3,
        },
        {
            "target": "found >= 0.95 x true maximum (retune binsearch and model, every row)",
            "value": below or "all rows",
            "pass": not below,
        },
        {"target": "found never above the true maximum (retune, every mode and row)", "value": above or "none",
         "pass": not above},
        {"target": "the training step at the found size ran (retune, every row)", "value": failed or "all rows",
         "pass": not failed},
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", nargs="*", default=[s.name for s in SCENARIOS], help="subset to run")
    parser.add_argument("--out", default=str(RESULTS / "search.json"))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine multi-threaded ops stall whenever another process "
        "holds a core, which makes the seconds column noise; 0 keeps torch's default)",
    )
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    _quiet()
    environment = _environment()
    started = time.perf_counter()
    rows: list[Row] = []
    details: dict[str, Any] = {}
    root = tempfile.mkdtemp(prefix="retune-bench-")
    for scenario in [s for s in SCENARIOS if s.name in args.scenarios]:
        detail: dict[str, Any] = {"description": scenario.description, "capacity_bytes": scenario.capacity}
        module = scenario.build()
        detail["params"] = sum(p.numel() for p in module.parameters())
        detail["backbone_params"] = sum(p.numel() for p in module.backbone.parameters())
        known: dict[str, TrueMax] = {}
        for mode in RETUNE_MODES:
            _progress(f"{scenario.name}: retune {mode} (cold at fit start, re-tune at the unfreeze epoch)")
            t0 = time.perf_counter()
            new_rows, extra = run_retune(scenario, mode, known, root)
            for phase, truth in extra.pop("truth").items():
                known.setdefault(phase, truth)
                detail.setdefault("true_max", {}).setdefault(phase, asdict(truth))
                if truth.note:
                    detail.setdefault("true_max_notes", []).append(f"retune-{mode}/{phase}: {truth.note}")
            detail[f"retune-{mode}"] = extra
            rows += new_rows
            for row in new_rows:
                _progress(f"  {_summary(row)}")
            _progress(f"  ({time.perf_counter() - t0:.1f}s)")
        fresh: TrueMax | None = None
        for unfrozen in (False, True):
            for mode in LIGHTNING_MODES:
                what = "new fit, backbone unfrozen" if unfrozen else "cold at fit start"
                _progress(f"{scenario.name}: lightning {mode} ({what})")
                t0 = time.perf_counter()
                # a new fit on the unfrozen model: its state differs from retune's re-tune point (no head
                # optimizer state yet, one param group), so its maximum is checked there, not assumed
                reference = (fresh or known["retune"]) if unfrozen else known["cold"]
                row, truth, extra = run_lightning(scenario, mode, unfrozen, reference, root)
                if unfrozen and fresh is None:
                    fresh = truth
                    detail.setdefault("true_max", {})["unfrozen_new_fit"] = asdict(truth)
                if truth.note:
                    detail.setdefault("true_max_notes", []).append(f"lightning-{mode}: {truth.note}")
                detail[row.method] = extra
                rows.append(row)
                _progress(f"  {_summary(row)} ({time.perf_counter() - t0:.1f}s)")
        details[scenario.name] = detail
    meds = medians(rows)
    targets = check_targets(rows, meds)
    elapsed = time.perf_counter() - started
    print()
    print(_table(COLUMNS, [_fmt_row(r) for r in rows]))
    print("(! = the training step at the found size did not run: see notes in the JSON)")
    print()
    print("Medians over scenarios")
    med_cols = ("phase", "method", "trials", "probe steps", "found/true", "seconds")
    print(
        _table(
            med_cols,
            [
                [
                    m["phase"],
                    m["method"],
                    f"{m['trials']:g}",
                    f"{m['probe_steps']:g}",
                    "-" if m["found_over_true"] is None else f"{m['found_over_true']:.3f}",
                    f"{m['seconds']:.2f}",
                ]
                for m in meds
            ],
        )
    )
    print()
    for target in targets:
        print(f"{'PASS' if target['pass'] else 'FAIL'}  {target['target']}: {target['value']}")
    print(f"\nbenchmark time {elapsed:.0f}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "search",
        "environment": environment,
        "settings": {
            "steps_per_trial": STEPS_PER_TRIAL,
            "init_val": INIT_VAL,
            "max_trials": MAX_TRIALS,
            "max_val": MAX_VAL,
            "margin": 0.0,
            "samples": N_SAMPLES,
            "unfreeze_at_epoch": UNFREEZE_AT,
            "optimizer": "AdamW",
        },
        "rows": [{**asdict(r), "found_over_true": r.ratio} for r in rows],
        "medians": meds,
        "targets": targets,
        "scenarios": details,
        "seconds": elapsed,
    }
    out.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    print(f"wrote {out}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


def _summary(row: Row) -> str:
    ratio = "-" if row.ratio is None else f"{row.ratio:.3f}"
    return (
        f"{row.phase:6} {row.method:28} trials {row.trials:2}  found {row.found}  true {row.true_max}  "
        f"({ratio})  {row.seconds:.2f}s{'' if row.training_ok else '  [training step did not run: ' + row.note + ']'}"
    )


def _progress(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def _json_default(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return str(value)


def _environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pytorch_lightning": pl.__version__,
        "retune": getattr(retune, "__version__", "0.1"),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),
        "machine": platform.machine(),
    }


def _quiet() -> None:
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


if __name__ == "__main__":
    sys.exit(main())
