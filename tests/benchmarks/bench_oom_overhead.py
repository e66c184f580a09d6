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

A second part times retune's own Python per step (``own_work``): the closure runner around stand-ins
for Lightning's forward, zero_grad and backward, minus the stand-ins, best of five loops. The closure
factory adds four attribute writes per step on top. On a machine shared with other jobs
the ratios above move by a few percent between identical fits; these microseconds do not.

Each fit's time is the CPU time of the process over its 384 steps (``on_train_start`` to
``on_train_end``, ``time.process_time``; one torch thread, data loading in the process), which a shared
machine's other processes disturb far less than wall time (they take cores away, not CPU seconds);
wall time is reported too. Each configuration's figure is the median over the rounds, and the overhead
is the median of the per-round ratios to ``none`` (a neighbour's burst hits the fits of one round alike).
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
from tests.helpers.lightning_ns import pl

RESULTS = Path(__file__).parent / "results"
STEPS, BATCH = 384, 64
SCHEDULES: dict[str, list[dict[str, Any]] | None] = {
    "none": None,
    "epoch": [{"kind": "epoch", "at": [5]}],
    "+params": [{"kind": "epoch", "at": [5]}, {"kind": "trainable_params_changed"}],
    "+oom": [{"kind": "epoch", "at": [5]}, {"kind": "trainable_params_changed"}, {"kind": "oom"}],
}


class MLP(pl.LightningModule):
    def __init__(self, trivial: bool = False) -> None:
        super().__init__()
        self.batch_size = 2 if trivial else BATCH
        width = 4 if trivial else 256
        g = torch.Generator().manual_seed(0)
        n = STEPS * self.batch_size
        self.data = TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, 10, (n,)))
        if trivial:  # the same six parameters (hooked alike), next to no arithmetic: the per-step overheads alone
            self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 10))
        else:
            self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
        self.seconds = self.cpu_seconds = 0.0
        self._t0 = self._c0 = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_train_start(self) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_train_end(self) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._c0

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def fit(name: str, trivial: bool = False) -> tuple[float, float]:
    pl.seed_everything(0, verbose=False)
    model = MLP(trivial)
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
    return model.cpu_seconds, model.seconds


def measure(rounds: int, trivial: bool = False) -> dict[str, Any]:
    torch.set_num_threads(1)
    names = list(SCHEDULES)
    fit("none", trivial)  # warm-up: imports, allocator, first-call costs
    cpu: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            c, w = fit(name, trivial)
            cpu[name].append(c)
            wall[name].append(w)
    out: dict[str, Any] = {"steps": STEPS, "rounds": rounds}
    for name in names:
        ratios = [s / n for s, n in zip(cpu[name], cpu["none"], strict=True)]
        wall_ratios = [s / n for s, n in zip(wall[name], wall["none"], strict=True)]
        out[name] = {
            "median_cpu_s": statistics.median(cpu[name]),
            "step_ms": statistics.median(cpu[name]) / STEPS * 1e3,
            "overhead": statistics.median(ratios) - 1,
            "wall_step_ms": statistics.median(wall[name]) / STEPS * 1e3,
            "wall_overhead": statistics.median(wall_ratios) - 1,
            "cpu_seconds": cpu[name],
            "wall_seconds": wall[name],
        }
    return out


def own_work(calls: int = 100_000) -> dict[str, float]:
    """retune's own Python work per step, without the model: ``TrainStepRecovery.run`` around stand-ins for
    Lightning's forward, zero_grad and backward (six parameters, like the MLP), minus the stand-ins alone;
    best of five loops of ``calls`` steps.

    Timing it inside a real fit does not isolate it: tensors of the previous step are freed when retune
    drops its references, and a profiler charges their deallocation to retune's frames.
    """
    from retune.recovery.train_step import TrainStepRecovery
    from retune.step_parts import StepParts

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 10))
    recovery = TrainStepRecovery(lambda: list(net.parameters()), module=net)
    recovery.check_batch = lambda batch: None  # type: ignore[method-assign]
    loss = torch.tensor(1.0)
    result = type("Result", (), {"closure_loss": loss})()

    def nothing(*args: Any) -> None:
        return None

    parts = StepParts(
        None,
        lambda batch: result,
        nothing,
        nothing,
        loss_of=lambda r: r.closure_loss,
        with_loss=lambda r, new_loss: r,
        journal_logs=lambda: (nothing, nothing),
    )

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter_ns() - t) / calls / 1e3)
        return min(times)

    bare = best(lambda: (parts.forward(None), parts.zero_grad(), parts.backward(loss)))
    with_retune = best(lambda: recovery.run(parts))
    return {"stand_ins_us": bare, "run_us": with_retune, "retune_own_us": with_retune - bare}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    results = measure(args.rounds)
    own = own_work()
    results["own_work"] = own
    print(f"oom trigger overhead: MLP, {STEPS} steps of {BATCH}, CPU, one thread, {args.rounds} rotating rounds")
    print("  config    CPU ms/step  vs none   | wall ms/step  vs none")
    for name in SCHEDULES:
        r = results[name]
        print(
            f"  {name:8s} {r['step_ms']:9.3f}    {r['overhead']:+6.2%}   | {r['wall_step_ms']:9.3f}    "
            f"{r['wall_overhead']:+6.2%}"
        )
    share = own["retune_own_us"] / (results["none"]["step_ms"] * 1e3)
    print(
        f"  retune's own Python per step (closure runner around stand-ins, best of 5): {own['retune_own_us']:.2f} us "
        f"= {share:.3%} of the step without retune above"
    )
    verdict = "PASS" if results["+oom"]["overhead"] <= 0.01 else "FAIL"
    print(f"  target: +oom within 1% of none: {verdict}")
    results["target_oom_overhead_within_1pct"] = verdict == "PASS"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "oom_overhead.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
