"""Learning-rate re-tuning at the unfreeze: final validation accuracy and cost, side by side.

``python -m tests.benchmarks.bench_lr`` (from the repository root, in the main venv; ``--seeds 0 1 2``).

Two fine-tunes, each run once per seed and per arm, in one process, one torch thread:

* **digits** (``retune demo``'s fine-tune, without the memory simulation): a small CNN pretrained on
  scikit-learn's digits 0-4, fine-tuned on 5-9 with a new head, Adam at 1e-2 (the demo's rate),
  batch size 16, ``BackboneFinetuning`` unfreezing the backbone at epoch 3 of 12.
* **bert**: a small BERT from ``BertConfig`` (random weights, 2 layers, hidden 32) with PEFT LoRA on
  query/value and the classifier (AdamW at 1e-2), the keyword task of ``examples/hf_peft_finetune.py``;
  ``UnfreezeTopLayer`` unfreezes the top encoder layer's own weights at epoch 3 of 8 as a new group.

Arms (what differs is only the rate of the group the unfreeze adds; the head's rate is the same):

* **fixed**: the callback's default rate for the unfrozen group (digits: ``BackboneFinetuning``'s
  0.1 x the head's rate, 1e-3; bert: the example's 1e-3);
* **grid**: that rate from a grid of 4 (1e-5 ... 1e-2 / 1e-4 ... 1e-1); "best of grid" is the grid value
  with the best median, chosen on the validation set it is scored on (an optimistic baseline that
  costs 4 full runs);
* **retune**: ``ScheduledLRFinder`` with ``trainable_params_changed`` / ``param_groups_changed`` and
  ``groups: new``, default ``lr_find`` (100 steps, 1e-7 .. 1, valley): a range test of the new group
  at the unfreeze;
* **lightning**: Lightning's documented ``FineTuneLearningRateFinder`` recipe (``LearningRateFinder``
  re-run at epoch 0 and the unfreeze milestone, default 100 steps);
* **lightning@unfreeze**: the same recipe without its epoch-0 run (only at the unfreeze milestone), to
  compare the two at the unfreeze alone.

Reported per arm: median final validation accuracy, the range tests' steps and seconds (retune:
from its events; Lightning: timed around ``lr_find``), and the fit's wall seconds. Writes
tests/benchmarks/results/lr.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BackboneFinetuning, LearningRateFinder
from torch import nn

from retune import ScheduledLRFinder
from retune.demo import FEATURES, DigitsFineTune, SimulatedDevice, accuracy, load_digit_splits, make_backbone, pretrain

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).parent / "results"
UNFREEZE_AT = 3
GRIDS = {"digits": (1e-5, 1e-4, 1e-3, 1e-2), "bert": (1e-4, 1e-3, 1e-2, 1e-1)}
EPOCHS = {"digits": 12, "bert": 8}


class FineTuneLearningRateFinder(LearningRateFinder):  # type: ignore[misc]
    """Lightning's documented recipe (``LearningRateFinder`` docstring), timed."""

    def __init__(self, milestones: tuple[int, ...], *args: Any, at_start: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.milestones = milestones
        self.at_start = at_start  # False: the variant that leaves fit start alone (not in Lightning's docs)
        self.seconds = 0.0
        self.steps = 0
        self.suggestions: list[float | None] = []

    def on_fit_start(self, *args: Any, **kwargs: Any) -> None:
        return

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch in self.milestones or (self.at_start and trainer.current_epoch == 0):
            started = time.perf_counter()
            self.lr_find(trainer, pl_module)
            self.seconds += time.perf_counter() - started
            if self.optimal_lr is not None:
                self.steps += len(self.optimal_lr.results.get("lr", []))
                self.suggestions.append(self.optimal_lr.suggestion())


def _trainer(epochs: int, callbacks: list[Any]) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=True,
    )


# -- the digits fine-tune (retune demo) -------------------------------------------------------------

_PRETRAINED: dict[int, tuple[Any, dict[str, torch.Tensor]]] = {}


def _digits(seed: int) -> tuple[Any, nn.Module]:
    """The demo's data and backbone, pretrained once per seed (every arm starts from the same weights)."""
    if seed not in _PRETRAINED:
        pl.seed_everything(seed, verbose=False)
        splits = load_digit_splits(seed)
        backbone = make_backbone()
        pretrain(backbone, splits, 12, seed)
        _PRETRAINED[seed] = (splits, {k: v.clone() for k, v in backbone.state_dict().items()})
    splits, weights = _PRETRAINED[seed]
    backbone = make_backbone()
    backbone.load_state_dict(weights)
    return splits, backbone


def run_digits(arm: str, seed: int, backbone_lr: float | None) -> dict[str, Any]:
    splits, backbone = _digits(seed)
    pl.seed_everything(seed, verbose=False)
    sample = splits.finetune_train.tensors[0][:1]
    device = SimulatedDevice(nn.Sequential(backbone, nn.Linear(FEATURES, 5)), sample, 1 << 40, enforce=False)
    model = DigitsFineTune(backbone, splits, device, lr=1e-2)
    unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_AT, backbone_initial_lr=backbone_lr)
    extra, finder = _arm_callbacks(arm, "trainable_params_changed")
    started = time.perf_counter()
    _trainer(EPOCHS["digits"], [unfreeze, *extra]).fit(model)
    seconds = time.perf_counter() - started
    return _result(accuracy(model.backbone, model.head, splits.finetune_val), seconds, finder)


# -- the BERT fine-tune (examples/hf_peft_finetune.py) ---------------------------------------------


def _hf_example() -> Any:
    if "hf_peft_finetune" in sys.modules:
        return sys.modules["hf_peft_finetune"]
    spec = importlib.util.spec_from_file_location("hf_peft_finetune", ROOT / "examples" / "hf_peft_finetune.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_peft_finetune"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_bert(arm: str, seed: int, top_lr: float | None) -> dict[str, Any]:
    hf = _hf_example()
    pl.seed_everything(seed, verbose=False)
    model = hf.LoraClassifier(n_train=512, batch_size=16, lr=1e-2)
    unfreeze = hf.UnfreezeTopLayer(UNFREEZE_AT, lr=1e-3 if top_lr is None else top_lr)
    extra, finder = _arm_callbacks(arm, "param_groups_changed")
    started = time.perf_counter()
    _trainer(EPOCHS["bert"], [unfreeze, *extra]).fit(model)
    seconds = time.perf_counter() - started
    model.eval()
    correct = 0
    with torch.no_grad():
        for batch in model.val_dataloader():
            correct += int((model.model(**batch).logits.argmax(-1) == batch["labels"]).sum())
    return _result(correct / len(model.val_set), seconds, finder)


# -- arms --------------------------------------------------------------------------------------------


def _arm_callbacks(arm: str, trigger: str) -> tuple[list[Any], Any]:
    if arm == "retune":
        finder = ScheduledLRFinder({"triggers": [{"kind": trigger}]}, verbose=False, write_report=False)
        return [finder], finder
    if arm in ("lightning", "lightning@unfreeze"):
        recipe = FineTuneLearningRateFinder(milestones=(UNFREEZE_AT,), at_start=arm == "lightning")
        return [recipe], recipe
    return [], None


def _result(acc: float, seconds: float, finder: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"val_acc": acc, "fit_seconds": seconds, "test_steps": 0, "test_seconds": 0.0}
    if isinstance(finder, ScheduledLRFinder):
        out["test_steps"] = sum(e.steps for e in finder.history)
        out["test_seconds"] = sum(e.duration_s for e in finder.history)
        out["lrs"] = [[e.epoch, e.groups, e.lrs_before, e.lr_after] for e in finder.history]
    elif isinstance(finder, FineTuneLearningRateFinder):
        out["test_steps"] = finder.steps
        out["test_seconds"] = finder.seconds
        out["lrs"] = finder.suggestions
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--scenarios", nargs="+", default=["digits", "bert"], choices=["digits", "bert"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runners: dict[str, Callable[[str, int, float | None], dict[str, Any]]] = {"digits": run_digits, "bert": run_bert}
    results: dict[str, Any] = {}
    for scenario in args.scenarios:
        arms: list[tuple[str, float | None]] = [("fixed", None), ("retune", None), ("lightning", None)]
        arms.append(("lightning@unfreeze", None))
        arms += [(f"grid {lr:g}", lr) for lr in GRIDS[scenario]]
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in arms}
        for seed in args.seeds:
            for name, lr in arms:  # every arm of a seed back to back: machine load hits them alike
                row = runners[scenario](name.split()[0], seed, lr)
                rows[name].append(row)
                print(
                    f"{scenario} seed {seed} {name}: val acc {row['val_acc']:.3f}, fit {row['fit_seconds']:.1f}s, "
                    f"test {row['test_steps']} steps {row['test_seconds']:.2f}s {row.get('lrs', '')}",
                    flush=True,
                )
        results[scenario] = {"runs": rows, "summary": _summary(rows)}
        _print_table(scenario, results[scenario]["summary"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lr.json").write_text(json.dumps({"seeds": args.seeds, **results}, indent=1))
    return 0


def _summary(rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    summary = {
        name: {
            "median_val_acc": statistics.median(r["val_acc"] for r in runs),
            "min_val_acc": min(r["val_acc"] for r in runs),
            "max_val_acc": max(r["val_acc"] for r in runs),
            "median_test_steps": statistics.median(r["test_steps"] for r in runs),
            "median_test_seconds": statistics.median(r["test_seconds"] for r in runs),
            "median_fit_seconds": statistics.median(r["fit_seconds"] for r in runs),
        }
        for name, runs in rows.items()
    }
    grid = {name: s for name, s in summary.items() if name.startswith("grid")}
    best = max(grid, key=lambda name: grid[name]["median_val_acc"])
    summary["best of grid"] = {**grid[best], "which": float(best.split()[1])}
    return summary


def _print_table(scenario: str, summary: dict[str, dict[str, float]]) -> None:
    print(f"\n{scenario}: arm | median val acc (min-max) | range-test steps | range-test s | fit s")
    for name, s in summary.items():
        label = f"{name} ({s['which']:g})" if "which" in s else name
        print(
            f"  {label:<22} {s['median_val_acc']:.3f} ({s['min_val_acc']:.3f}-{s['max_val_acc']:.3f})"
            f"  {s['median_test_steps']:>5.0f}  {s['median_test_seconds']:>6.2f}  {s['median_fit_seconds']:>6.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
