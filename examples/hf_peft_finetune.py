"""Hugging Face transformers + PEFT LoRA text classification, re-tuning the batch size mid-run.

A small BERT (``BertConfig``, random weights: nothing is downloaded) classifies token sequences of
varying length, batched with dynamic padding into ``BatchEncoding`` dicts (``input_ids``,
``attention_mask``, ``labels``). PEFT's LoRA trains adapters on the attention's query and value
projections plus the classifier; ``UnfreezeTopLayer`` (a ``BaseFinetuning`` callback) unfreezes the
top encoder layer at ``--unfreeze-at`` and adds it to the optimizer. From then on a step also needs
that layer's weight gradients, their AdamW state and the inputs its linear layers keep for them, so
the schedule ``examples/hf_peft_schedule.yaml`` searches again when the trainable parameters and
the optimizer's param groups change::

    python examples/hf_peft_finetune.py                  # CPU, the schedule's memory budget
    python examples/hf_peft_finetune.py --budget none --accelerator gpu   # real OOM on a GPU

The data needs no tokenizer: each sample is ``[CLS]`` followed by 6 to 24 random word ids, and its
label says whether the keyword id occurs in it (half the samples have it, at a random position),
a rule attention can learn. For a real task, tokenize with your tokenizer and keep the collate:
retune only needs the batch size in ``self.batch_size``, read by ``train_dataloader()``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, Dataset
from transformers import BatchEncoding, BertConfig, BertForSequenceClassification

from retune import RetuneEvent, ScheduledBatchSizeFinder, load_schedule
from retune.reports import batch_size as report

SCHEDULE = Path(__file__).resolve().parent / "hf_peft_schedule.yaml"
PAD, CLS, KEYWORD = 0, 1, 2  # special ids; words are 3 .. vocab_size - 1


class KeywordDataset(Dataset[dict[str, Any]]):
    """``[CLS] w1 .. wn`` with n in [min_len, max_len]; label 1 when the keyword occurs, else 0."""

    def __init__(self, n: int, seed: int, vocab_size: int = 128, min_len: int = 6, max_len: int = 24) -> None:
        g = torch.Generator().manual_seed(seed)
        self.samples: list[dict[str, Any]] = []
        for i in range(n):
            length = int(torch.randint(min_len, max_len + 1, (), generator=g))
            words = torch.randint(KEYWORD + 1, vocab_size, (length,), generator=g)
            label = i % 2
            if label:
                words[int(torch.randint(0, length, (), generator=g))] = KEYWORD
            self.samples.append({"input_ids": torch.cat([torch.tensor([CLS]), words]), "labels": label})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


def pad_collate(samples: list[dict[str, Any]]) -> BatchEncoding:
    """Dynamic padding: every batch is padded to its own longest sequence, as
    ``DataCollatorWithPadding`` does, and comes out as the ``BatchEncoding`` a tokenizer returns."""
    longest = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), longest), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids = sample["input_ids"]
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
    labels = torch.tensor([s["labels"] for s in samples], dtype=torch.long)
    return BatchEncoding({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})


def build_model(hidden: int, layers: int, vocab_size: int, lora_r: int) -> torch.nn.Module:
    """A BERT classifier from its config (random weights) wrapped by PEFT: only LoRA and the head train."""
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 16),
        intermediate_size=4 * hidden,
        max_position_embeddings=64,
        num_labels=2,
    )
    lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=["query", "value"], task_type="SEQ_CLS")
    return get_peft_model(BertForSequenceClassification(config), lora)  # type: ignore[no-any-return]


def top_encoder_layer(peft_model: torch.nn.Module) -> torch.nn.Module:
    return peft_model.base_model.model.bert.encoder.layer[-1]  # type: ignore[no-any-return,union-attr,index]


class LoraClassifier(pl.LightningModule):
    def __init__(
        self,
        n_train: int = 512,
        batch_size: int = 8,
        hidden: int = 32,
        layers: int = 2,
        vocab_size: int = 128,
        lora_r: int = 8,
        lr: float = 1e-2,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size  # retune writes the size it finds here
        self.lr = lr
        self.model = build_model(hidden, layers, vocab_size, lora_r)
        self.train_set = KeywordDataset(n_train, seed=0, vocab_size=vocab_size)
        self.val_set = KeywordDataset(max(128, n_train // 4), seed=1, vocab_size=vocab_size)

    def training_step(self, batch: BatchEncoding, batch_idx: int) -> torch.Tensor:
        out = self.model(**batch)  # input_ids, attention_mask, labels -> out.loss
        self.log("train_loss", out.loss, on_step=False, on_epoch=True, batch_size=len(batch["labels"]))
        return out.loss  # type: ignore[no-any-return]

    def validation_step(self, batch: BatchEncoding, batch_idx: int) -> None:
        out = self.model(**batch)
        acc = (out.logits.argmax(dim=-1) == batch["labels"]).float().mean()
        self.log("val_loss", out.loss, batch_size=len(batch["labels"]))
        self.log("val_acc", acc, batch_size=len(batch["labels"]))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, collate_fn=pad_collate)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=256, collate_fn=pad_collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # what PEFT left trainable (LoRA + head); UnfreezeTopLayer adds the top layer as a new group
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class UnfreezeTopLayer(BaseFinetuning):  # type: ignore[misc]
    """Unfreeze the top encoder layer's own weights at ``unfreeze_at`` (PEFT froze them)."""

    def __init__(self, unfreeze_at: int, lr: float = 1e-3) -> None:
        super().__init__()
        self.unfreeze_at = unfreeze_at
        self.lr = lr

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        pass  # get_peft_model already froze everything but LoRA and the classifier

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.unfreeze_at:
            layer = top_encoder_layer(pl_module.model)
            in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
            self.make_trainable(layer)
            # a new group with the weights PEFT froze (the layer's LoRA adapters are in the optimizer already)
            optimizer.add_param_group(
                {"params": [p for p in layer.parameters() if id(p) not in in_optimizer], "lr": self.lr}
            )


def trainable(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


class EpochLog(pl.Callback):
    """One line per epoch: the batch sizes in use (per bucket), trainable parameters, train loss, val accuracy."""

    def __init__(self, quiet: bool, finder: ScheduledBatchSizeFinder) -> None:
        self.quiet = quiet
        self.finder = finder
        self.train_loss: list[float] = []
        self.sizes: list[int] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: LoraClassifier) -> None:
        metrics = trainer.callback_metrics
        self.train_loss.append(float(metrics["train_loss"]))
        self.sizes.append(pl_module.batch_size)
        if not self.quiet:
            total = sum(p.numel() for p in pl_module.parameters())
            buckets = self.finder.bucket_sizes  # batching: buckets (one size per length bucket)
            sizes = f"batch sizes {'/'.join(map(str, buckets))}" if buckets else f"batch size {pl_module.batch_size}"
            print(
                f"epoch {trainer.current_epoch}: {sizes}, "
                f"{trainable(pl_module):,} of {total:,} parameters trainable, "
                f"train loss {self.train_loss[-1]:.3f}, val accuracy {float(metrics['val_acc']):.3f}"
            )


@dataclass
class Result:
    history: list[RetuneEvent]
    batch_size: int | None
    epoch_sizes: list[int]
    train_loss: list[float]
    val_acc: float
    model: LoraClassifier
    initial_weights: dict[str, torch.Tensor]
    outputs: report.OutputPaths


def main(argv: Sequence[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--unfreeze-at", type=int, default=3, help="epoch the top encoder layer unfreezes at (from 0)")
    parser.add_argument("--samples", type=int, default=512, help="training samples")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--budget", default=None, help="override the schedule's memory.budget ('none' on a GPU)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--out", default="retune-hf-example", help="where the history, CSV and plot go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no per-trial lines")
    args = parser.parse_args(argv)

    pl.seed_everything(args.seed, verbose=False)
    schedule = load_schedule(SCHEDULE).model_dump(mode="json")
    if args.budget is not None:
        schedule["memory"]["budget"] = None if args.budget.lower() == "none" else args.budget
    finder = ScheduledBatchSizeFinder(schedule, verbose=not args.quiet)
    log = EpochLog(args.quiet, finder)

    model = LoraClassifier(n_train=args.samples, hidden=args.hidden, layers=args.layers)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator=args.accelerator,
        devices=1,
        callbacks=[UnfreezeTopLayer(args.unfreeze_at), finder, log],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.quiet,
    )
    trainer.fit(model)

    outputs = report.write_outputs(finder.history, args.out, end_step=trainer.global_step)
    if args.quiet:
        print(report.format_table(finder.history))  # a verbose finder printed it at fit end
    val_acc = float(trainer.callback_metrics["val_acc"])
    print(f"val accuracy {val_acc:.3f}; history, CSV and plot in {args.out}/")
    return Result(list(finder.history), finder.batch_size, log.sizes, log.train_loss, val_acc, model, before, outputs)


if __name__ == "__main__":
    main()
