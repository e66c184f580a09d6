"""The search comparison on a real CUDA GPU: real out-of-memory errors and real budgets.

Not part of the default test run (CI has no GPU). On a machine with a CUDA GPU:

    pip install -e ".[lightning]"         # or, keeping the machine's torch:
    pip install "pydantic>=2.6,<3" pyyaml pytorch-lightning && PYTHONPATH=. python tests/gpu/bench_gpu.py
    python tests/gpu/bench_gpu.py [--capacity-gib 2] [--out tests/gpu/results.json]

The device is capped with ``torch.cuda.set_per_process_memory_fraction`` so that the caching allocator
raises the real ``torch.OutOfMemoryError`` past ``--capacity-gib``, whatever the GPU's size. For each
scenario (MLP, small CNN, small transformer encoder, backbone + head, AdamW):

* Lightning's ``BatchSizeFinder`` (power, binsearch) at fit start, trials counted;
* retune power / binsearch (real OOM only), model (``memory.budget`` = the capacity, peaks from
  CUDA's statistics) and model with ``search.predict: auto`` (fake-tensor traces, then verifying
  probes; the rows add each verified size's prediction error), cold at fit start and re-tuned after
  ``BackboneFinetuning`` unfreezes at epoch 1;
* the true maximum at fit start, located by bisection with retune's prober and verified at max and
  max + 1.

Every run trains after its search, so a size that fit in a probe but not in training would end the
benchmark with an OOM (issue 27: no table). retune's runs therefore also have the ``oom`` trigger
(a real OOM in training is recovered and counted in the row), and any run that still dies is
recorded as ``died`` in its row: the table is always printed, each scenario's rows as soon as it
ends (``--scenarios`` picks some; the JSON is rewritten after each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import importlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.probing.prober import Prober
from tests.helpers.lightning_ns import NAMESPACE, pl

scaling = importlib.import_module(f"{NAMESPACE}.tuner.batch_size_scaling")
BackboneFinetuning = importlib.import_module(f"{NAMESPACE}.callbacks").BackboneFinetuning
BatchSizeFinder = importlib.import_module(f"{NAMESPACE}.callbacks").BatchSizeFinder

N = 65536


class Batched(TensorDataset):
    """A ``TensorDataset`` the loader indexes a batch at a time (its fetcher calls ``__getitems__``): a batch of
    50,000 samples is one indexing, not 50,000 and a stack. On the first GPU run the loader's CPU work was most
    of this benchmark's time (0.3 s a step at the MLP's sizes, where the step itself takes milliseconds)."""

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices)
        return tuple(t[index] for t in self.tensors)


def whole(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The collate function of :class:`Batched`: its ``__getitems__`` returns the batch."""
    return batch


class Task(pl.LightningModule):
    def __init__(self, backbone: nn.Module, head: nn.Module, data: Batched) -> None:
        super().__init__()
        self.backbone, self.head, self.data, self.batch_size = backbone, head, data, 2

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, collate_fn=whole)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _mlp() -> Task:
    data = Batched(torch.randn(N, 1024), torch.randint(0, 10, (N,)))
    backbone = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU())
    return Task(backbone, nn.Linear(4096, 10), data)


def _cnn() -> Task:
    data = Batched(torch.randn(N, 3, 64, 64), torch.randint(0, 10, (N,)))
    backbone = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )  # fmt: skip
    return Task(backbone, nn.Linear(64, 10), data)


def _transformer() -> Task:
    data = Batched(torch.randint(0, 1000, (N, 128)), torch.randint(0, 10, (N,)))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1000, 256)
            layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.encoder(self.embed(tokens)).mean(dim=1)

    return Task(Encoder(), nn.Linear(256, 10), data)


SCENARIOS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


def _fit(callbacks: list[Any], epochs: int, module: Task) -> str:
    """Fit; ``""``, or how the run died (a real OOM in training after a search is a result, not a crash)."""
    try:
        _trainer(callbacks, epochs).fit(module)
    except torch.OutOfMemoryError as exc:
        return f"OOM: {str(exc).splitlines()[0][:80]}"
    finally:
        torch.cuda.empty_cache()
    return ""


def _trainer(callbacks: list[Any], epochs: int) -> Any:
    return pl.Trainer(
        accelerator="cuda", devices=1, max_epochs=epochs, limit_train_batches=2, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


class TrueMax(pl.Callback):
    """At the first epoch start (backbone frozen), bisect real probes for the largest size that fits."""

    def __init__(self) -> None:
        self.value = 0
        self.verified = False

    def on_train_epoch_start(self, trainer: Any, module: Task) -> None:
        if trainer.current_epoch:
            return
        prober = Prober(trainer, module, "batch_size", 3)
        with prober.session():
            lo, hi = 1, 2
            while hi <= N and prober.fits(hi):
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if prober.fits(mid) else (lo, mid)
            self.verified = prober.fits(lo) and not prober.fits(lo + 1)  # in the table, not an assert
        self.value = lo
        module.batch_size = 2


def run(name: str, capacity: int, emit: Any) -> None:
    """Each row to ``emit`` as soon as its run ends (a slow or stuck run still leaves the rows before it)."""
    started_at = time.perf_counter()

    def stage(what: str) -> None:
        print(f"[{time.perf_counter() - started_at:7.1f}s] {name}: {what}", flush=True)

    stage("true maximum")
    pl.seed_everything(0)
    module, true_max = SCENARIOS[name](), TrueMax()
    _fit([BackboneFinetuning(unfreeze_backbone_at_epoch=10), true_max], 1, module)
    for mode in ("power", "binsearch"):
        stage(f"lightning-{mode}")
        pl.seed_everything(0)
        module, count = SCENARIOS[name](), [0]
        original = scaling._try_loop_run

        def counted(*args: Any, count: list[int] = count, original: Any = original, **kwargs: Any) -> None:
            count[0] += 1
            original(*args, **kwargs)

        scaling._try_loop_run = counted
        finder = BatchSizeFinder(mode=mode, margin=0.0)
        started = time.perf_counter()
        try:
            died = _fit([BackboneFinetuning(unfreeze_backbone_at_epoch=10), finder], 1, module)
        finally:
            scaling._try_loop_run = original
        emit({"scenario": name, "phase": "cold", "method": f"lightning-{mode}", "trials": count[0],
                     "found": finder.optimal_batch_size, "true_max": true_max.value, "verified": true_max.verified,
                     "seconds": time.perf_counter() - started, "died": died, "recovered": 0})  # fmt: skip
    for method in ("power", "binsearch", "model", "model+predict"):
        stage(f"retune-{method}")
        pl.seed_everything(0)
        module = SCENARIOS[name]()
        mode, _, predict = method.partition("+")
        schedule = {
            "search": {"mode": mode, "margin": 0.0, "max_val": N, "predict": "auto" if predict else "off"},
            "memory": {"budget": f"{capacity}B" if mode == "model" else None},
            # `oom`: a step that still runs out of memory after a search is recovered, and counted below
            "triggers": [{"kind": "fit_start"}, {"kind": "trainable_params_changed"}, {"kind": "oom"}],
        }
        finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
        died = _fit([BackboneFinetuning(unfreeze_backbone_at_epoch=1), finder], 2, module)
        searches = [e for e in finder.history if not e.is_recovery]
        recovered = sum(1 for e in finder.history if e.is_recovery)
        for event, phase in zip(searches, ("cold", "retune"), strict=False):
            emit({"scenario": name, "phase": phase, "method": f"retune-{method}", "trials": len(event.trials),
                         "found": event.batch_size_after, "true_max": true_max.value if phase == "cold" else None,
                         "verified": true_max.verified, "seconds": event.duration_s, "peaks": event.peak_bytes,
                         "died": died, "recovered": recovered, "prediction": event.prediction,
                         "prediction_errors": event.prediction_errors, "note": event.note})  # fmt: skip
        if not searches:
            emit({"scenario": name, "phase": "cold", "method": f"retune-{method}", "trials": 0, "found": None,
                         "true_max": None, "verified": False, "seconds": 0.0, "died": died,
                         "recovered": recovered})  # fmt: skip


def line(row: dict[str, Any]) -> str:
    """One table row (the JSON has every field)."""
    ratio = "" if not row["true_max"] or not row["found"] else f"{row['found'] / row['true_max']:.3f}"
    outcome = row["died"] or (f"recovered {row['recovered']}" if row["recovered"] else "trained")
    head = f"{row['scenario']:12} {row['phase']:7} {row['method']:20} trials {row['trials']:3}"
    errors = [f"{e:+.3f}" for e in row.get("prediction_errors") or [] if e is not None]
    predicted = f"  {row['prediction']} {' '.join(errors)}" if row.get("prediction") else ""
    found = f"found {row['found']!s:6} true {row['true_max']!s:6} {ratio:6} {row['seconds']:6.2f}s"
    return f"{head} {found}  {outcome}{predicted}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity-gib", type=float, default=2.0)
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=Path("tests/gpu/results.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine")
    total = torch.cuda.get_device_properties(0).total_memory
    capacity = int(args.capacity_gib * 2**30)
    torch.cuda.set_per_process_memory_fraction(min(1.0, capacity / total))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        print(line(row), flush=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "capacity": capacity, "rows": rows}))

    for name in args.scenarios:
        run(name, capacity, emit)
    print(f"wrote {args.out}")
    retune_died = [row for row in rows if row["method"].startswith("retune") and row["died"]]
    return 1 if retune_died else 0  # Lightning's own runs may die: that is what the table shows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
