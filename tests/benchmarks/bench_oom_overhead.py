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

A second part times retune's own work inside a ``+oom`` fit, per step (``instrumented``): the
closure runner's code around Lightning's forward/zero_grad/backward (including the note of the
gradients' versions before backward) and the closure factory's around Lightning's. On a machine shared with other jobs
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


def instrumented(steps_skipped: int = 8) -> dict[str, float]:
    """retune's own time per step, timed from inside: the closure runner's work around Lightning's forward,
    zero_grad and backward, the closure factory's around Lightning's, and the post-accumulate-grad hooks.

    Wall-clock ratios on a shared machine move by several percent between identical runs; these are the
    few microseconds they hide, summed over the MLP fit's steps (medians per step).
    """
    import retune.train_steps as glue
    from retune.recovery import TrainStepRecovery

    clock = time.perf_counter_ns
    own_run: list[int] = []
    own_factory: list[int] = []
    inner = [0]

    def timed(fn: Any) -> Any:
        if fn is None:
            return None

        def call(*args: Any) -> Any:
            t = clock()
            try:
                return fn(*args)
            finally:
                inner[0] += clock() - t

        return call

    original_run = TrainStepRecovery.run

    def run(self: Any, step: Any) -> Any:
        saved = step.forward, step.zero_grad, step.backward
        step.forward, step.zero_grad, step.backward = (timed(fn) for fn in saved)
        inner[0] = 0
        t = clock()
        result = original_run(self, step)
        own_run.append(clock() - t - inner[0])
        step.forward, step.zero_grad, step.backward = saved
        return result

    original_install = glue.install_closure_runner

    def install(trainer: Any, body: Any) -> Any:
        loop = glue.compat._automatic_loop(trainer)
        lightning = loop._make_closure
        spent = [0]

        def lightning_factory(*args: Any) -> Any:
            t = clock()
            try:
                return lightning(*args)
            finally:
                spent[0] = clock() - t

        loop._make_closure = lightning_factory
        undo = original_install(trainer, body)
        ours = loop._make_closure

        def factory(*args: Any) -> Any:
            t = clock()
            closure = ours(*args)
            own_factory.append(clock() - t - spent[0])
            return closure

        loop._make_closure = factory
        return undo

    TrainStepRecovery.run = run  # type: ignore[method-assign]
    glue.install_closure_runner = install
    import retune.callback as callback_module

    callback_module.install_closure_runner = install
    try:
        fit("+oom")
    finally:
        TrainStepRecovery.run = original_run  # type: ignore[method-assign]
        glue.install_closure_runner = callback_module.install_closure_runner = original_install
    return {
        "closure_runner_us": statistics.median(own_run[steps_skipped:]) / 1e3,
        "closure_factory_us": statistics.median(own_factory[steps_skipped:]) / 1e3,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    results = measure(args.rounds)
    own = instrumented()
    results["instrumented"] = own
    print(f"oom trigger overhead: MLP, {STEPS} steps of {BATCH}, CPU, one thread, {args.rounds} rotating rounds")
    print("  config    CPU ms/step  vs none   | wall ms/step  vs none")
    for name in SCHEDULES:
        r = results[name]
        print(
            f"  {name:8s} {r['step_ms']:9.3f}    {r['overhead']:+6.2%}   | {r['wall_step_ms']:9.3f}    "
            f"{r['wall_overhead']:+6.2%}"
        )
    total = sum(own.values())
    share = total / (results["none"]["step_ms"] * 1e3)
    results["retune_us_per_step"] = total
    print(
        f"  retune's own work per step, timed inside the +oom fit: closure runner {own['closure_runner_us']:.1f} us, "
        f"closure factory {own['closure_factory_us']:.1f} us: {total:.1f} us = {share:.2%} of the step without retune"
    )
    verdict = "PASS" if results["+oom"]["overhead"] <= 0.01 else "FAIL"
    print(f"  target: +oom within 1% of none: {verdict}")
    results["target_oom_overhead_within_1pct"] = verdict == "PASS"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "oom_overhead.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
