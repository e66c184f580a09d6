"""Scripts that run 2 CPU ranks under DDP (each started by a test in a subprocess with a timeout)."""

from __future__ import annotations

from typing import Any


def ddp_trainer(callbacks: list[Any], **kwargs: Any) -> Any:
    """A Trainer on 2 CPU ranks under DDP for one epoch, with nothing beyond the run itself (no logger,
    checkpoints, progress bar or model summary); ``kwargs`` add to or override these."""
    from tests.helpers.lightning_ns import pl

    settings: dict[str, Any] = {
        "strategy": "ddp",
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(callbacks=callbacks, **{**settings, **kwargs})
