"""What the ``oom`` trigger costs: a recovered step against a normal one, and steps that never run out of memory.

``python -m tests.benchmarks.bench_recovery`` (from the repository root, in the venv; about a minute).

Measured in one run, on one model (a 4-layer transformer encoder, 32 sequences of 96 tokens, AdamW,
one torch thread), medians over the timed steps:

* **normal**: a training step without retune;
* **guarded**: the same step with the ``oom`` trigger installed and no OOM (the per-step overhead:
  the closure runner; ``bench_oom_overhead.py`` measures it on a 2 ms step);
* **recovered**: a step whose forward runs out of memory at its very end (the worst case for
  forward: a whole forward wasted), then trains as 2 micro-batches;
* **recovered in backward**: the OOM is raised at the end of backward (a forward and a whole
  backward wasted), then the rest trains in 2 micro-batches;
* **kept split**: a later step of the same epoch, split into 2 micro-batches up front.

The second part times DDP (2 gloo processes on this CPU) with and without the ``oom`` trigger: retune
then synchronises gradients after backward instead of DDP's buckets during backward.
Writes tests/benchmarks/results/recovery.json. A missed target prints FAIL; only a crash exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
from tests.helpers.oom_oracle import FailInBackward

RESULTS = Path(__file__).parent / "results"
BATCH, TOKENS, STEPS = 32, 96, 16
ROUNDS = 4


class Encoder(pl.LightningModule):
    """A small transformer classifier; ``fail_at`` lists the steps whose first attempt runs out of memory."""

    def __init__(self, fail_at: set[int] | None = None, where: str = "forward", n: int = BATCH * STEPS) -> None:
        super().__init__()
        self.batch_size = BATCH
        self.fail_at = fail_at or set()
        self.where = where
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randint(0, 1000, (n, TOKENS), generator=g), torch.randint(0, 4, (n,), generator=g)
        )
        self.embed = nn.Embedding(1000, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(128, 4)
        self.times: list[float] = []
        self._t0 = 0.0
        self._failed: set[int] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        first_attempt = batch_idx in self.fail_at and batch_idx not in self._failed and x.shape[0] == BATCH
        if first_attempt:
            self._failed.add(batch_idx)
        # the backward oracle sits under the encoder: backward fails after the encoder's gradients
        embedded = FailInBackward.apply(self.embed(x), first_attempt and self.where == "backward")
        hidden = self.encoder(embedded)
        if first_attempt and self.where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory (benchmark oracle, end of forward)")
        return F.cross_entropy(self.head(hidden.mean(1)), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._t0)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _fit(model: Encoder, oom: bool, **trainer_kwargs: Any) -> Any:
    callbacks = [ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)]
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=callbacks if oom else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return trainer


def single_device() -> dict[str, Any]:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    # normal and guarded runs alternate, and the overhead is the median of the rounds' ratios: on a
    # shared machine a neighbour's burst then hits both sides of a ratio alike
    warm = slice(2, None)  # the first steps allocate the optimizer state
    normal_ms, guarded_ms, ratios = [], [], []
    for round_no in range(ROUNDS):
        normal, guarded = Encoder(), Encoder()
        # which side runs first alternates, so neither gets the warmer caches every round
        for model, oom in [(normal, False), (guarded, True)][:: 1 if round_no % 2 == 0 else -1]:
            _fit(model, oom=oom)
        normal_ms.append(statistics.median(normal.times[warm]) * 1e3)
        guarded_ms.append(statistics.median(guarded.times[warm]) * 1e3)
        ratios.append(guarded_ms[-1] / normal_ms[-1])
    # a fresh model per recovered step: every later step of its epoch runs split (the kept split)
    recovered, backward, kept = [], [], []
    for step in (4, 8, 12):
        forward_model = Encoder(fail_at={step})
        _fit(forward_model, oom=True, limit_train_batches=step + 3)
        recovered.append(forward_model.times[step])
        kept.extend(forward_model.times[step + 1 :])
        backward_model = Encoder(fail_at={step}, where="backward")
        _fit(backward_model, oom=True, limit_train_batches=step + 1)
        backward.append(backward_model.times[step])
    out: dict[str, Any] = {
        "normal_ms": statistics.median(normal_ms),
        "guarded_ms": statistics.median(guarded_ms),
        "recovered_forward_ms": statistics.median(recovered) * 1e3,
        "recovered_backward_ms": statistics.median(backward) * 1e3,
        "kept_split_ms": statistics.median(kept) * 1e3,
    }
    out["guard_overhead"] = statistics.median(ratios) - 1
    out["guard_overhead_rounds"] = [r - 1 for r in ratios]
    return out


def ddp_rank_main(oom: bool, out: Path) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    model = Encoder(n=BATCH * 2 * STEPS)
    trainer = _fit(model, oom=oom, strategy="ddp", accelerator="cpu", devices=2)
    if trainer.global_rank == 0:
        out.write_text(json.dumps(model.times))


def ddp() -> dict[str, float]:
    results = {}
    for oom in (False, True):
        out = RESULTS / f".ddp-{oom}.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        cmd = [sys.executable, "-m", "tests.benchmarks.bench_recovery", "--ddp-rank", str(oom), str(out)]
        subprocess.run(cmd, check=True, timeout=600, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times = json.loads(out.read_text())
        out.unlink()
        results["ddp_oom_trigger_ms" if oom else "ddp_ms"] = statistics.median(times[2:]) * 1e3
    results["ddp_overhead"] = results["ddp_oom_trigger_ms"] / results["ddp_ms"] - 1
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp-rank", nargs=2, metavar=("OOM", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP part")
    args = parser.parse_args(argv)
    if args.ddp_rank:
        ddp_rank_main(args.ddp_rank[0] == "True", Path(args.ddp_rank[1]))
        return 0
    results: dict[str, Any] = single_device()
    if not args.no_ddp:
        results.update(ddp())
    print(f"recovery benchmark: batch {BATCH} x {TOKENS} tokens, 4-layer encoder, AdamW, CPU, one thread (medians)")
    print(f"  normal step                      {results['normal_ms']:8.1f} ms")
    print(f"  with the oom trigger, no OOM     {results['guarded_ms']:8.1f} ms  ({results['guard_overhead']:+.1%})")
    for key, label in (
        ("recovered_forward_ms", "OOM at end of forward"),
        ("recovered_backward_ms", "OOM at end of backward"),
    ):
        print(
            f"  recovered step, {label:22s} {results[key]:8.1f} ms  ({results[key] / results['normal_ms']:.2f}x normal)"
        )
    kept = results["kept_split_ms"]
    print(f"  kept split (2 micro-batches)     {kept:8.1f} ms  ({kept / results['normal_ms']:.2f}x)")
    if "ddp_ms" in results:
        print(f"  DDP 2 gloo ranks, plain          {results['ddp_ms']:8.1f} ms")
        ddp_ms, overhead = results["ddp_oom_trigger_ms"], results["ddp_overhead"]
        print(f"  DDP with the oom trigger         {ddp_ms:8.1f} ms  ({overhead:+.1%})")
    verdict = "PASS" if results["guard_overhead"] < 0.01 else "FAIL"
    print(f"  target: per-step overhead without an OOM under 1%: {verdict}")
    results["target_guard_overhead_under_1pct"] = verdict == "PASS"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "recovery.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
