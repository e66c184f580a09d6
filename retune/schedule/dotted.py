"""Dotted paths to user functions in a schedule (``search.sample_size``, an ``oom`` trigger's ``loss_items``).

A path is resolved when the schedule is validated, so ``retune validate`` and the callback refuse the
same schedules: a path that does not import, names no attribute or names something that is not a
function is a :class:`~retune.errors.ScheduleError` naming the field, never an OK from the validator
followed by a refusal at fit time. Resolving imports the user's module, as the training script would;
nothing here imports torch or Lightning (the module may).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

DOTTED_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*[.:][A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
"""``package.module.function`` or ``package.module:function`` (attributes may be nested after the colon)."""


def resolve_dotted(path: str, signature: str) -> Callable[..., Any]:
    """The callable ``path`` names; ``signature`` (e.g. ``"fn(sample) -> int"``) is what the message asks for.

    Raises ValueError that says what failed (the module's import and its error, the attribute, or the
    value that is not callable); the caller adds the field and the schedule's source.
    """
    module_name, sep, attr_path = path.partition(":")
    if not sep:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"{path!r} is not a dotted path to a function, e.g. 'mypkg.sizes.tokens'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} of {path!r}: {exc}") from None
    except Exception as exc:  # the user's module raised while importing: say so, not a traceback from validation
        raise ValueError(f"importing module {module_name!r} of {path!r} raised {type(exc).__name__}: {exc}") from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr_path!r} (from {path!r})") from None
    if not callable(obj):
        raise ValueError(f"{path!r} is a {type(obj).__name__}, not a function {signature}")
    fn: Callable[..., Any] = obj
    return fn


__all__ = ["DOTTED_RE", "resolve_dotted"]
