"""Integrations with fine-tuning libraries that change what a training step needs mid-run.

Each integration lives in its own module and imports its library there, so ``import retune`` never
pulls in an optional dependency:

* :mod:`retune.integrations.flash` — lightning-flash fine-tuning strategies (``no_freeze``,
  ``freeze``, ``freeze_unfreeze``, ``unfreeze_milestones``) that re-tune the batch size in the same
  epoch-start hook in which they unfreeze. Needs ``lightning-flash`` (see ``requirements/flash.txt``).
"""

__all__: list[str] = []  # import retune.integrations.flash explicitly: it needs lightning-flash
