"""The Lightning namespace the tests run against: `lightning.pytorch` when installed, else `pytorch_lightning`.

Set RETUNE_TEST_NAMESPACE=pytorch_lightning to force the other one (CI runs both).
"""

from __future__ import annotations

import importlib
import os

_name = os.environ.get("RETUNE_TEST_NAMESPACE")
if _name is None:
    try:
        importlib.import_module("lightning.pytorch")
        _name = "lightning.pytorch"
    except ImportError:
        _name = "pytorch_lightning"

pl = importlib.import_module(_name)
callbacks = importlib.import_module(_name + ".callbacks")
NAMESPACE = _name
LEGACY = int(pl.__version__.split(".")[0]) < 2

# -- what differs between the two Lightning lines the tests run on --------------------------------

PRECISION_32: str | int = 32 if LEGACY else "32-true"
"""Full precision: 1.9 takes ``32``; 2.x names it ``"32-true"``."""
PRECISION_BF16: str = "bf16" if LEGACY else "bf16-mixed"
"""bf16 autocast: 1.9 names it ``"bf16"``; 2.x ``"bf16-mixed"``."""


def seed(value: int) -> int:
    """``seed_everything`` without its log line (1.9 has no ``verbose`` argument and logs at INFO)."""
    if LEGACY:
        return int(pl.seed_everything(value))
    return int(pl.seed_everything(value, verbose=False))
