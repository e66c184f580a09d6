"""Throughput benchmark: the size ``search.objective: throughput`` picks, against ``largest`` and an exhaustive sweep.

Scenarios (CPU, AdamW over every parameter, real training steps):

* ``bert``: a tiny BERT from ``transformers.BertConfig`` (random weights, no download): 2 layers,
  hidden 128, 2 heads, intermediate 512, sequences of 64 tokens, sequence classification (the
  issue's example);
* ``mlp`` and ``cnn``: the models of the search benchmark (tests/benchmarks/bench_search.py).

Memory is not what this benchmark measures, so the device is emulated by a size limit: a step with
more than ``limit`` samples raises the real ``torch.OutOfMemoryError`` before it runs (the largest
size that fits is ``limit``, as on a device with that much memory). A dispatch-mode memory simulator
(the search benchmark's) would slow every operator and distort the timings measured here.

For each scenario, in one run:

1. **searches**, alternating ``largest`` and ``throughput`` (``rounds`` of each): a real ``fit`` with
   ``ScheduledBatchSizeFinder`` and trigger ``fit_start``, default search settings (``binsearch`` from
   2, 3 steps per trial, margin 0.05, tolerance 0.03). Recorded: size chosen, trials, seconds.
2. **sweep**: every size on a geometric grid from 1 to the limit (ratio 2^(1/4)) plus every size a
   search chose, each timed with retune's prober (1 warm-up step, then ``sweep_steps`` timed steps),
   in ``sweep_rounds`` rounds whose order alternates (ascending, descending), so slow phases of a
   shared machine fall on every size alike. A size's samples/s is the median over rounds.

The comparison uses the sweep's numbers only: samples/s of the size each objective chose against the
best size of the sweep, all measured side by side. Targets: throughput's choice within 5% of the
sweep's best, at most 1.5x the trials of the ``largest`` search. The quality ratio is also given
against the sweep's best among the sizes either objective may choose (up to the size ``largest``
applies, its margin included): a size above it can be the sweep's best, but no search would pick it.

Run: ``python -m tests.benchmarks.bench_throughput`` (writes tests/benchmarks/results/throughput.json). On a
CUDA machine, ``--accelerator gpu --out tests/gpu/throughput.json`` times the same steps on the GPU, each
synchronised with the device before and after (not run here: no GPU was lent to this task).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.probing.prober import Prober
from retune.search.throughput import samples_per_second

RESULTS = Path(__file__).parent / "results"
SEED = 1234


class Model(pl.LightningModule):
    """A classifier over in-memory data whose steps fail with a real OOM above ``limit`` samples."""

    def __init__(self, net: nn.Module, data: TensorDataset, limit: int, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.net = net
        self.data = data
        self.limit = limit
        self.loss = loss
        self.batch_size = 2

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (emulated device: {x.shape[0]} > {self.limit} samples)")
        return self.loss(self.net, x, y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _classify(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x), y)


def _bert_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return net(input_ids=x, labels=y).loss  # type: ignore[no-any-return]


def _bert(limit: int, n: int) -> Model:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=2000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=64,
        num_labels=2,
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 2000, (n, 64), generator=g), torch.randint(0, 2, (n,), generator=g))
    return Model(BertForSequenceClassification(config), data, limit, _bert_loss)


def _mlp(limit: int, n: int) -> Model:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 128, generator=g), torch.randint(0, 10, (n,), generator=g))
    net = nn.Sequential(
        nn.Linear(128, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )
    return Model(net, data, limit, _classify)


def _cnn(limit: int, n: int) -> Model:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )  # fmt: skip
    return Model(net, data, limit, _classify)


@dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[int, int], Model]
    limit: int
    description: str


SCENARIOS = (
    Scenario("bert", _bert, 256, "BertForSequenceClassification, 2 layers, hidden 128, 2 heads, 64 tokens"),
    Scenario("mlp", _mlp, 2067, "MLP 128-256-256-256-10 (the search benchmark's, unfrozen)"),
    Scenario("cnn", _cnn, 999, "CNN 3x32x32, 4 conv 3x3 x8, GroupNorm (the search benchmark's, unfrozen)"),
)


ACCELERATOR = "cpu"


def _trainer(callbacks: list[Any]) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator=ACCELERATOR,
        devices=1,
    )


def run_search(scenario: Scenario, objective: str, n: int) -> dict[str, Any]:
    pl.seed_everything(SEED)
    model = scenario.build(scenario.limit, n)
    schedule = {"search": {"objective": objective}, "triggers": [{"kind": "fit_start"}]}
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    _trainer([finder]).fit(model)
    (event,) = finder.history
    return {
        "size": event.batch_size_after,
        "largest": event.largest,
        "trials": len(event.trials),
        "seconds": event.duration_s,
        "timed": {t.batch_size: r for t, r in zip(event.trials, event.samples_per_s, strict=False) if r is not None},
    }


class Sweep(pl.Callback):
    """At the first epoch start, time every size in alternating rounds with retune's prober."""

    def __init__(self, sizes: list[int], steps: int, rounds: int) -> None:
        self.sizes, self.steps, self.rounds = sizes, steps, rounds
        self.rates: dict[int, list[float]] = {s: [] for s in sizes}
        self.seconds = 0.0

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        started = time.perf_counter()
        prober = Prober(trainer, pl_module, "batch_size", self.steps + 1, track_memory=False, time_steps=True)
        with prober.session():
            for round_no in range(self.rounds):
                order = self.sizes if round_no % 2 == 0 else list(reversed(self.sizes))
                for size in order:
                    ok, seconds = prober.time(size)
                    rate = samples_per_second(size, seconds) if ok else None
                    if rate is not None:
                        self.rates[size].append(rate)
        self.seconds = time.perf_counter() - started


def grid(limit: int) -> list[int]:
    sizes, k = set(), 0
    while (size := round(2 ** (k / 4))) <= limit:
        sizes.add(size)
        k += 1
    return sorted(sizes | {limit})


def run_sweep(scenario: Scenario, extra: set[int], n: int, steps: int, rounds: int) -> tuple[dict[int, float], float]:
    pl.seed_everything(SEED)
    model = scenario.build(scenario.limit, n)
    sweep = Sweep(sorted(set(grid(scenario.limit)) | extra), steps, rounds)
    _trainer([sweep]).fit(model)
    return {s: statistics.median(r) for s, r in sweep.rates.items() if r}, sweep.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", nargs="*", default=[s.name for s in SCENARIOS])
    parser.add_argument("--rounds", type=int, default=2, help="searches of each objective, alternating")
    parser.add_argument("--sweep-steps", type=int, default=3, help="timed steps per sweep trial (after 1 warm-up)")
    parser.add_argument("--sweep-rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--accelerator",
        default="cpu",
        help="cpu (default) or gpu: on a CUDA GPU every timed step is synchronised with the device",
    )
    parser.add_argument("--out", default=str(RESULTS / "throughput.json"))
    args = parser.parse_args(argv)
    global ACCELERATOR
    ACCELERATOR = args.accelerator
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    results: dict[str, Any] = {}
    rows = []
    for scenario in [s for s in SCENARIOS if s.name in args.scenarios]:
        n = scenario.limit * (args.sweep_steps + 1)  # no trial ever needs a short last batch
        searches: dict[str, list[dict[str, Any]]] = {"largest": [], "throughput": []}
        for round_no in range(args.rounds):
            for objective in ("largest", "throughput") if round_no % 2 == 0 else ("throughput", "largest"):
                result = run_search(scenario, objective, n)
                searches[objective].append(result)
                _progress(f"{scenario.name} {objective}: size {result['size']}, {result['trials']} trials, "
                          f"{result['seconds']:.1f}s")  # fmt: skip
        chosen = {s["size"] for runs in searches.values() for s in runs}
        rates, sweep_seconds = run_sweep(scenario, chosen, n, args.sweep_steps, args.sweep_rounds)
        best = max(rates, key=lambda s: rates[s])
        largest_size = searches["largest"][0]["size"]
        # what either objective may choose: sizes up to the one `largest` applies (margin included)
        allowed = {s: r for s, r in rates.items() if s <= largest_size}
        best_allowed = max(allowed, key=lambda s: allowed[s])
        picks = [s["size"] for s in searches["throughput"]]
        ratios = [rates[p] / rates[best] for p in picks]
        ratios_allowed = [rates[p] / rates[best_allowed] for p in picks]
        trials_l = statistics.median(s["trials"] for s in searches["largest"])
        trials_t = statistics.median(s["trials"] for s in searches["throughput"])
        seconds_l = statistics.median(s["seconds"] for s in searches["largest"])
        seconds_t = statistics.median(s["seconds"] for s in searches["throughput"])
        row = {
            "scenario": scenario.name,
            "limit": scenario.limit,
            "sweep_best": best,
            "sweep_best_rate": rates[best],
            "largest_size": largest_size,
            "largest_rate": rates[largest_size],
            "throughput_sizes": picks,
            "throughput_rates": [rates[p] for p in picks],
            "throughput_over_best": ratios,
            "sweep_best_allowed": best_allowed,
            "sweep_best_allowed_rate": rates[best_allowed],
            "throughput_over_best_allowed": ratios_allowed,
            "largest_over_best": rates[largest_size] / rates[best],
            "trials_largest": trials_l,
            "trials_throughput": trials_t,
            "trials_ratio": trials_t / trials_l,
            "seconds_largest": seconds_l,
            "seconds_throughput": seconds_t,
            "sweep_sizes": len(rates),
            "sweep_seconds": sweep_seconds,
        }
        rows.append(row)
        results[scenario.name] = {
            "description": scenario.description,
            "row": row,
            "sweep": {str(k): v for k, v in sorted(rates.items())},
            "searches": {k: [{**s, "timed": {str(a): b for a, b in s["timed"].items()}} for s in v]
                         for k, v in searches.items()},
        }  # fmt: skip
        _progress(
            f"{scenario.name}: sweep best {best} at {rates[best]:.0f}/s; largest {largest_size} at "
            f"{rates[largest_size]:.0f}/s ({row['largest_over_best']:.3f}); throughput {picks} at "
            f"{[round(rates[p]) for p in picks]}/s ({', '.join(f'{r:.3f}' for r in ratios)}; within the cap: best "
            f"{best_allowed}, {', '.join(f'{r:.3f}' for r in ratios_allowed)}); trials "
            f"{trials_t:g} vs {trials_l:g} ({row['trials_ratio']:.2f}x); seconds {seconds_t:.1f} vs {seconds_l:.1f}"
        )
    targets = [
        {
            "target": "throughput's choice >= 0.95 x the sweep's best samples/s (every scenario and search)",
            "value": {r["scenario"]: [round(x, 3) for x in r["throughput_over_best"]] for r in rows},
            "pass": all(x >= 0.95 for r in rows for x in r["throughput_over_best"]),
        },
        {
            "target": "the same, against the sweep's best among sizes up to the largest search's choice (what the "
            "objectives may choose: the margin excludes the sizes above)",
            "value": {r["scenario"]: [round(x, 3) for x in r["throughput_over_best_allowed"]] for r in rows},
            "pass": all(x >= 0.95 for r in rows for x in r["throughput_over_best_allowed"]),
        },
        {
            "target": "throughput search trials <= 1.5 x the largest search's (median, every scenario)",
            "value": {r["scenario"]: round(r["trials_ratio"], 2) for r in rows},
            "pass": all(r["trials_ratio"] <= 1.5 for r in rows),
        },
    ]
    print()
    header = (
        "scenario | limit | sweep best (samples/s) | largest: size, samples/s, / best | throughput: sizes, / best "
        "| trials T/L | seconds T/L"
    )
    print(header)
    for r in rows:
        print(
            f"{r['scenario']} | {r['limit']} | {r['sweep_best']} ({r['sweep_best_rate']:.0f}) | {r['largest_size']}, "
            f"{r['largest_rate']:.0f}, {r['largest_over_best']:.3f} | {r['throughput_sizes']}, "
            f"{', '.join(f'{x:.3f}' for x in r['throughput_over_best'])} | "
            f"{r['trials_throughput']:g}/{r['trials_largest']:g} | "
            f"{r['seconds_throughput']:.1f}/{r['seconds_largest']:.1f}"
        )
    for target in targets:
        print(f"{'PASS' if target['pass'] else 'FAIL'}  {target['target']}: {target['value']}")
    elapsed = time.perf_counter() - started
    print(f"\nbenchmark time {elapsed:.0f}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    environment = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pytorch_lightning": pl.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "accelerator": args.accelerator,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_at_start": os.getloadavg(),
    }
    settings = {"rounds": args.rounds, "sweep_steps": args.sweep_steps, "sweep_rounds": args.sweep_rounds}
    payload = {"benchmark": "throughput", "environment": environment, "settings": settings, "rows": rows,
               "targets": targets, "scenarios": results, "seconds": elapsed}  # fmt: skip
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _progress(message: str) -> None:
    print(f"[bench] {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
