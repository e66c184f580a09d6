"""``retune demo``: a real fine-tuning run whose batch size changes at the unfreeze, on a laptop CPU.

The run: a small CNN is pretrained on scikit-learn's handwritten digits 0-4 (the data ships inside
scikit-learn, so nothing is downloaded), then fine-tuned on digits 5-9 with a new head and
Lightning's ``BackboneFinetuning``: backbone frozen first, unfrozen at ``unfreeze_at``. The finder
runs a schedule with the ``freeze_unfreeze`` triggers, so it searches at fit start and again at
the unfreeze, and the run ends with the table of searches, the accuracy reached and the report
files (``history.json``, ``history.csv``, ``batch_size.png``).

Why a simulated device (the default, ``--memory simulated``). On a CPU nothing runs out of
memory at these sizes, so the demo plays the device: :class:`SimulatedDevice` models the bytes
one training step of this CNN needs from its real layer shapes and parameter counts, and raises
the real ``torch.OutOfMemoryError`` when that exceeds the budget, exactly where a GPU of that size
would fail. The answer is then exact and the same on every machine, and the demo can print the
true maximum of each phase. The budget is the schedule's ``memory.budget`` (``--budget`` writes
it); in this mode the demo takes it out of the schedule it hands the finder and gives it to the
simulated device instead, and says so when it starts. ``--memory measured`` leaves the budget in
the schedule and no simulation: retune itself holds each probe's measured peak (tensor bytes, on
CPU) to it, which is what a real run on a CPU does.
"""

from __future__ import annotations

import copy
import inspect
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# Imported here, not inside run_demo: it imports every installed Lightning namespace, and a first
# import sets that namespace's logger back to INFO, undoing _quiet_lightning.
from retune.callbacks.batch_size_finder import ScheduledBatchSizeFinder
from retune.errors import FieldProblem, ScheduleError
from retune.events import RetuneEvent
from retune.reports import batch_size as report
from retune.schedule.loading import read_schedule_file, validate_data
from retune.schedule.models import MemoryConfig, RetuneSchedule, parse_byte_size

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the legacy namespace
    import pytorch_lightning as pl

DEFAULT_EPOCHS = 12
DEFAULT_UNFREEZE_AT = 3
DEFAULT_PRETRAIN_EPOCHS = 12
DEFAULT_BUDGET = "2MiB"
DEFAULT_OUT = Path("retune-demo")
MEMORY_MODES = ("simulated", "measured")
EVAL_BATCH_SIZE = 256
FEATURES = 64
# The ready-made schedule in the source tree; a wheel has no schedules/ folder, so the demo falls
# back to the identical built-in copy below (tests/project/test_demo.py checks they stay identical).
SCHEDULE_FILE = Path(__file__).resolve().parent.parent / "schedules" / "freeze_unfreeze.yaml"
BUILTIN_SCHEDULE: Mapping[str, Any] = {
    "version": 1,
    "batch_arg_name": "batch_size",
    "search": {
        "mode": "binsearch",
        "init_val": 2,
        "steps_per_trial": 3,
        "max_trials": 25,
        "margin": 0.05,
        "max_val": 8192,
        "warm_start": True,
    },
    "triggers": [{"kind": "fit_start"}, {"kind": "trainable_params_changed", "min_fraction": 0.0}],
}

# Bytes of optimizer-side state per trainable parameter *on top of the weight itself*: the
# gradient plus Adam's two moments (exp_avg, exp_avg_sq), each the parameter's dtype.
STATE_COPIES_PER_TRAINABLE_PARAM = 3


# -- data ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DigitSplits:
    """Images (N, 1, 8, 8) scaled to [0, 1] and labels 0-4 for each task (5-9 are shifted down by 5)."""

    pretrain_train: TensorDataset
    pretrain_val: TensorDataset
    finetune_train: TensorDataset
    finetune_val: TensorDataset


def load_digit_splits(seed: int, limit: int | None = None, val_fraction: float = 0.2) -> DigitSplits:
    """scikit-learn's 1,797 8x8 digits, split into two 5-class tasks, each into train and validation.

    ``limit`` keeps at most that many training images per task (tests use it to stay fast); the
    validation sets are not cut, so accuracies stay comparable.
    """
    try:
        from sklearn.datasets import load_digits  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ImportError(
            "retune demo needs scikit-learn for its dataset (the digits ship inside it; nothing is "
            "downloaded): pip install scikit-learn"
        ) from exc
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)

    def split(mask: torch.Tensor, offset: int) -> tuple[TensorDataset, TensorDataset]:
        idx = torch.nonzero(mask).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_val = int(len(idx) * val_fraction)
        val, train = idx[:n_val], idx[n_val:]
        if limit is not None:
            train = train[:limit]
        return (
            TensorDataset(images[train], labels[train] - offset),
            TensorDataset(images[val], labels[val] - offset),
        )

    pre_train, pre_val = split(labels < 5, 0)
    fine_train, fine_val = split(labels >= 5, 5)
    return DigitSplits(pre_train, pre_val, fine_train, fine_val)


# -- the network -----------------------------------------------------------------------------------


def make_backbone() -> nn.Sequential:
    """Two 3x3 conv layers and a dense layer: 8x8x1 -> FEATURES features (about 38k parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, FEATURES),
        nn.ReLU(),
    )


def accuracy(backbone: nn.Module, head: nn.Module, data: TensorDataset) -> float:
    """Top-1 accuracy of ``head(backbone(x))`` on ``data``, in eval mode, without gradients."""
    was_training = backbone.training, head.training
    backbone.eval()
    head.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=EVAL_BATCH_SIZE):
            correct += int((head(backbone(x)).argmax(dim=1) == y).sum())
    backbone.train(was_training[0])
    head.train(was_training[1])
    return correct / max(1, len(data))


def pretrain(backbone: nn.Module, splits: DigitSplits, epochs: int, seed: int) -> float:
    """Train ``backbone`` with a throwaway head on digits 0-4 (plain PyTorch); return its val accuracy.

    This stands in for the pretrained checkpoint a real fine-tune starts from; it is not part of
    what retune tunes, so it runs at a fixed batch size without Lightning.
    """
    torch.manual_seed(seed)
    head = nn.Linear(FEATURES, 5)
    params = [*backbone.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=2e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for x, y in DataLoader(splits.pretrain_train, batch_size=32, shuffle=True, generator=g):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(head(backbone(x)), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
    return accuracy(backbone, head, splits.pretrain_val)


# -- the simulated device --------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerFootprint:
    """One leaf module's per-sample sizes, measured once from a real forward pass."""

    name: str
    in_bytes: int
    out_bytes: int  # 0 when the output is a view of the input (Flatten)


@dataclass(frozen=True)
class MemoryEstimate:
    """Modelled bytes of one training step: ``fixed + batch_size * per_sample``."""

    weights: int
    optimizer_state: int
    per_sample: int
    batch_size: int

    @property
    def fixed(self) -> int:
        return self.weights + self.optimizer_state

    @property
    def total(self) -> int:
        return self.fixed + self.batch_size * self.per_sample


class SimulatedDevice:
    """A device memory limit for CPU runs: raises ``torch.OutOfMemoryError`` past ``budget_bytes``.

    This is a *simulation*, there so that the batch size changes visibly on a CPU; retune's own
    searches see only the error, as they would on a GPU. The byte model is built from the real
    network (layer output shapes from one forward pass, real parameter counts and dtypes):

    * weights: every parameter, frozen or not;
    * optimizer side: per trainable parameter, its gradient and Adam's two moments
      (:data:`STATE_COPIES_PER_TRAINABLE_PARAM` copies);
    * per sample: the input, plus the larger of (a) the forward working set of the frozen prefix
      (one layer's input and output alive at once; nothing is kept for backward) and (b) what
      autograd keeps from the first trainable layer on (that layer's input and every later
      layer's output) plus the backward working set (the gradients of the largest activation,
      in and out).

    Unfreezing the backbone therefore raises both the per-sample cost (activations kept for
    backward) and the fixed cost (gradients and Adam state), as on a real accelerator.
    """

    def __init__(self, model: nn.Module, sample: torch.Tensor, budget_bytes: int, enforce: bool = True) -> None:
        self.budget_bytes = budget_bytes
        self.enforce = enforce  # False: only estimate (the demo's "measured" mode leaves limits to retune)
        self.input_bytes = sample[:1].nelement() * sample.element_size()
        self.layers = self._measure(model, sample[:1])

    @staticmethod
    def _measure(model: nn.Module, sample: torch.Tensor) -> list[tuple[LayerFootprint, nn.Module]]:
        found: list[tuple[LayerFootprint, nn.Module]] = []

        def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
            def record(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
                x = inputs[0]
                in_bytes = x.nelement() * x.element_size()
                same = output.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                out_bytes = 0 if same else output.nelement() * output.element_size()
                found.append((LayerFootprint(name, in_bytes, out_bytes), module))

            return record

        leaves = [(n, m) for n, m in model.named_modules() if n and not list(m.children())]
        handles = [m.register_forward_hook(hook(n)) for n, m in leaves]
        try:
            with torch.no_grad():
                model(sample)
        finally:
            for h in handles:
                h.remove()
        return found

    def estimate(self, batch_size: int, model: nn.Module) -> MemoryEstimate:
        """The modelled bytes of one training step of ``model`` at ``batch_size``, as it is frozen now."""
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        first = next(
            (i for i, (_, m) in enumerate(self.layers) if any(p.requires_grad for p in m.parameters(recurse=False))),
            len(self.layers),
        )
        prefix = [fp for fp, _ in self.layers[:first]]
        kept = [fp for fp, _ in self.layers[first:]]
        forward_prefix = max((fp.in_bytes + fp.out_bytes for fp in prefix), default=0)
        saved = (kept[0].in_bytes if kept else 0) + sum(fp.out_bytes for fp in kept)
        backward = 2 * max((fp.out_bytes for fp in kept), default=0)
        per_sample = self.input_bytes + max(forward_prefix, saved + backward)
        return MemoryEstimate(weights, STATE_COPIES_PER_TRAINABLE_PARAM * trainable, per_sample, batch_size)

    def largest_batch(self, model: nn.Module) -> int:
        """The true maximum batch size under the budget, as ``model`` is frozen now (0 if none fits)."""
        e = self.estimate(1, model)
        return max(0, (self.budget_bytes - e.fixed) // e.per_sample)

    def check(self, batch_size: int, model: nn.Module) -> MemoryEstimate:
        """Return the estimate, or raise the real ``torch.OutOfMemoryError`` when it exceeds the budget."""
        e = self.estimate(batch_size, model)
        if self.enforce and e.total > self.budget_bytes:
            raise torch.OutOfMemoryError(
                f"out of memory (simulated device): tried to allocate {e.total - self.budget_bytes} bytes more "
                f"than the {self.budget_bytes}-byte budget at batch size {batch_size}"
            )
        return e


# -- the Lightning side ----------------------------------------------------------------------------


class DigitsFineTune(pl.LightningModule):  # type: ignore[misc]
    """Fine-tunes a pretrained ``backbone`` with a new head on digits 5-9.

    ``backbone`` is the attribute ``BackboneFinetuning`` freezes and unfreezes; ``batch_size`` is
    the attribute retune tunes and ``train_dataloader()`` reads. Each real training step consults
    the simulated device (probes too: that is where their out-of-memory errors come from).
    """

    def __init__(self, backbone: nn.Module, splits: DigitSplits, device_limit: SimulatedDevice, lr: float) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(FEATURES, 5)
        self.batch_size = 16
        self.lr = lr
        self.splits = splits
        self.device_limit = device_limit
        self.step_sizes: list[tuple[int, int]] = []
        self.step_memory: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.device_limit.check(x.shape[0], self)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=x.shape[0])
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # real steps only: retune's probes call training_step directly, not this hook
        step = int(self.trainer.global_step)
        self.step_sizes.append((step, self.batch_size))
        self.step_memory.append((step, self.device_limit.estimate(self.batch_size, self).total))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        acc = (self(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", acc, on_epoch=True, batch_size=x.shape[0])

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.splits.finetune_train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.splits.finetune_val, batch_size=EVAL_BATCH_SIZE)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # BackboneFinetuning adds the backbone as a second param group when it unfreezes it
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class EpochLines(pl.Callback):  # type: ignore[misc]
    """One line per epoch (size, what is trainable, simulated memory, val accuracy), bar-safe."""

    def __init__(self, device_limit: SimulatedDevice | None, write: Callable[[str], None]) -> None:
        self.device_limit = device_limit
        self.write = write
        self.val_acc: list[float] = []

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        acc = trainer.callback_metrics.get("val_acc")
        value = float(acc) if acc is not None else float("nan")
        self.val_acc.append(value)
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        total = sum(p.numel() for p in pl_module.parameters())
        memory = ""
        if self.device_limit is not None:
            used = self.device_limit.estimate(pl_module.batch_size, pl_module).total
            budget = report.format_bytes(self.device_limit.budget_bytes)
            memory = f", simulated memory {report.format_bytes(used)} of {budget}"
        self.write(
            f"epoch {trainer.current_epoch}: batch size {pl_module.batch_size}, "
            f"{trainable:,} of {total:,} parameters trainable{memory}, val accuracy {value:.3f}"
        )


# -- the run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    """The demo's options (``retune demo --help`` documents the same)."""

    schedule: str | Path | None = None
    epochs: int = DEFAULT_EPOCHS
    budget: str | None = None
    out: Path = DEFAULT_OUT
    seed: int = 0
    unfreeze_at: int = DEFAULT_UNFREEZE_AT
    pretrain_epochs: int = DEFAULT_PRETRAIN_EPOCHS
    limit: int | None = None
    progress_bar: bool | None = None  # None: only when stdout is a terminal
    lr: float = 1e-2
    threads: int = 1
    memory: str = "simulated"  # or "measured": retune's own budget on measured peaks, no simulation


@dataclass
class DemoResult:
    """What the demo reports, for the CLI and for tests."""

    history: list[RetuneEvent]
    accuracy: float
    frozen_accuracy: float | None
    pretrain_accuracy: float
    epoch_accuracy: list[float]
    budget_bytes: int
    true_max: dict[str, int] | None  # the simulated device's exact maxima; None in measured mode
    outputs: report.OutputPaths
    seconds: float
    lines: list[str] = field(default_factory=list)


def resolve_schedule(
    source: str | Path | None, budget: str | None, memory_mode: str = "simulated"
) -> tuple[RetuneSchedule, int, str, str]:
    """The schedule the finder runs, the budget in bytes, and where each came from.

    The schedule file is checked first as ``retune validate`` checks it, so a bad file gets the same
    message. The budget is ``--budget`` if given (checked by the rules of ``memory.budget``), else
    the schedule's ``memory.budget``, else :data:`DEFAULT_BUDGET`. It must be an absolute size: a
    CPU has no "total memory" for a fraction to apply to. With ``memory_mode="simulated"`` it is
    removed from the schedule handed to the finder and enforced by :class:`SimulatedDevice`; with
    ``"measured"`` it stays in the schedule and retune holds each probe's measured peak to it.
    """
    if source is None:
        if SCHEDULE_FILE.exists():
            data, name = read_schedule_file(SCHEDULE_FILE), "schedules/freeze_unfreeze.yaml"
        else:  # pragma: no cover - installed from a wheel
            data, name = copy.deepcopy(dict(BUILTIN_SCHEDULE)), "freeze_unfreeze (built-in copy)"
    else:
        data, name = read_schedule_file(Path(source)), str(source)
    written = validate_data(data, name).memory.budget  # `retune validate`'s checks and message first
    value: float | str
    if budget is not None:
        value, origin = _budget_option(budget), "--budget"
    elif written is not None:
        value, origin = written, "the schedule's memory.budget"
    else:
        value, origin = DEFAULT_BUDGET, "the demo's default"
    if not isinstance(value, str):
        raise ScheduleError(name, [FieldProblem("memory.budget", f"{value!r}: {_NOT_A_FRACTION}")])
    budget_bytes = parse_byte_size(value)  # validated above: a size with a unit
    memory = dict(data.get("memory") or {})  # validated above: a mapping or nothing
    memory["budget"] = value if memory_mode == "measured" else None
    schedule = validate_data({**data, "memory": memory}, name)
    return schedule, budget_bytes, name, f"{report.format_bytes(budget_bytes)} ({origin})"


_NOT_A_FRACTION = "the demo runs on a CPU and needs an absolute size such as '2MiB', not a fraction"


def _budget_option(text: str) -> str:
    """``--budget``, checked by the rules of the schedule's ``memory.budget``, then as the demo needs it."""
    try:
        value = MemoryConfig.model_validate({"budget": text}).budget
    except ValidationError as exc:
        message = "; ".join(err["msg"].removeprefix("Value error, ") for err in exc.errors())
        raise ScheduleError("--budget", [FieldProblem("", message)]) from None
    if not isinstance(value, str):
        raise ScheduleError("--budget", [FieldProblem("", f"{text!r}: {_NOT_A_FRACTION}")])
    return value


def _check_out(out: Path) -> None:
    """Refuse an output folder that is a file (or lies inside one) before anything runs."""
    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            inside = "" if folder == out else f" (in --out {str(out)!r})"
            raise ValueError(f"--out: {str(folder)!r} is a file, not a folder{inside}")


def _seed_everything(seed: int) -> None:
    """``seed_everything`` without its log line: Lightning 2 takes ``verbose``; 1.9 has no such argument (its
    "Global seed set" line is an INFO record, which :func:`_quiet_lightning` already hides)."""
    if "verbose" in inspect.signature(pl.seed_everything).parameters:
        pl.seed_everything(seed, verbose=False)
    else:
        pl.seed_everything(seed)


def _console(line: str) -> None:
    """Print to stdout above any live progress bar, never through it."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)


def run_demo(config: DemoConfig, write: Callable[[str], None] = _console) -> DemoResult:
    """Pretrain, fine-tune with the finder under the budget, write the report files; return the result.

    Runs on ``config.threads`` torch threads (1 by default) and restores the caller's setting:
    convolutions on 8x8 images gain nothing from more threads, and on a busy 2-core machine two
    threads per process made each step ten times slower in our measurements.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        with _quiet_lightning():
            return _run(config, write)
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Keep the demo's console to the story: Lightning's start-up notes (accelerators, a logger tip)
    and a deprecation warning it triggers on recent torch are not about retune. Warnings that
    matter (and retune's own lines) still show."""
    names = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
    levels = {name: logging.getLogger(name).level for name in names}
    try:
        for name in names:
            logging.getLogger(name).setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _run(config: DemoConfig, write: Callable[[str], None]) -> DemoResult:
    started = time.perf_counter()
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        write(line)

    if config.epochs < 1:
        raise ValueError("--epochs must be at least 1")
    if config.unfreeze_at < 0:
        raise ValueError("--unfreeze-at must be >= 0")
    if config.memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {', '.join(MEMORY_MODES)}, got {config.memory!r}")
    simulated = config.memory == "simulated"
    schedule, budget_bytes, schedule_name, budget_text = resolve_schedule(config.schedule, config.budget, config.memory)
    out = Path(config.out)
    _check_out(out)
    _seed_everything(config.seed)
    splits = load_digit_splits(config.seed, config.limit)

    say(f"retune demo: fine-tune a small CNN on scikit-learn's handwritten digits (CPU, seed {config.seed})")
    say(
        f"  data: pretrain on digits 0-4 ({len(splits.pretrain_train)} train / {len(splits.pretrain_val)} val), "
        f"fine-tune on digits 5-9 ({len(splits.finetune_train)} / {len(splits.finetune_val)})"
    )
    kinds = "+".join(t.kind for t in schedule.triggers)
    say(f"  schedule: {schedule_name} (mode={schedule.search.mode}, triggers={kinds})")

    backbone = make_backbone()
    t0 = time.perf_counter()
    pretrain_acc = pretrain(backbone, splits, config.pretrain_epochs, config.seed)
    say(
        f"  pretrained the backbone on digits 0-4: {_count(config.pretrain_epochs, 'epoch')}, "
        f"val accuracy {pretrain_acc:.3f} ({time.perf_counter() - t0:.1f}s)"
    )

    sample = splits.finetune_train.tensors[0][:1]
    probe_model = nn.Sequential(backbone, nn.Linear(FEATURES, 5))
    device_limit = SimulatedDevice(probe_model, sample, budget_bytes, enforce=simulated)
    model = DigitsFineTune(backbone, splits, device_limit, lr=config.lr)
    frozen_max, unfrozen_max, smallest = _phase_maxima(model, device_limit)
    if simulated and unfrozen_max < 1:
        raise ValueError(
            f"memory budget {budget_text} is too small for the demo: not even a batch of 1 fits once the "
            f"backbone is unfrozen, which needs about {report.format_bytes(smallest)}"
        )
    if simulated:
        say(
            f"  memory budget: {budget_text}, enforced by a simulated device (retune/demo.py): "
            f"largest batch {frozen_max} with the backbone frozen, {unfrozen_max} unfrozen"
        )
    else:
        say(f"  memory budget: {budget_text}, held by retune to each probe's measured peak (tensor bytes)")
    say(
        f"fine-tuning on digits 5-9 for {_count(config.epochs, 'epoch')}; BackboneFinetuning unfreezes the backbone "
        f"at epoch {config.unfreeze_at} (epochs count from 0)"
    )

    progress = sys.stdout.isatty() if config.progress_bar is None else config.progress_bar
    # the demo writes richer outputs itself (per-step sizes and memory); the finder prints the table
    finder = ScheduledBatchSizeFinder(schedule, write_report=False)
    unfreeze = pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=config.unfreeze_at)
    epoch_lines = EpochLines(device_limit if simulated else None, say)
    logger = pl.loggers.CSVLogger(save_dir=str(out), name="logs")  # a new version_N per run
    trainer = pl.Trainer(
        max_epochs=config.epochs,
        accelerator="cpu",
        devices=1,
        callbacks=[unfreeze, finder, epoch_lines],
        logger=logger,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=progress,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    trainer.fit(model)

    final_acc = accuracy(model.backbone, model.head, splits.finetune_val)
    true_max = {"frozen": frozen_max, "unfrozen": unfrozen_max} if simulated else None
    frozen_epochs = [a for i, a in enumerate(epoch_lines.val_acc) if i < config.unfreeze_at]
    outputs = report.write_outputs(
        finder.history,
        out,
        steps=model.step_sizes,
        memory=model.step_memory if simulated else None,
        memory_label="simulated step memory" if simulated else "peak memory",
        budget_bytes=budget_bytes,
        end_step=int(trainer.global_step),
        meta={
            "source": "retune demo",
            "schedule": schedule_name,
            "seed": config.seed,
            "epochs": config.epochs,
            "unfreeze_at": config.unfreeze_at,
            "accuracy": final_acc,
            "memory": config.memory,
            "true_max": true_max,
        },
    )
    say("")
    frozen_note = (
        f" (backbone frozen: {frozen_epochs[-1]:.3f} at epoch {len(frozen_epochs) - 1})" if frozen_epochs else ""
    )
    say(f"accuracy on digits 5-9 ({len(splits.finetune_val)} held-out images): {final_acc:.3f}{frozen_note}")
    files = [outputs.json, outputs.csv] + ([outputs.png] if outputs.png else [])
    say(f"outputs: {', '.join(str(p) for p in files)}; Lightning's metrics.csv in {logger.log_dir}")
    seconds = time.perf_counter() - started
    say(f"finished in {seconds:.1f}s")
    return DemoResult(
        history=list(finder.history),
        accuracy=final_acc,
        frozen_accuracy=frozen_epochs[-1] if frozen_epochs else None,
        pretrain_accuracy=pretrain_acc,
        epoch_accuracy=list(epoch_lines.val_acc),
        budget_bytes=budget_bytes,
        true_max=true_max,
        outputs=outputs,
        seconds=seconds,
        lines=lines,
    )


def _count(n: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _phase_maxima(model: DigitsFineTune, device_limit: SimulatedDevice) -> tuple[int, int, int]:
    """The true largest batch with the backbone frozen and unfrozen (the simulation knows them exactly), and the
    smallest budget in bytes under which a batch of 1 fits unfrozen."""
    saved = [p.requires_grad for p in model.backbone.parameters()]
    try:
        for p in model.backbone.parameters():
            p.requires_grad = False
        frozen = device_limit.largest_batch(model)
        for p in model.backbone.parameters():
            p.requires_grad = True
        unfrozen = device_limit.largest_batch(model)
        smallest = device_limit.estimate(1, model).total
    finally:
        for p, flag in zip(model.backbone.parameters(), saved, strict=True):
            p.requires_grad = flag
    return frozen, unfrozen, smallest


__all__ = [
    "DEFAULT_BUDGET",
    "DemoConfig",
    "DemoResult",
    "MemoryEstimate",
    "SimulatedDevice",
    "load_digit_splits",
    "resolve_schedule",
    "run_demo",
]
