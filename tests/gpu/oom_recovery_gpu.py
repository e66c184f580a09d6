"""The ``oom`` trigger on a real CUDA GPU: real out-of-memory errors, in the middle of an epoch.

Not part of the default test run (CI has no GPU). On a machine with a CUDA GPU:

    PYTHONPATH=. python tests/gpu/oom_recovery_gpu.py [--capacity-gib GIB] [--out tests/gpu/oom_recovery.json]

The device is capped with ``torch.cuda.set_per_process_memory_fraction`` so that the caching allocator
raises the real ``torch.OutOfMemoryError``. A transformer encoder trains on token sequences of two
lengths, padded per batch to the longest: a batch holding a long sequence (twice the short length)
needs about twice the activation memory of a short one. The cap is calibrated on this device (one
real step of each kind, uncapped): halfway between the short and the long batch's peak, so a long
batch runs out of memory whole and fits in two halves (``--capacity-gib`` overrides). Checked:

* without retune the run dies with ``torch.OutOfMemoryError`` (the baseline);
* with ``oom`` the run finishes, every sample trains once, ``global_step`` is the baseline's plan, and
  the weights match a run on an uncapped device within a tolerance (the same data order, fp32);
* every recovery splits a long batch into exactly 2 micro-batches (issue 27: a failed attempt that
  stayed resident made it 48 micro-batches of 1, and the next step died);
* the recovered step's time against a normal step's, and the peak memory after recovery.

It prints a summary and writes JSON. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from retune import ScheduledBatchSizeFinder
from tests.helpers.lightning_ns import pl

VOCAB, DIM = 8000, 512


class Tokens(Dataset[tuple[torch.Tensor, int, int]]):
    def __init__(self, n: int, short: int, long: int, every: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [
            (torch.randint(1, VOCAB, (long if i % every == every - 1 else short,), generator=g), i % 4, i)
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        return self.items[i]


def collate(samples: list[tuple[torch.Tensor, int, int]]) -> dict[str, torch.Tensor]:
    longest = max(len(s[0]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, (seq, _, _) in enumerate(samples):
        ids[row, : len(seq)] = seq
    return {
        "ids": ids,
        "labels": torch.tensor([s[1] for s in samples]),
        "index": torch.tensor([s[2] for s in samples]),
    }


class Encoder(pl.LightningModule):
    def __init__(self, data: Tokens, batch_size: int) -> None:
        super().__init__()
        self.data, self.batch_size = data, batch_size
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 8, 4 * DIM, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, 4)
        self.trained: Counter[int] = Counter()
        self.times: list[float] = []
        self._t0 = 0.0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        hidden = self.encoder(self.embed(batch["ids"]))
        index = batch["index"].tolist()
        hidden.register_hook(lambda grad: self.trained.update(index))
        return F.cross_entropy(self.head(hidden.mean(1)), batch["labels"])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def fit(data: Tokens, batch_size: int, oom: bool) -> tuple[Encoder, Any, ScheduledBatchSizeFinder | None, str]:
    model = Encoder(data, batch_size)
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_epochs=1,
        callbacks=[finder] if oom else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    error = ""
    try:
        trainer.fit(model)
    except torch.OutOfMemoryError as exc:
        error = f"OutOfMemoryError: {str(exc)[:120]}"
    return model, trainer, finder if oom else None, error


def step_peak(model: Encoder, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> int:
    """Peak reserved bytes of one real training step on ``batch`` (forward, backward, optimizer step)."""
    batch = {key: value.cuda() for key, value in batch.items()}
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    F.cross_entropy(model.head(model.encoder(model.embed(batch["ids"])).mean(1)), batch["labels"]).backward()
    optimizer.step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_reserved())


def calibrate(data: Tokens, batch_size: int) -> tuple[int, int]:
    """``(short, long)``: the peak reserved bytes of a step on a batch of short and of long sequences."""
    model = Encoder(data, batch_size).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    short = collate([data[i] for i in range(batch_size)])
    long = collate([(data[i][0].repeat(2), data[i][1], i) for i in range(batch_size)])
    step_peak(model, optimizer, short)  # the optimizer state exists from here on, as in training
    peaks = step_peak(model, optimizer, short), step_peak(model, optimizer, long)
    del model, optimizer
    torch.cuda.empty_cache()
    return peaks


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity-gib", type=float, default=None, help="default: calibrated on this device")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("tests/gpu/oom_recovery.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine")
    total = torch.cuda.get_device_properties(0).total_memory
    data = Tokens(n=args.batch_size * 12, short=64, long=128, every=args.batch_size * 3)
    short_peak, long_peak = calibrate(data, args.batch_size)
    if args.capacity_gib is None:
        args.capacity_gib = (short_peak + long_peak) / 2 / 2**30

    reference, ref_trainer, _, ref_error = fit(data, args.batch_size, oom=False)  # uncapped device
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(args.capacity_gib * 2**30 / total)
    _, _, _, base_error = fit(data, args.batch_size, oom=False)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, trainer, finder, error = fit(data, args.batch_size, oom=True)
    assert finder is not None
    recoveries = [e.to_dict() for e in finder.history if e.is_recovery]
    diff = max(
        (a.detach() - b.detach()).abs().max().item()
        for a, b in zip(reference.parameters(), model.parameters(), strict=True)
    )
    normal = sorted(model.times)[len(model.times) // 2] if model.times else float("nan")
    result = {
        "device": torch.cuda.get_device_name(0),
        "capacity_gib": args.capacity_gib,
        "calibrated_peaks_gib": {"short": short_peak / 2**30, "long": long_peak / 2**30},
        "reference_error": ref_error,
        "without_retune": base_error or "finished (capacity too large to show an OOM: lower --capacity-gib)",
        "with_oom_trigger_error": error,
        "recoveries": recoveries,
        "global_step": trainer.global_step,
        "reference_global_step": ref_trainer.global_step,
        "every_sample_once": set(model.trained.values()) == {1} and len(model.trained) == len(data),
        "max_weight_diff": diff,
        "median_step_s": normal,
        "slowest_step_s": max(model.times) if model.times else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    checks = {
        "baseline dies of OOM": bool(base_error),
        "with oom: finished": not error,
        "recovered at least once": bool(recoveries),
        "every recovery split in 2 micro-batches": bool(recoveries)
        and all(r["micro_batches"] == 2 for r in recoveries),
        "global_step as planned": trainer.global_step == ref_trainer.global_step,
        "every sample once": result["every_sample_once"],
        "weights within 1e-3 of the uncapped run": diff < 1e-3,
    }
    result["checks"] = checks
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
