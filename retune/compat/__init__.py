"""Every Lightning internal retune touches, for both supported lines, in one package.

Two Lightning lines are supported: 2.x (``pytorch_lightning`` and ``lightning.pytorch``) and 1.9
(``pytorch_lightning`` 1.9.5, which lightning-flash pins); see :mod:`retune.compat.namespace`. Nothing
outside this package imports Lightning or reads a private trainer attribute. One module per concern:

* :mod:`~retune.compat.namespace`: which Lightning a trainer comes from, and its modules;
* :mod:`~retune.compat.batch_attr`: the batch-size attribute, through Lightning's own lookup;
* :mod:`~retune.compat.data`: the user's dataloader hooks called at a candidate size, loaders rebuilt
  for the epoch that starts, batches moved as the loops move them;
* :mod:`~retune.compat.epoch_length`: the epoch's training batches recounted when the loader's length changed;
* :mod:`~retune.compat.combined_loaders`: what a dataloader hook returned, iterated as the loops do;
* :mod:`~retune.compat.loops`: which loop runs a stage, where a training batch is, how many batches a
  fit restored mid-epoch counts as trained;
* :mod:`~retune.compat.stage_steps`: one real step of a stage outside the loop (a probe), hooks hidden;
* :mod:`~retune.compat.closure_runner`: the ``oom`` trigger's closure runner and ``self.log`` interceptor;
* :mod:`~retune.compat.logs`: where ``self.log`` writes, and where retune's files go;
* :mod:`~retune.compat.state`: trainer state a probe can change (progress, schedulers, accumulation);
* :mod:`~retune.compat.distributed`: whether ranks must agree, and how they exchange a decision;
* :mod:`~retune.compat.strategies`: which strategies retune serves or refuses (FSDP2, DDP, FSDP1, DeepSpeed);
* :mod:`~retune.compat.hooks`: a LightningModule's step hooks called with the arguments Lightning passes;
* :mod:`~retune.compat.batch_attr`: the batch-size attribute, found and written as Lightning's tuner does.

The functions the rest of retune calls are re-exported here (``compat.request_dataloader(...)``).
"""

from __future__ import annotations

from retune.compat.batch_attr import (
    batch_attr_places,
    get_batch_attr,
    has_batch_attr,
    lr_attribute_values,
    scale_lr_attributes,
    set_batch_attr,
    set_lr_attributes,
    write_lr_attributes,
)
from retune.compat.combined_loaders import length_of, train_loaders
from retune.compat.data import (
    batch_to_device,
    check_source,
    convert_input,
    dataloader_hook,
    dataloader_source,
    dataset_length,
    eval_dataloaders,
    iterators_ahead,
    probe_batches,
    reload_dataloader,
    request_dataloader,
    transfer_batch,
    watch_eval_iterator,
)
from retune.compat.distributed import (
    all_gather_object,
    broadcast_object,
    check_strategy,
    ddp_wrapper,
    is_ddp,
    is_distributed,
    sharded_across,
    shares_out_samplers,
    unshare_spawned_weights,
)
from retune.compat.epoch_length import refresh_train_batches, sampler_epoch
from retune.compat.hooks import truncated_bptt_steps
from retune.compat.logs import (
    eval_logging,
    journal_logged_metrics,
    log_dir,
    micro_batch_logging,
    refresh_progress_bar,
    save_logged_metrics,
)
from retune.compat.loops import batch_index, batch_is_accumulating, logger_step, resumed_batches, trainer_fn
from retune.compat.namespace import callback_base_classes, is_legacy, namespace_of, without_attached
from retune.compat.stage_steps import StepMarks, hooks_isolated, run_step, step_marks, training_step, wrap_eval_step
from retune.compat.state import (
    accumulation_is_scheduled,
    cycle_schedulers,
    fts_phase,
    get_accumulation,
    grad_scaler,
    loop_counters,
    loop_progress,
    lr_holders,
    lr_schedulers,
    reduced_precision,
    remaining_optimizer_steps,
    set_accumulation,
)
from retune.compat.strategies import check_oom_trigger, is_sharded, strategy_kind

__all__ = [
    "StepMarks",
    "accumulation_is_scheduled",
    "all_gather_object",
    "batch_attr_places",
    "batch_index",
    "batch_is_accumulating",
    "batch_to_device",
    "broadcast_object",
    "callback_base_classes",
    "check_oom_trigger",
    "convert_input",
    "check_source",
    "check_strategy",
    "dataloader_hook",
    "dataloader_source",
    "dataset_length",
    "ddp_wrapper",
    "eval_dataloaders",
    "eval_logging",
    "fts_phase",
    "get_accumulation",
    "get_batch_attr",
    "grad_scaler",
    "reduced_precision",
    "has_batch_attr",
    "hooks_isolated",
    "is_ddp",
    "is_distributed",
    "iterators_ahead",
    "length_of",
    "is_legacy",
    "is_sharded",
    "journal_logged_metrics",
    "log_dir",
    "loop_counters",
    "loop_progress",
    "lr_attribute_values",
    "lr_holders",
    "cycle_schedulers",
    "lr_schedulers",
    "remaining_optimizer_steps",
    "micro_batch_logging",
    "namespace_of",
    "probe_batches",
    "refresh_progress_bar",
    "refresh_train_batches",
    "reload_dataloader",
    "request_dataloader",
    "logger_step",
    "resumed_batches",
    "run_step",
    "sampler_epoch",
    "save_logged_metrics",
    "set_accumulation",
    "set_batch_attr",
    "scale_lr_attributes",
    "set_lr_attributes",
    "write_lr_attributes",
    "shares_out_samplers",
    "sharded_across",
    "step_marks",
    "strategy_kind",
    "train_loaders",
    "trainer_fn",
    "training_step",
    "transfer_batch",
    "truncated_bptt_steps",
    "unshare_spawned_weights",
    "without_attached",
    "watch_eval_iterator",
    "wrap_eval_step",
]
