"""What the ``oom`` trigger costs per training step when nothing runs out of memory (issue 20, item 5).

``python -m tests.benchmarks.bench_oom_overhead`` (from the repository root, in the venv; about a minute).

A small MLP whose training step takes about 2 ms on one CPU thread (the step of a LoRA adapter or a
small fine-tune), 384 steps per fit, Adam, no logger, no progress bar. Four configurations, each fit
in turn inside every round (the order rotates from round to round, so none always runs first or
last, after the same neighbour):

* **none**: no retune callback;
* **epoch**: retune with an ``epoch`` trigger only (no search fires in one epoch: the callback's hooks);
* **+params**: ``epoch`` and ``trainable_params_changed``;
* **+oom**: those and ``oom`` (the closure runner and its per-step bookkeeping).

Each fit's time is the wall time of its 384 steps (``on_train_start`` to ``on_train_end``); each
configuration's figure is the median over the rounds, and the overhead is the median of the per-round
ratios to ``none`` (a neighbour's burst on a shared machine hits the configurations of one round alike).
Writes tests/benchmarks/results/oom_overhead.json. A missed target prints FAIL; only a crash exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from retune import ScheduledBatchSizeFinder
from tests.lightning_ns import pl

RESULTS = Path(__file__).parent / "results"
STEPS, BATCH = 384, 64
SCHEDULES: dict[str, list[dict[str, Any]] | None] = {
    "none": None,
    "epoch": [{"kind": "epoch", "at": [5]}],
    "+params": [{"kind": "epoch", "at": [5]}, {"kind": "trainable_params_changed"}],
    "+oom": [{"kind": "epoch", "at": [5]}, {"kind": "trainable_params_changed"}, {"kind": "oom"}],
}


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = BATCH
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(STEPS * BATCH, 256, generator=g), torch.randint(0, 10, (STEPS * BATCH,)))
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
        self.seconds = 0.0
        self._t0 = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_train_start(self) -> None:
        self._t0 = time.perf_counter()

    def on_train_end(self) -> None:
        self.seconds = time.perf_counter() - self._t0

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def fit(name: str) -> float:
    pl.seed_everything(0, verbose=False)
    model = MLP()
    triggers = SCHEDULES[name]
    callbacks = [] if triggers is None else [ScheduledBatchSizeFinder({"triggers": triggers}, verbose=False)]
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    return model.seconds


def measure(rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    names = list(SCHEDULES)
    fit("none")  # warm-up: imports, allocator, first-call costs
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            seconds[name].append(fit(name))
    out: dict[str, Any] = {"steps": STEPS, "rounds": rounds}
    for name in names:
        ratios = [s / n for s, n in zip(seconds[name], seconds["none"], strict=True)]
        out[name] = {
            "median_s": statistics.median(seconds[name]),
            "step_ms": statistics.median(seconds[name]) / STEPS * 1e3,
            "overhead": statistics.median(ratios) - 1,
            "seconds": seconds[name],
        }
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    results = measure(args.rounds)
    print(f"oom trigger overhead: MLP, {STEPS} steps of {BATCH}, CPU, one thread, {args.rounds} rotating rounds")
    for name in SCHEDULES:
        r = results[name]
        print(f"  {name:8s} {r['median_s']:7.3f} s  {r['step_ms']:6.3f} ms/step  {r['overhead']:+6.2%} vs none")
    verdict = "PASS" if results["+oom"]["overhead"] <= 0.01 else "FAIL"
    print(f"  target: +oom within 1% of none: {verdict}")
    results["target_oom_overhead_within_1pct"] = verdict == "PASS"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "oom_overhead.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
