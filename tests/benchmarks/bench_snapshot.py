"""Snapshot benchmark: retune's in-memory snapshot + restore against Lightning's checkpoint round trip.

Lightning's ``BatchSizeFinder`` protects the run around its trials by writing a full checkpoint to
disk and loading it back (``trainer.save_checkpoint`` + ``trainer._checkpoint_connector.restore`` +
``trainer.strategy.remove_checkpoint``). retune copies only what a probe step can change
(``TrainingSnapshot.capture``) into host memory and hands it back (``restore``). On this CPU-only
machine the parameters and optimizer state are host tensors, so they are *held*: capture moves the
run onto copies and restore moves it back without copying (on a GPU both are copies between device
and host: ``--accelerator cuda``, listed in tests/gpu/README.md). ``reset`` (what every trial after
a search's first costs) is timed too and reported beside, with the state cost of a three-trial
search (capture + 2 resets + restore).

Model: a ~50M-parameter MLP (three Linear(4096, 4096) layers as the backbone, a Linear(4096, 10)
head) trained with AdamW, one real step taken so the optimizer state exists. Both are timed inside
a running fit, at the start of epoch 1, on the same trainer state. Cases:

* ``empty``: no tensor at all (the snapshot of the loops, RNG and scheduler state): the fixed cost;
* ``frozen``: backbone frozen, only the head trainable (the common fine-tuning start);
* ``partial``: the last backbone layer and the head trainable;
* ``unfrozen``: everything trainable.

Targets: retune's snapshot + restore is >= 5x faster than Lightning's round trip (frozen and
unfrozen), and with a frozen backbone its cost is proportional to the trainable state: each case
costs the fixed cost plus its share of the unfrozen case's variable cost, by bytes copied.

Run: ``python -m tests.benchmarks.bench_snapshot`` (writes tests/benchmarks/results/snapshot.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import compat
from retune.probing.snapshot import TrainingSnapshot

RESULTS = Path(__file__).parent / "results"
WIDTH = 4096
LAYERS = 3
RETUNE_REPEATS = 7  # at least; see _repeats
LIGHTNING_REPEATS = 3
CASES = ("frozen", "partial", "unfrozen")
# torch's own thread count, read at import: ``--threads 0`` sets it back, since ``make bench`` runs this
# benchmark in a process where earlier benchmarks set one thread (snapshot-default-threads.json was
# once measured with one thread that way, as its environment.torch_threads records).
TORCH_DEFAULT_THREADS = torch.get_num_threads()


class BigModel(pl.LightningModule):
    def __init__(self, trainable: str, root: str) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Linear(WIDTH, 10)
        if trainable in ("frozen", "partial"):
            self.backbone.requires_grad_(False)
        if trainable == "partial":
            self.backbone[-2].requires_grad_(True)
        self.root = root
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(16, WIDTH, generator=g), torch.randint(0, 10, (16,), generator=g))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


def _capture(trainer: Any, module: nn.Module, with_optimizers: bool = True) -> TrainingSnapshot:
    """What retune's probe session captures (retune.probing.prober.Prober.session)."""
    stateful: list[Any] = [*compat.lr_schedulers(trainer), *compat.loop_progress(trainer)]
    scaler = compat.grad_scaler(trainer)
    if scaler is not None:
        stateful.append(scaler)
    return TrainingSnapshot.capture(
        module,
        optimizers=list(trainer.optimizers) if with_optimizers else [],
        stateful=stateful,
        counters=compat.loop_counters(trainer),
    )


class Measure(pl.Callback):
    """At the start of epoch 1 (Adam state allocated by epoch 0's step), time both round trips."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.result: dict[str, Any] = {}

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch != 1:
            return
        fingerprint = _fingerprint(trainer, pl_module)
        storages = [p.data_ptr() for p in pl_module.parameters()]
        # The collector is paused while timing (no collection pause inside a millisecond measurement). It
        # is not run between repetitions either: the idle gap would let torch's worker threads go to sleep,
        # and waking them costs more than all the copies of a frozen model.
        gc.collect()
        gc.disable()
        try:
            retune = self._time_retune(trainer, pl_module)
            assert _fingerprint(trainer, pl_module) == fingerprint, "retune's restore changed the state"
            assert [p.data_ptr() for p in pl_module.parameters()] == storages, "retune's restore moved the weights"
            lightning = self._time_lightning(trainer)
            assert _fingerprint(trainer, pl_module) == fingerprint, "Lightning's restore changed the state"
        finally:
            gc.enable()
        empty, retune_times, capture_times, reset_times, restore_times, nbytes = retune
        lightning_times, save_times, load_times, sizes = lightning
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        self.result = {
            "params": sum(p.numel() for p in pl_module.parameters()),
            "trainable_params": sum(p.numel() for p in trainable),
            "trainable_state_bytes": _trainable_state_bytes(trainer, pl_module),
            "snapshot_bytes": nbytes,
            "checkpoint_bytes": statistics.median(sizes),
            "retune_s": statistics.median(retune_times),
            "retune_capture_s": statistics.median(capture_times),
            "retune_restore_s": statistics.median(restore_times),
            "retune_reset_s": statistics.median(reset_times),
            "retune_empty_s": statistics.median(empty),
            "retune_best_s": min(retune_times),
            "retune_empty_best_s": min(empty),
            "retune_all_s": retune_times,
            "retune_repeats": len(retune_times),
            "lightning_s": statistics.median(lightning_times),
            "lightning_best_s": min(lightning_times),
            "lightning_save_s": statistics.median(save_times),
            "lightning_restore_s": statistics.median(load_times),
            "lightning_all_s": lightning_times,
        }

    def _time_retune(
        self, trainer: Any, pl_module: Any
    ) -> tuple[list[float], list[float], list[float], list[float], list[float], int]:
        empty: list[float] = []
        for _ in _repeats(empty):
            started = time.perf_counter()
            snap = _capture(trainer, nn.Module(), with_optimizers=False)  # loops, RNG, schedulers: no tensors
            snap.restore()
            empty.append(time.perf_counter() - started)
            del snap
        totals: list[float] = []
        captures: list[float] = []
        resets: list[float] = []
        restores: list[float] = []
        nbytes = 0
        for _ in _repeats(totals):
            started = time.perf_counter()
            snap = _capture(trainer, pl_module)
            _synchronize()
            captured = time.perf_counter()
            snap.reset()  # what each trial after the first costs (not part of snapshot + restore)
            _synchronize()
            reset = time.perf_counter()
            snap.restore()
            _synchronize()
            done = time.perf_counter()
            nbytes = snap.nbytes
            del snap  # freed before the next capture, as after a search
            captures.append(captured - started)
            resets.append(reset - captured)
            restores.append(done - reset)
            totals.append(captures[-1] + restores[-1])
        return empty, totals, captures, resets, restores, nbytes

    def _time_lightning(self, trainer: Any) -> tuple[list[float], list[float], list[float], list[int]]:
        """The round trip of Lightning's finder: save to disk, restore, remove the file."""
        totals: list[float] = []
        saves: list[float] = []
        loads: list[float] = []
        sizes: list[int] = []
        for _ in range(LIGHTNING_REPEATS):
            path = os.path.join(self.root, f".scale_batch_size_{uuid.uuid4()}.ckpt")
            started = time.perf_counter()
            trainer.save_checkpoint(path)
            saved = time.perf_counter()
            sizes.append(os.path.getsize(path))
            trainer._checkpoint_connector.restore(path)
            trainer.strategy.remove_checkpoint(path)
            done = time.perf_counter()
            saves.append(saved - started)
            loads.append(done - saved)
            totals.append(done - started)
        return totals, saves, loads, sizes


def _synchronize() -> None:
    """Wait for copies to a GPU to land before reading the clock (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


def _repeats(times: list[float]) -> Iterator[int]:
    """At least RETUNE_REPEATS runs, more (up to 51) while they add up to under a second: a
    millisecond measurement on a shared machine needs many samples for a stable median."""
    count = 0
    while count < RETUNE_REPEATS or (sum(times) < 1.0 and count < 51):
        yield count
        count += 1


def _trainable_state_bytes(trainer: Any, module: nn.Module) -> int:
    """Bytes a probe can change: trainable parameters, their gradients, buffers and optimizer state."""
    total = 0
    for p in module.parameters():
        if p.requires_grad or p.grad is not None:
            total += p.numel() * p.element_size() * (1 if p.grad is None else 2)
    total += sum(b.numel() * b.element_size() for b in module.buffers())
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def _fingerprint(trainer: Any, module: nn.Module) -> list[float]:
    values = [float(p.double().sum()) for p in module.parameters()]
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            values += [float(v.double().sum()) for v in state.values() if isinstance(v, torch.Tensor)]
    return values


def run_case(case: str, root: str, accelerator: str = "cpu") -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = BigModel(case, root)
    measure = Measure(root)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_epochs=2,
        limit_train_batches=1,
        callbacks=[measure],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(module)
    return measure.result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "snapshot.json"))
    parser.add_argument(
        "--accelerator",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model trains (cuda: the snapshot copies device to host and back, no tensor is held; "
        "Lightning's checkpoint is restored onto the device)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine a multi-threaded copy stalls whenever another "
        "process holds one of the cores, which swamps millisecond timings; 0: torch's default, even after "
        "another benchmark in the same process set one)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads if args.threads > 0 else TORCH_DEFAULT_THREADS)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        parser.error("--accelerator cuda: no CUDA device here")
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    load_at_start = os.getloadavg()
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="retune-bench-ckpt-")  # local disk, as Lightning's default_root_dir
    results: dict[str, dict[str, Any]] = {}
    for case in CASES:
        print(f"[bench] snapshot: {case} backbone", flush=True)
        results[case] = run_case(case, root, args.accelerator)
        r = results[case]
        print(
            f"[bench]   retune {r['retune_s'] * 1e3:.1f} ms, lightning {r['lightning_s'] * 1e3:.1f} ms",
            flush=True,
        )
    empty = statistics.median(r["retune_empty_s"] for r in results.values())
    empty_best = min(r["retune_empty_best_s"] for r in results.values())
    unfrozen = results["unfrozen"]
    variable_best = unfrozen["retune_best_s"] - empty_best
    lines = []
    for case, r in results.items():
        share = r["snapshot_bytes"] / unfrozen["snapshot_bytes"]
        r["speedup"] = r["lightning_s"] / r["retune_s"]
        # a search's whole state cost: one capture, a reset before each trial after the first, the final
        # restore; Lightning's finder pays one round trip however many trials it runs
        r["search3_s"] = r["retune_capture_s"] + 2 * r["retune_reset_s"] + r["retune_restore_s"]
        r["search3_speedup"] = r["lightning_s"] / r["search3_s"]
        r["bytes_share_of_unfrozen"] = share
        r["time_share_of_unfrozen"] = r["retune_best_s"] / unfrozen["retune_best_s"]
        # best-of-N: noise on a shared machine only ever adds time, so the fastest run is the cost of the copies
        r["retune_predicted_best_s"] = empty_best + share * variable_best  # fixed cost + its share by bytes
        lines.append(
            [
                case,
                f"{r['trainable_params'] / 1e6:.2f}M / {r['params'] / 1e6:.2f}M",
                f"{r['snapshot_bytes'] / 2**20:.1f}",
                f"{r['checkpoint_bytes'] / 2**20:.1f}",
                f"{r['retune_s'] * 1e3:.1f} / {r['retune_best_s'] * 1e3:.1f}",
                " / ".join(f"{r[f'retune_{part}_s'] * 1e3:.1f}" for part in ("capture", "reset", "restore")),
                f"{r['lightning_s'] * 1e3:.0f} / {r['lightning_best_s'] * 1e3:.0f}",
                f"{r['lightning_save_s'] * 1e3:.0f} / {r['lightning_restore_s'] * 1e3:.0f}",
                f"{r['speedup']:.1f}x",
                f"{r['search3_speedup']:.1f}x",
                f"{share:.5f}",
                f"{r['time_share_of_unfrozen']:.5f}",
            ]
        )
    header = (
        "backbone",
        "trainable / total params",
        "snapshot MiB",
        "checkpoint MiB",
        "retune ms median / best",
        "capture / reset / restore",
        "lightning ms median / best",
        "save / restore",
        "speedup (medians)",
        "3-trial search",
        "bytes / unfrozen",
        "best time / unfrozen",
    )
    print()
    print(_table(header, lines))
    print(
        f"retune fixed cost (no tensor state: loops, RNG, schedulers): median {empty * 1e3:.2f} ms, "
        f"best {empty_best * 1e3:.2f} ms"
    )
    targets = []
    for case in ("frozen", "unfrozen"):
        speedup = results[case]["speedup"]
        targets.append(
            {"target": f"snapshot + restore >= 5x faster than the disk round trip ({case})", "value": round(speedup, 1),
             "pass": speedup >= 5}
        )  # fmt: skip
    for case in ("frozen", "partial"):
        r = results[case]
        predicted, measured = r["retune_predicted_best_s"], r["retune_best_s"]
        tolerance = max(0.25 * (predicted - empty_best), 0.002)  # 25% of its variable part, at least 2 ms
        targets.append(
            {
                "target": f"{case}: time proportional to the trainable state (best of N: fixed cost + bytes share "
                f"of the unfrozen variable cost, within max(25%, 2 ms))",
                "value": f"measured {measured * 1e3:.2f} ms, predicted {predicted * 1e3:.2f} ms",
                "pass": abs(measured - predicted) <= tolerance,
            }
        )
    print()
    for target in targets:
        print(f"{'PASS' if target['pass'] else 'FAIL'}  {target['target']}: {target['value']}")
    elapsed = time.perf_counter() - started
    print(f"\nbenchmark time {elapsed:.0f}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "snapshot",
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pytorch_lightning": pl.__version__,
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "accelerator": args.accelerator,
            "device": torch.cuda.get_device_name(0) if args.accelerator == "cuda" else platform.processor(),
            "load_average_at_start": load_at_start,
            "checkpoint_dir": root,
        },
        "settings": {
            "width": WIDTH,
            "layers": LAYERS,
            "retune_repeats": RETUNE_REPEATS,
            "lightning_repeats": LIGHTNING_REPEATS,
            "optimizer": "AdamW",
        },
        "retune_fixed_cost_s": empty,
        "retune_fixed_cost_best_s": empty_best,
        "cases": results,
        "targets": targets,
        "seconds": elapsed,
    }
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


def _table(header: tuple[str, ...], lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
