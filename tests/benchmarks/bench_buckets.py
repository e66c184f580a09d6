"""batching: buckets benchmark — one batch size (``first``, ``largest``) vs a batch size per length bucket.

Two long-tailed variable-length workloads, each trained for two epochs under the same CPU memory
budget (retune's ``CpuPeakTracker``), the backbone frozen in epoch 0 and unfrozen at epoch 1 (a
re-tune), side by side in one process:

* ``tokens``: the token-sequence data of ``bench_probe_samples`` (tests/helpers/varlen.py: 1200 sequences of
  16 tokens, 0.25% of them 128) with its small embedding + MLP classifier, budget 6 MiB;
* ``bert``: a small BERT built from ``transformers.BertConfig`` (2 layers, hidden 64, eager
  attention: memory grows with length squared), 600 texts with 98% of 16-64 tokens and 2% of
  400-512, dynamic padding, budget 48 MiB.

For ``probe_samples: first`` (one size found on the first batches: unsafe), ``probe_samples: largest``
(one size that fits the longest samples), ``batching: buckets`` (6 buckets, each probed on its
longest samples) and ``buckets_throughput`` (the same buckets with ``objective: throughput``: every bucket
capped at the padded work per step where the reference bucket trains fastest; 3 steps per trial), per
epoch: mean samples per step, the worst real step's peak / budget (every real
step measured as a probe is), the padding fraction (pad tokens / tokens in padded batches), the
epoch's wall time and samples/s (from a second, identical run without the per-step tracker, whose
dispatch hooks would otherwise slow every step), and trials and seconds of the search at fit start and
of the re-tune after the unfreeze.

Run: ``python -m tests.benchmarks.bench_buckets`` (writes tests/benchmarks/results/buckets.json; ``--out`` another
file there).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from retune import ScheduledBatchSizeFinder
from retune.memory import measure_peak, tensor_bytes
from retune.schedule.models import parse_byte_size
from tests.helpers import varlen
from tests.helpers.lightning_ns import NAMESPACE, PRECISION_32, pl, seed

RESULTS = Path(__file__).parent / "results"
MODES = ("first", "largest", "buckets", "buckets_throughput")
THROUGHPUT_STEPS = 3
"""``buckets_throughput`` probes: 1 warm-up + 2 timed steps per trial (throughput needs >= 2)."""


# -- workloads -----------------------------------------------------------------------------------------


class _Freezable(pl.LightningModule):  # type: ignore[misc]
    backbone: list[nn.Module]

    def freeze_backbone(self, frozen: bool) -> None:
        for module in self.backbone:
            module.requires_grad_(not frozen)


class TokenModel(varlen.TokenClassifier, _Freezable):  # type: ignore[misc]
    """tests/helpers/varlen.py's classifier with its embedding and MLP as the backbone."""

    def __init__(self) -> None:
        super().__init__(varlen.TokenDataset(varlen.lengths()), batch_size=8, shuffle=True, seed=0)
        self.backbone = [self.embed, self.mlp]


def _token_tokens(batch: Any) -> tuple[int, int, int]:
    ids = batch[0]
    return int(ids.shape[0]), int(ids.numel()), int((ids > 0).sum())


class TextData(Dataset[dict[str, Any]]):
    """Random token ids; 98% of 16-64 tokens, 2% of 400-512 (a long tail, as in real corpora)."""

    def __init__(self, n: int = 600, seed: int = 0) -> None:
        r = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        lengths = [r.randint(400, 512) if r.random() < 0.02 else r.randint(16, 64) for _ in range(n)]
        self.rows = [torch.randint(5, 1000, (n,), generator=g) for n in lengths]
        self.labels = [r.randint(0, 1) for _ in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.rows[i], "label": self.labels[i]}


def text_tokens(sample: dict[str, Any]) -> int:
    return len(sample["input_ids"])


def pad_text(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
    labels = torch.tensor([s["label"] for s in samples])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}


class BertModel(_Freezable):
    """``BertForSequenceClassification`` from a small ``BertConfig``; the embeddings and encoder are the backbone."""

    def __init__(self, hidden: int = 64, texts: int = 600) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=1000,
            hidden_size=hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=2 * hidden,
            max_position_embeddings=512,
            num_labels=2,
            attn_implementation="eager",
        )
        self.bert = BertForSequenceClassification(config)
        self.data = TextData(texts)
        self.batch_size = 8
        self.backbone = [self.bert.bert.embeddings, self.bert.bert.encoder]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.cross_entropy(out.logits, batch["labels"])

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, collate_fn=pad_text)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _bert_tokens(batch: Any) -> tuple[int, int, int]:
    mask = batch["attention_mask"]
    return int(mask.shape[0]), int(mask.numel()), int(mask.sum())


WORKLOADS: dict[str, dict[str, Any]] = {
    "tokens": {"model": TokenModel, "budget": varlen.BUDGET, "size_fn": varlen.token_count, "count": _token_tokens},
    "bert": {"model": BertModel, "budget": "48MiB", "size_fn": text_tokens, "count": _bert_tokens},
}


# -- one run --------------------------------------------------------------------------------------------


class Meter(pl.Callback):  # type: ignore[misc]
    """Per epoch: samples, steps, padded and real tokens, training seconds (first batch to epoch end), and,
    when ``peaks``, every real step's peak measured as a probe is (``measure_peak`` plus the batch's bytes)."""

    def __init__(self, count: Any, peaks: bool) -> None:
        self.count, self.peaks = count, peaks
        self.epochs: list[dict[str, Any]] = []
        self._open: Any = None

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.epochs.append({"samples": 0, "steps": 0, "padded": 0, "real": 0, "peak": 0, "started": None})

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        epoch = self.epochs[-1]
        if epoch["started"] is None:
            epoch["started"] = time.perf_counter()  # after the epoch-start search: training time only
        samples, padded, real = self.count(batch)
        epoch["samples"] += samples
        epoch["steps"] += 1
        epoch["padded"] += padded
        epoch["real"] += real
        if self.peaks:
            self._open = measure_peak(pl_module.device, pl_module, list(trainer.optimizers), grads=True)
            self._reading = self._open.__enter__()
            self._bytes = tensor_bytes(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
            epoch = self.epochs[-1]
            epoch["peak"] = max(epoch["peak"], int(self._reading.peak_bytes) + self._bytes)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        epoch = self.epochs[-1]
        epoch["seconds"] = time.perf_counter() - (epoch.pop("started") or time.perf_counter())


class Unfreeze(pl.Callback):  # type: ignore[misc]
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.freeze_backbone(True)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            pl_module.freeze_backbone(False)


def one_fit(workload: str, mode: str, peaks: bool) -> dict[str, Any]:
    spec = WORKLOADS[workload]
    seed(0)
    model = spec["model"]()
    search: dict[str, Any] = {"steps_per_trial": 2}
    if mode == "buckets":
        search["batching"] = "buckets"
    elif mode == "buckets_throughput":
        search.update(batching="buckets", objective="throughput", steps_per_trial=THROUGHPUT_STEPS)
    else:
        search["probe_samples"] = mode
    schedule = {
        "triggers": [{"kind": "fit_start"}, {"kind": "trainable_params_changed"}],
        "search": search,
        "memory": {"budget": spec["budget"]},
    }
    finder = ScheduledBatchSizeFinder(schedule, sample_size=spec["size_fn"], verbose=False, write_report=False)
    meter = Meter(spec["count"], peaks)
    trainer = pl.Trainer(
        max_epochs=2,
        callbacks=[Unfreeze(), meter, finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        precision=PRECISION_32,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(model)
    budget = parse_byte_size(spec["budget"])
    searches = [
        {
            "trigger": e.trigger,
            "trials": len(e.trials),
            "seconds": round(e.duration_s, 2),
            "batch_size": e.batch_size_after,
            "bucket_sizes": e.bucket_sizes,
            "bucket_bounds": e.bucket_bounds,
            "bucket_largest": e.bucket_largest,
            "reference_bucket": e.reference_bucket,
            "padded_per_step": e.padded_per_step,
        }
        for e in finder.history
    ]
    epochs = [
        {
            "samples_per_step": round(e["samples"] / max(e["steps"], 1), 1),
            "steps": e["steps"],
            "seconds": round(e["seconds"], 2),
            "samples_per_s": round(e["samples"] / e["seconds"], 1),
            "padding": round(1 - e["real"] / max(e["padded"], 1), 3),
            "worst_peak_over_budget": round(e["peak"] / budget, 3) if peaks else None,
        }
        for e in meter.epochs
    ]
    return {"searches": searches, "epochs": epochs}


def run(workloads: list[str], modes: tuple[str, ...] = MODES, results: dict[str, Any] | None = None) -> dict[str, Any]:
    results = {} if results is None else results
    for workload in workloads:
        results.setdefault(workload, {})
        for mode in modes:
            measured = one_fit(workload, mode, peaks=True)
            timed = one_fit(workload, mode, peaks=False)
            for m, t in zip(measured["epochs"], timed["epochs"], strict=True):
                m["seconds"], m["samples_per_s"] = t["seconds"], t["samples_per_s"]
            measured["timed_searches"] = timed["searches"]
            results[workload][mode] = measured
            print(f"{workload:7s} {mode:8s} {json.dumps(measured)}", file=sys.stderr)
    return results


def table(results: dict[str, Any]) -> str:
    lines = []
    for workload, modes in results.items():
        lines.append(f"{workload}:")
        lines.append(
            "  mode      epoch  samples/step  epoch s  samples/s  worst peak/budget  padding  search (trials, s)"
        )
        for mode, r in modes.items():
            for epoch, (e, s) in enumerate(zip(r["epochs"], r["searches"], strict=False)):
                sizes = "/".join(map(str, s["bucket_sizes"])) if s["bucket_sizes"] else str(s["batch_size"])
                if s.get("bucket_largest"):
                    sizes += f" (largest {'/'.join(map(str, s['bucket_largest']))}, T* {s.get('padded_per_step')})"
                lines.append(
                    f"  {mode:8s}  {epoch:5d}  {e['samples_per_step']:12.1f}  {e['seconds']:7.2f}  "
                    f"{e['samples_per_s']:9.1f}  {e['worst_peak_over_budget']:17.2f}  {e['padding']:7.2f}  "
                    f"{s['trials']} trials, {s['seconds']:.2f}s -> {sizes}"
                )
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, per workload and epoch: buckets stay within the budget, carry >= 3x the samples
    per step of ``largest`` and train the epoch faster; a re-tune of every bucket takes <= buckets + 4 trials."""
    checks = []
    for workload, modes in results.items():
        buckets, largest = modes["buckets"], modes["largest"]
        for epoch, (b, big) in enumerate(zip(buckets["epochs"], largest["epochs"], strict=True)):
            checks += [
                {
                    "workload": workload,
                    "epoch": epoch,
                    "target": "worst real step <= budget",
                    "value": b["worst_peak_over_budget"],
                    "pass": b["worst_peak_over_budget"] <= 1.0,
                },
                {
                    "workload": workload,
                    "epoch": epoch,
                    "target": "samples/step >= 3x largest",
                    "value": round(b["samples_per_step"] / big["samples_per_step"], 2),
                    "pass": b["samples_per_step"] >= 3 * big["samples_per_step"],
                },
                {
                    "workload": workload,
                    "epoch": epoch,
                    "target": "epoch faster than largest",
                    "value": round(big["seconds"] / b["seconds"], 2),
                    "pass": b["seconds"] < big["seconds"],
                },
            ]
        capped = modes.get("buckets_throughput")
        if capped is not None:
            for epoch, (c, b) in enumerate(zip(capped["epochs"], buckets["epochs"], strict=True)):
                checks += [
                    {
                        "workload": workload,
                        "epoch": epoch,
                        "target": "buckets_throughput worst real step <= budget",
                        "value": c["worst_peak_over_budget"],
                        "pass": c["worst_peak_over_budget"] <= 1.0,
                    },
                    {
                        "workload": workload,
                        "epoch": epoch,
                        "target": "buckets_throughput samples/s >= 0.95x buckets (largest)",
                        "value": round(c["samples_per_s"] / b["samples_per_s"], 2),
                        "pass": c["samples_per_s"] >= 0.95 * b["samples_per_s"],
                    },
                ]
        retune = buckets["searches"][-1]
        count = len(retune["bucket_sizes"])
        checks.append(
            {
                "workload": workload,
                "epoch": 1,
                "target": "re-tune trials <= buckets + 4",
                "value": f"{retune['trials']} <= {count + 4}",
                "pass": retune["trials"] <= count + 4,
            }
        )
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=list(MODES),
        help="run only these; the others' results are kept from the existing results file",
    )
    parser.add_argument(
        "--out",
        default="buckets.json",
        help="results file name under tests/benchmarks/results/ (buckets_throughput.json holds the run that "
        "added the buckets_throughput arm, next to the quieter run of the other three in buckets.json)",
    )
    args = parser.parse_args(argv)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    previous = RESULTS / args.out
    kept = json.loads(previous.read_text())["results"] if set(args.modes) != set(MODES) and previous.exists() else {}
    results = run(args.workloads, tuple(args.modes), kept)
    results = {w: {m: results[w][m] for m in MODES if m in results[w]} for w in results}
    checks = targets(results)
    out = {
        "targets": checks,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": NAMESPACE,
        "threads": 1,
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(out, indent=2))
    print(table(results))
    for check in checks:
        print(
            f"{'PASS' if check['pass'] else 'FAIL'}  {check['workload']} epoch {check['epoch']}: "
            f"{check['target']} ({check['value']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
