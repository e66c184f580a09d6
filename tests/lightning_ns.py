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
