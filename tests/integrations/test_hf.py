"""Hugging Face transformers + PEFT: the example, and ``BatchEncoding`` batches wherever retune touches one.

Main stack only (the ``hf`` extra); the Flash stack skips this file. Models are tiny BERTs built from
``BertConfig`` with random weights: nothing is downloaded. Budgets are real: the CPU tracker
measures every probe.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face tests need the `hf` extra (transformers)")
pytest.importorskip("peft", reason="the Hugging Face tests need the `hf` extra (peft)")
pytest.importorskip("lightning.pytorch", reason="the example uses the `lightning` package, which is not installed")

from torch.utils.data import DataLoader
from transformers import BatchEncoding, BertConfig, BertForSequenceClassification

from retune import ScheduledBatchSizeFinder
from retune.memory import tensor_bytes
from retune.reports import batch_size as report
from tests.helpers.lightning_ns import pl, seed

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    name = "retune_example_hf_peft_finetune"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "hf_peft_finetune.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their classes up by module
    spec.loader.exec_module(module)
    return module


def test_hf_peft_example_retunes_when_the_top_layer_unfreezes(tmp_path: Path) -> None:
    example = _example()
    out = tmp_path / "out"
    result = example.main(["--epochs", "3", "--unfreeze-at", "1", "--samples", "256", "--out", str(out), "--quiet"])

    frozen, unfrozen = result.history
    assert frozen.trigger == "fit_start"
    # BaseFinetuning adds the layer as a new param group: both triggers fire, one search
    assert set(unfrozen.trigger.split("+")) == {"trainable_params_changed", "param_groups_changed"}
    assert unfrozen.epoch == 1 and unfrozen.direction == "down"
    assert unfrozen.batch_size_after < frozen.batch_size_after, "the unfrozen layer needs more memory per step"
    assert result.epoch_sizes == [frozen.batch_size_after] + [unfrozen.batch_size_after] * 2
    budget = 3 * 2**20  # examples/hf_peft_schedule.yaml
    for event in result.history:
        assert event.budget_bytes == budget
        for (_, fits), peak in zip(event.trials, event.peak_bytes, strict=True):
            assert peak is not None and fits == (peak <= budget)

    # it trained: the loss fell, LoRA and the head moved, and the top layer's own weights moved only
    # once unfrozen (the layer below stayed frozen)
    assert result.train_loss[-1] < result.train_loss[0]
    after = dict(result.model.named_parameters())
    moved = {name for name, p in after.items() if not torch.equal(result.initial_weights[name], p.detach())}
    assert any("lora_A" in name for name in moved) and any("classifier" in name for name in moved)
    top = {n for n in moved if ".encoder.layer.1." in n and "lora_" not in n}
    assert any(n.endswith("intermediate.dense.weight") for n in top)
    assert not any(".encoder.layer.0." in n and "lora_" not in n for n in moved)
    assert report.read_history(result.outputs.json).events == result.history


def test_pad_collate_pads_each_batch_to_its_longest_sequence() -> None:
    example = _example()
    samples = [{"input_ids": torch.tensor([1, 5, 6]), "labels": 0}, {"input_ids": torch.tensor([1, 7]), "labels": 1}]
    batch = example.pad_collate(samples)
    assert isinstance(batch, BatchEncoding)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [0, 1]
    assert tensor_bytes(batch) == (6 + 6 + 2) * 8


# -- BatchEncoding batches through train and evaluation probes -------------------------------------


def _as_tuple(batch: BatchEncoding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch["input_ids"], batch["attention_mask"], batch["labels"]


class TinyBert(pl.LightningModule):  # type: ignore[misc,name-defined]
    """A BERT classifier whose loaders yield ``BatchEncoding`` (or, to compare, the same tensors in a tuple)."""

    def __init__(self, collate: str) -> None:
        super().__init__()
        example = _example()
        self.collate = example.pad_collate if collate == "encoding" else lambda s: _as_tuple(example.pad_collate(s))
        config = BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=2,
        )
        self.model = BertForSequenceClassification(config)
        self.data = example.KeywordDataset(256, seed=0, vocab_size=64)
        for stage in ("train", "val", "test", "predict"):
            setattr(self, f"{stage}_batch_size", 4)
        self.seen: list[type] = []

    def _outputs(self, batch: Any) -> Any:
        self.seen.append(type(batch))
        if isinstance(batch, tuple):
            ids, mask, labels = batch
            return self.model(input_ids=ids, attention_mask=mask, labels=labels)
        return self.model(**batch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._outputs(batch).loss  # type: ignore[no-any-return]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._outputs(batch).loss, batch_size=4)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._outputs(batch).loss, batch_size=4)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._outputs(batch).logits.argmax(-1)  # type: ignore[no-any-return]

    def _loader(self, stage: str) -> DataLoader[Any]:
        size = getattr(self, f"{stage}_batch_size")
        return DataLoader(self.data, batch_size=size, shuffle=stage == "train", collate_fn=self.collate)

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader[Any]:
        return self._loader("predict")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _staged_run(collate: str) -> tuple[TinyBert, ScheduledBatchSizeFinder]:
    seed(0)
    model = TinyBert(collate)
    schedule = {
        "search": {"mode": "binsearch", "init_val": 8, "steps_per_trial": 1, "max_val": 64, "margin": 0.0},
        "memory": {"budget": "1MiB"},
        "triggers": [{"kind": "fit_start"}],
        "stages": ["train", "val", "test", "predict"],
    }
    finder = ScheduledBatchSizeFinder(schedule, verbose=False)
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
        num_sanity_val_steps=0,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    trainer.test(model, verbose=False)
    trainer.predict(model)
    return model, finder


def test_batch_encoding_batches_are_probed_and_counted_like_plain_tensors_in_every_stage() -> None:
    encoded_model, encoded = _staged_run("encoding")
    plain_model, plain = _staged_run("tuple")
    assert [e.stage for e in encoded.history] == ["train", "val", "test", "predict"]
    assert set(encoded_model.seen) == {BatchEncoding} and set(plain_model.seen) == {tuple}
    for enc, ref in zip(encoded.history, plain.history, strict=True):
        assert enc.stage == ref.stage and len(enc.trials) >= 2
        # the same tensors in another container: the same trials and, to the byte, the same peaks,
        # the batch's own bytes included (a BatchEncoding once counted as 0 bytes)
        assert enc.trials == ref.trials
        assert enc.peak_bytes == ref.peak_bytes and all(p is not None for p in enc.peak_bytes)
        assert 1 < enc.batch_size_after < 64, "the budget, not the cap, set the size"
    assert encoded.batch_sizes == plain.batch_sizes
