"""Every Lightning internal retune touches, for both supported lines, in one place.

Two Lightning lines are supported: 2.x (``pytorch_lightning`` and ``lightning.pytorch``) and 1.9
(``pytorch_lightning`` 1.9.5, which lightning-flash pins). The namespace is taken from the
trainer's own class, never assumed, so a callback works with whichever ``Trainer`` the user built.
Nothing outside this module imports Lightning or reads a private trainer attribute.

Internals used and why:

* the train ``DataLoaderSource`` (2.x ``fit_loop._data_source``, 1.9
  ``_data_connector._train_dataloader_source``): probes need the user's dataloader *at a candidate
  size*, which only re-calling the user's ``train_dataloader`` hook gives;
* the fit loop's dataloader reload (2.x ``_combined_loader = None; setup_data()``, 1.9
  ``reset_train_dataloader``): the epoch that is about to start must run at the new size;
* the epoch loop's ``_results`` collection and the module's ``_current_fx_name``: swapped during a
  probe so ``self.log`` in ``training_step`` works and nothing it logs survives the probe;
* loop progress objects: counters a manual-optimization probe step increments.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from itertools import islice
from types import ModuleType
from typing import Any

import torch

from retune import combined_loaders, hook_calls
from retune.errors import RetuneError
from retune.sharded import check_strategy as check_strategy
from retune.sharded import strategy_kind as _strategy_kind

_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def namespace_of(trainer: Any) -> str:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"``: the package the trainer's class comes from."""
    for cls in type(trainer).__mro__:
        module = cls.__module__
        for ns in _NAMESPACES:
            if module == ns or module.startswith(ns + "."):
                return ns
    raise RetuneError(
        f"{type(trainer).__name__} is not a Lightning Trainer (from lightning.pytorch or pytorch_lightning)"
    )


@cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


@cache
def _major(ns: str) -> int:
    version = str(_module(ns).__version__)
    return int(version.split(".")[0])


def is_legacy(trainer: Any) -> bool:
    """True on Lightning 1.x (the 1.9 line Flash pins)."""
    return _major(namespace_of(trainer)) < 2


def callback_base_classes() -> tuple[type, ...]:
    """Lightning ``Callback`` classes of every installed namespace.

    retune's callback inherits from all of them so that ``isinstance`` checks (LightningCLI's
    ``trainer.callbacks`` type, the callback connector) pass whichever namespace the user uses.
    """
    bases: list[type] = []
    for ns in _NAMESPACES:
        try:
            callback = _module(ns + ".callbacks").Callback
        except ImportError:
            continue
        if callback not in bases:
            bases.append(callback)
    if not bases:
        raise ImportError("retune needs Lightning: pip install 'pytorch-lightning>=1.9' (or 'lightning')")
    return tuple(bases)


# -- the batch size attribute ------------------------------------------------------------------


def _parsing(trainer: Any) -> ModuleType:
    return _module(namespace_of(trainer) + ".utilities.parsing")


def has_batch_attr(trainer: Any, pl_module: Any, name: str) -> bool:
    return bool(_parsing(trainer).lightning_hasattr(pl_module, name))


def get_batch_attr(trainer: Any, pl_module: Any, name: str) -> int:
    value = _parsing(trainer).lightning_getattr(pl_module, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RetuneError(f"`{name}` must hold an int batch size, found {value!r}")
    return value


def set_batch_attr(trainer: Any, pl_module: Any, name: str, value: int) -> None:
    """Write ``value`` everywhere Lightning's lookup finds ``name`` (model, hparams, datamodule)."""
    _parsing(trainer).lightning_setattr(pl_module, name, value)


def batch_attr_places(trainer: Any, pl_module: Any, name: str) -> list[tuple[str, Any]]:
    """Every place Lightning's lookup finds ``name``, in its order, as ``("model.hparams.batch_size", 32)``
    pairs: ``set_batch_attr`` writes all of them, ``get_batch_attr`` reads the last."""
    datamodule = getattr(trainer, "datamodule", None)
    labels = [(pl_module, "model"), (datamodule, "datamodule")]
    labels += [(getattr(owner, "hparams", None), f"{label}.hparams") for owner, label in labels if owner is not None]
    places = []
    for holder in _parsing(trainer)._lightning_get_all_attr_holders(pl_module, name):
        label = next((text for obj, text in labels if obj is holder), type(holder).__name__)
        value = holder[name] if isinstance(holder, dict) else getattr(holder, name)
        places.append((f"{label}.{name}", value))
    return places


# -- data --------------------------------------------------------------------------------------


_HOOKS = {
    "train": "train_dataloader",
    "val": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}
_FIT_ARG = {"train": "train_dataloaders", "val": "val_dataloaders", "test": "dataloaders", "predict": "dataloaders"}


def _eval_loop(trainer: Any, stage: str) -> Any:
    """The 2.x loop that runs ``stage`` now: validation inside fit, or the validate/test/predict loop."""
    if stage == "val":
        return trainer.validate_loop if trainer_fn(trainer) == "validate" else trainer.fit_loop.epoch_loop.val_loop
    return trainer.test_loop if stage == "test" else trainer.predict_loop


def trainer_fn(trainer: Any) -> str:
    """``fit``, ``validate``, ``test`` or ``predict``: what the trainer is running."""
    fn = trainer.state.fn
    return str(getattr(fn, "value", fn))


def dataloader_hook(stage: str) -> str:
    return _HOOKS[stage]


def _source(trainer: Any, stage: str) -> Any:
    if is_legacy(trainer):
        return getattr(trainer._data_connector, f"_{'train' if stage == 'train' else stage}_dataloader_source")
    if stage == "train":
        return trainer.fit_loop._data_source
    return _eval_loop(trainer, stage)._data_source


def check_source(trainer: Any, stage: str) -> None:
    """Refuse dataloaders passed straight to ``fit()``/``test()``: their batch size cannot be changed."""
    if not _source(trainer, stage).is_module():
        hook = _HOOKS[stage]
        raise RetuneError(
            f"ScheduledBatchSizeFinder needs to rebuild the {stage} dataloader at new batch sizes, so it must "
            f"come from `{hook}()` of your LightningModule or LightningDataModule, not be passed to the trainer "
            f"(`{_FIT_ARG[stage]}=...`)."
        )


def request_dataloader(trainer: Any, stage: str) -> Any:
    """Call the user's ``<stage>_dataloader`` hook (at whatever batch size the attribute now holds)."""
    source = _source(trainer, stage)
    if is_legacy(trainer):
        return source.dataloader()
    return _module(namespace_of(trainer) + ".trainer.connectors.data_connector")._request_dataloader(source)


def reload_dataloader(trainer: Any, stage: str) -> None:
    """Make the loop that is about to run ``stage`` iterate a dataloader built at the current batch size."""
    set_epoch = _module(namespace_of(trainer) + ".loops.fit_loop")._set_sampler_epoch
    if is_legacy(trainer):
        getattr(trainer, f"reset_{stage}_dataloader")(trainer.lightning_module)
        if stage == "train":  # the loop set the epoch on the loader this one replaces (shuffle order)
            set_epoch(trainer.train_dataloader, trainer.fit_loop.epoch_progress.current.processed)
        return
    if stage == "train":
        loop = trainer.fit_loop
        loop._combined_loader = None
        loop.setup_data()
        # the loop gave the loader this one replaces its epoch (a DistributedSampler's shuffle order);
        # without it the new loader would replay epoch 0's order
        for loader in loop._combined_loader.flattened:
            set_epoch(loader, loop.epoch_progress.current.processed)
        return
    loop = _eval_loop(trainer, stage)
    loop._combined_loader = None
    if trainer_fn(trainer) == "fit":
        return  # validation inside fit rebuilds it when it next runs
    loop.setup_data()  # validate/test/predict: the loop is starting now, as in Lightning's own finder
    loop.reset()


def batch_to_device(trainer: Any, pl_module: Any, batch: Any, dataloader_idx: int | None = None) -> Any:
    """The same transfer the loops do: on 2.x the precision's ``convert_input`` (``16-true``, ``64-true``
    cast the inputs), then ``on_before_batch_transfer``, then the strategy's. The hooks get the batch's
    ``dataloader_idx`` (0 where the step does not take one, as Lightning passes them)."""
    convert_input = getattr(trainer.precision_plugin, "convert_input", None)
    if convert_input is not None and not is_legacy(trainer):
        batch = convert_input(batch)
    batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx or 0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=dataloader_idx or 0)


def probe_batches(
    trainer: Any, stage: str, loader: Any, steps: int
) -> Generator[tuple[Any, int, int | None], None, None]:
    """The batches of one trial, as the stage's loop feeds them: ``(batch, batch_idx, dataloader_idx)``.

    ``dataloader_idx`` is None where the loop does not pass one to the step. Training: ``steps``
    batches of what ``train_dataloader()`` returned, combined as the fit loop combines it
    (``combined_loaders.train_batches``: the user's ``CombinedLoader`` in its own mode).
    Evaluation: up to ``steps`` batches of each loader, one loader after another (``eval_batches``).
    Close the generator to end its loaders' workers.
    """
    if stage != "train":
        yield from eval_batches(trainer, stage, loader, steps)
        return
    batches = combined_loaders.train_batches(trainer, loader)
    try:
        for batch_idx in range(steps):
            yield next(batches), batch_idx, None
    finally:
        batches.close()


def eval_dataloaders(trainer: Any, loaders: Any) -> tuple[list[Any], bool]:
    """The loaders an evaluation loop runs, in its order, and whether its step gets ``dataloader_idx``.

    Lightning runs evaluation loaders one after another, never zipped. 2.x flattens what the hook
    returned (a list, tuple, dict or a nesting of them) with a ``sequential`` ``CombinedLoader`` and
    passes ``dataloader_idx`` to the step when there is more than one; a ``CombinedLoader`` the user
    built in another mode is one stream of combined batches, without ``dataloader_idx``. 1.9 runs
    the entries of a list or tuple (``None`` entries skipped), anything else as one loader, and
    passes ``dataloader_idx`` when there is more than one.
    """
    if is_legacy(trainer):
        flat = [dl for dl in loaders if dl is not None] if isinstance(loaders, (list, tuple)) else [loaders]
        return flat, len(flat) > 1
    combined_loader = _module(namespace_of(trainer) + ".utilities.combined_loader").CombinedLoader
    combined = loaders if isinstance(loaders, combined_loader) else combined_loader(loaders, "sequential")
    if combined._mode != "sequential":
        return [combined_loaders.Batches(combined)], False
    flat = list(combined.flattened)
    return flat, len(flat) > 1


def eval_batches(
    trainer: Any, stage: str, loaders: Any, steps: int
) -> Generator[tuple[Any, int, int | None], None, None]:
    """Up to ``steps`` batches of each evaluation loader in turn (an empty one is skipped, as Lightning
    skips it); ``dataloader_idx`` where the loop would pass it to the step, else None."""
    flat, pass_idx = eval_dataloaders(trainer, loaders)
    produced = False
    for dataloader_idx, loader in enumerate(flat):
        for batch_idx, batch in enumerate(islice(loader, steps)):
            produced = True
            yield batch, batch_idx, dataloader_idx if pass_idx else None
    if not produced:
        raise RetuneError(f"the {stage} dataloaders yielded no batches, so no {stage} batch size can be probed")


def dataset_length(loader: Any, world_size: int) -> int | None:
    """Samples one rank sees per epoch (see ``combined_loaders.dataset_length``)."""
    return combined_loaders.dataset_length(loader, world_size)


# -- running one training step outside the loop ------------------------------------------------


def _loss_of(output: Any) -> torch.Tensor | None:
    if output is None:
        return None
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else None
    if isinstance(loss, torch.Tensor):
        return loss
    raise RetuneError(
        f"training_step returned {type(output).__name__}; Lightning expects a loss tensor, "
        "a dict with a 'loss' key, or None"
    )


# -- distributed -------------------------------------------------------------------------------


def is_distributed(trainer: Any) -> bool:
    """More than one rank that must agree on every decision (DDP, or FSDP2 on several devices)."""
    return _strategy_kind(trainer) in ("ddp", "fsdp2") and int(getattr(trainer, "world_size", 1)) > 1


def is_ddp(trainer: Any) -> bool:
    """DDP on several ranks: every rank holds the whole model (a probe may run the unwrapped module)."""
    return _strategy_kind(trainer) == "ddp"


def unshare_spawned_weights(trainer: Any, pl_module: Any) -> bool:
    """Give this rank its own copy of weights that ``ddp_spawn`` left in shared memory; True if any were.

    torch.multiprocessing moves every CPU tensor handed to a spawned process into shared memory, so
    under pytorch-lightning < 2.1 all ranks of a CPU run train *one* set of weights and race on every
    optimizer step (Lightning issue #17399; 2.1 clones them in each process). A probe writes to the
    weights and its snapshot reads them, so a rank could capture another rank's half-finished probe
    and "restore" it. Cloning in ``setup``, before the optimizers and DDP exist, is what Lightning 2.1
    does, under the same conditions: the spawn start method on a CPU accelerator. Elsewhere shared
    memory is the user's choice (``share_memory_()``) or is about to be moved to a GPU, and is left alone.
    """
    strategy = trainer.strategy
    spawned_on_cpu = getattr(strategy, "_start_method", None) == "spawn" and strategy.root_device.type == "cpu"
    if not (is_ddp(trainer) and spawned_on_cpu):
        return False
    tensors = [*pl_module.parameters(), *pl_module.buffers()]
    shared = [t for t in tensors if t.device.type == "cpu" and t.is_shared()]
    with torch.no_grad():
        for tensor in shared:
            tensor.data = tensor.data.clone()
    return bool(shared)


def all_gather_object(trainer: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (just ``[obj]`` on a single device). One collective call."""
    if not is_distributed(trainer):
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(trainer: Any, obj: Any) -> Any:
    """Rank zero's ``obj`` on every rank (a no-op on a single device)."""
    if not is_distributed(trainer):
        return obj
    return trainer.strategy.broadcast(obj, src=0)


@contextmanager
def _no_ddp_sync(trainer: Any) -> Iterator[None]:
    """Keep DDP's reducer out of probe steps.

    A probe runs the unwrapped LightningModule, so DDP's forward never prepares the reducer and its
    gradient hooks return without communicating; manual optimization's ``manual_backward`` would
    prepare it through ``strategy.pre_backward``, which is silenced here. No collective runs inside
    a probe step, so a rank that runs out of memory cannot leave the others waiting.
    """
    strategy = trainer.strategy
    saved = {name: strategy.__dict__.get(name) for name in ("pre_backward", "post_backward")}
    strategy.pre_backward = lambda *args, **kwargs: None
    strategy.post_backward = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                strategy.__dict__.pop(name, None)
            else:
                setattr(strategy, name, value)


def _forward(trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> Any:
    """The user's ``training_step``, with the arguments Lightning would pass it (``hook_calls``)."""
    strategy = trainer.strategy
    if is_ddp(trainer):
        with strategy.precision_plugin.train_step_context():
            return hook_calls.call_step(trainer, pl_module, "train", batch, batch_idx)
    return strategy.training_step(*hook_calls.step_args(trainer, pl_module, "train", batch, batch_idx))


_EVAL_STEPS = {"val": ("validation_step", "val_step_context"), "test": ("test_step", "test_step_context")}
_EVAL_STEPS["predict"] = ("predict_step", "predict_step_context")


def run_step(
    trainer: Any, pl_module: Any, stage: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None
) -> None:
    """One real step of ``stage``: a training step, or an evaluation step as Lightning runs it (eval
    mode is set by the caller; no gradients, under ``inference_mode`` when the trainer uses it), with
    ``dataloader_idx`` as its third argument unless it is None (see ``eval_dataloaders``)."""
    if stage == "train":
        training_step(trainer, pl_module, batch, batch_idx)
        return
    _, context_name = _EVAL_STEPS[stage]
    precision = trainer.strategy.precision_plugin
    use_inference_mode = (
        trainer._inference_mode if is_legacy(trainer) else getattr(_eval_loop(trainer, stage), "inference_mode", True)
    )
    no_grad = torch.inference_mode() if use_inference_mode else torch.no_grad()
    with no_grad, getattr(precision, context_name)():
        hook_calls.call_step(trainer, pl_module, stage, batch, batch_idx, dataloader_idx)


ClosureWrapper = Callable[[Callable[[], "torch.Tensor | None"]], Callable[[], "torch.Tensor | None"]]


def training_step(
    trainer: Any, pl_module: Any, batch: Any, batch_idx: int, wrap_closure: ClosureWrapper | None = None
) -> torch.Tensor | None:
    """One real training step: forward, backward and optimizer step under the trainer's strategy and
    precision (autocast, grad scaler), without the loop's bookkeeping. Under DDP the step runs on the
    unwrapped module with the reducer kept out (see ``_no_ddp_sync``): same memory, no collectives.

    Returns the step's loss (None when ``training_step`` returned None). ``wrap_closure`` wraps the
    forward-and-backward closure (automatic optimization), so a caller can act between backward and
    the optimizer step, before gradient clipping (the range test averages gradients across ranks there).
    """
    if is_ddp(trainer):
        with _no_ddp_sync(trainer):
            return _training_step(trainer, pl_module, batch, batch_idx, wrap_closure)
    return _training_step(trainer, pl_module, batch, batch_idx, wrap_closure)


def _training_step(
    trainer: Any, pl_module: Any, batch: Any, batch_idx: int, wrap_closure: ClosureWrapper | None
) -> torch.Tensor | None:
    strategy = trainer.strategy
    legacy = is_legacy(trainer)
    if not pl_module.automatic_optimization:
        # the user's step does backward and step itself; what it returns is up to it (a loss, or nothing)
        output = _forward(trainer, pl_module, batch, batch_idx)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        return loss if isinstance(loss, torch.Tensor) else None
    optimizers = list(trainer.optimizers)
    if len(optimizers) != 1:
        raise RetuneError(
            f"automatic optimization with {len(optimizers)} optimizers is not supported by the probe; "
            "use one optimizer or manual optimization"
        )
    optimizer = optimizers[0]

    losses: list[torch.Tensor | None] = []

    def closure() -> torch.Tensor | None:
        loss = _loss_of(_forward(trainer, pl_module, batch, batch_idx))
        losses.append(loss)
        if loss is None:
            return None
        if legacy:
            strategy.backward(loss, optimizer, 0)
        else:
            strategy.backward(loss, optimizer)
        return loss

    run = closure if wrap_closure is None else wrap_closure(closure)
    optimizer.zero_grad(set_to_none=True)
    if legacy:
        strategy.optimizer_step(optimizer, 0, run, model=pl_module)
    else:
        strategy.optimizer_step(optimizer, run, model=pl_module)
    return losses[-1] if losses else None


def _results_owner(trainer: Any) -> Any | None:
    """The loop object holding the ``_results`` collection ``self.log`` writes to right now."""
    loop = trainer._active_loop
    while loop is not None and "_results" not in vars(loop):
        loop = getattr(loop, "epoch_loop", None)
    return loop


_FX_NAMES = {"train": "training_step", "val": "validation_step", "test": "test_step", "predict": "predict_step"}


@contextmanager
def hooks_isolated(trainer: Any, pl_module: Any, stage: str = "train") -> Iterator[None]:
    """Hide probe steps from callbacks, loggers and logged metrics.

    Callbacks and loggers are swapped for none / a dummy logger; ``self.log`` calls go to a throwaway
    result collection. Everything is put back even when the probe raises.

    The progress bar stays: it implements none of the hooks a probe step calls, and
    ``RichProgressBar`` (Lightning's default wherever ``rich`` is installed, as it is with Hugging
    Face's libraries) redraws from its own thread and asserts that ``trainer.progress_bar_callback``
    is still itself: hidden, every redraw during a search printed an ``AssertionError`` traceback.
    """
    ns = namespace_of(trainer)
    owner = _results_owner(trainer)
    saved_callbacks = trainer.callbacks
    progress_bar = trainer.progress_bar_callback
    saved_loggers = list(trainer.loggers)
    saved_results = None if owner is None else owner._results
    saved_fx = pl_module._current_fx_name
    dummy = _module(ns + ".loggers.logger").DummyLogger
    try:
        trainer.callbacks = [] if progress_bar is None else [progress_bar]
        trainer.loggers = [dummy()] if saved_loggers else []
        if owner is not None and saved_results is not None:
            owner._results = _throwaway_results(trainer, saved_results, training=stage == "train")
        pl_module._current_fx_name = _FX_NAMES[stage]
        yield
    finally:
        trainer.callbacks = saved_callbacks
        trainer.loggers = saved_loggers
        if owner is not None and saved_results is not None:
            owner._results = saved_results
        pl_module._current_fx_name = saved_fx


def _throwaway_results(trainer: Any, like: Any, training: bool) -> Any:
    """An empty ``self.log`` collection standing in for ``like``; what is logged into it is dropped."""
    results = _module(namespace_of(trainer) + ".trainer.connectors.logger_connector.result")._ResultCollection(
        training=training
    )
    if is_legacy(trainer):
        results.device = like.device
    return results


# -- state that a probe can change -------------------------------------------------------------


def loop_progress(trainer: Any) -> list[Any]:
    """Progress-tracking objects in the fit loop tree (they have ``state_dict``/``load_state_dict``)."""
    found: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for value in vars(obj).values():
            if dataclasses.is_dataclass(value) and hasattr(value, "load_state_dict"):
                found.append(value)
            elif _is_loop(value):
                walk(value)

    walk(trainer.fit_loop)
    return found


def _is_loop(value: Any) -> bool:
    return any(cls.__name__ in ("_Loop", "Loop") for cls in type(value).__mro__) and hasattr(value, "trainer")


def loop_counters(trainer: Any) -> list[tuple[Any, str]]:
    """Plain int counters a step increments outside the progress objects."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return [(epoch_loop, "_batches_that_stepped")] if hasattr(epoch_loop, "_batches_that_stepped") else []


def lr_schedulers(trainer: Any) -> list[Any]:
    return [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", [])]


def lr_holders(trainer: Any) -> list[Any]:
    """Objects that keep learning rates besides the optimizers: LR schedulers, and fine-tuning callbacks
    (``BaseFinetuning`` remembers the backbone's rate and re-applies it every epoch)."""
    callbacks = [cb for cb in trainer.callbacks if hasattr(cb, "previous_backbone_lr")]
    return [*lr_schedulers(trainer), *callbacks]


def grad_scaler(trainer: Any) -> Any | None:
    return getattr(trainer.precision_plugin, "scaler", None)


def fts_phase(trainer: Any) -> int | None:
    """finetuning-scheduler's current phase, found by duck typing so FTS stays an optional install."""
    for callback in trainer.callbacks:
        depth = getattr(callback, "curr_depth", None)
        if isinstance(depth, int) and hasattr(callback, "ft_schedule"):
            return depth
    return None


def get_accumulation(trainer: Any) -> int:
    return int(trainer.accumulate_grad_batches)


def set_accumulation(trainer: Any, value: int) -> None:
    """Set gradient accumulation for the epoch that is starting.

    On 2.x the loop reads ``trainer.accumulate_grad_batches`` at every batch. On 1.9 the trainer's
    internal accumulation scheduler rewrites it at each epoch start (before callbacks run), so the
    callback sets it again every epoch.
    """
    trainer.accumulate_grad_batches = value


def accumulation_is_scheduled(trainer: Any) -> bool:
    """True when a ``GradientAccumulationScheduler`` changes accumulation by epoch."""
    schedulers = [
        cb
        for cb in trainer.callbacks
        if any(cls.__name__ == "GradientAccumulationScheduler" for cls in type(cb).__mro__)
    ]
    if is_legacy(trainer):
        schedulers.append(trainer.accumulation_scheduler)
    for scheduler in schedulers:
        scheduling = getattr(scheduler, "scheduling", {})
        if len(scheduling) > 1 or any(epoch != 0 for epoch in scheduling):
            return True
    return False


# -- reporting ---------------------------------------------------------------------------------


def log_dir(trainer: Any) -> str | None:
    """The first logger's own folder (a CSV/TensorBoard logger's version folder), or None without a logger.

    Not ``trainer.log_dir``: that broadcasts from rank zero, a collective every rank must enter, so
    rank-zero-only code cannot read it under DDP; and on 1.9 it is only a TensorBoard logger's folder,
    for any other logger its ``save_dir``, which every version shares.
    """
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    folder = getattr(logger, "log_dir", None) or logger.save_dir or trainer.default_root_dir
    return None if folder is None else str(folder)


def refresh_progress_bar(trainer: Any) -> None:
    """Let a TQDM bar show the new number of batches of the epoch whose loader was just rebuilt."""
    bar = getattr(trainer, "progress_bar_callback", None)
    train_bar = getattr(bar, "_train_progress_bar", None)
    if train_bar is not None and hasattr(train_bar, "reset"):
        total = trainer.num_training_batches
        train_bar.reset(total=None if total == float("inf") else int(total))


# -- recovering a real step that ran out of memory ---------------------------------------------


def _automatic_loop(trainer: Any) -> Any:
    """The loop object that builds each training batch's closure (``_make_closure``) in automatic optimization."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if is_legacy(trainer):
        return epoch_loop.batch_loop.optimizer_loop
    return epoch_loop.automatic_optimization


def ddp_wrapper(trainer: Any) -> Any | None:
    """The ``DistributedDataParallel`` module the strategy trains through, or None."""
    model = getattr(trainer.strategy, "model", None)
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


def batch_is_accumulating(trainer: Any) -> bool:
    """True while the current training batch ends without an optimizer step (inside an accumulation window)."""
    loop = trainer.fit_loop.epoch_loop if is_legacy(trainer) else trainer.fit_loop
    return bool(loop._should_accumulate())


@contextmanager
def micro_batch_logging(trainer: Any, batch: Any, keep: bool) -> Iterator[None]:
    """Where ``self.log`` calls of a micro-batch's step go.

    ``keep``: into the run's metrics, weighted by the micro-batch's own size (Lightning reads the
    size from the batch it holds, so it is pointed at the micro-batch), so epoch means count every
    sample once. Otherwise into a throwaway collection: the whole batch already logged its values.
    """
    owner = _results_owner(trainer)
    results = None if owner is None else owner._results
    if owner is None or results is None:
        yield
        return
    if keep:
        saved = (results.batch, results.batch_size)
        results.batch, results.batch_size = batch, None
        try:
            yield
        finally:
            results.batch, results.batch_size = saved
        return
    owner._results = _throwaway_results(trainer, results, training=True)
    try:
        yield
    finally:
        owner._results = results


_EVAL_STEP_NAMES = {"val": "validation_step", "test": "test_step", "predict": "predict_step"}


def wrap_eval_step(
    pl_module: Any, stage: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    """Replace the module's ``*_step`` for ``stage`` on this instance with ``wrap(step)``; returns the undo.

    The wrapper keeps what Lightning inspects of the step's signature (``hook_calls.keep_signature``),
    so Lightning passes it the same ``batch_idx``/``dataloader_idx`` it would pass the step.
    """
    name = _EVAL_STEP_NAMES[stage]
    step = getattr(pl_module, name)
    wrapped = hook_calls.keep_signature(wrap(step), step)
    object.__setattr__(pl_module, name, wrapped)

    def undo() -> None:
        if vars(pl_module).get(name) is wrapped:
            object.__delattr__(pl_module, name)

    return undo


_METRIC_STATE = ("value", "cumulated_batch_size", "_forward_cache", "_update_count", "_computed")


def _metric_state(metric: Any) -> dict[str, Any]:
    """What ``self.log`` changes in one logged value: its accumulators (reassigned, never updated in place)."""
    return {
        name: value.clone() if isinstance(value, torch.Tensor) else value
        for name in _METRIC_STATE
        if hasattr(metric, name)
        for value in [getattr(metric, name)]
    }


def _put_back(results: Any, keys: set[str], saved: dict[str, dict[str, Any]]) -> None:
    """Drop the values first logged after ``keys`` were the collection's, and restore the ``saved`` states."""
    for key in [k for k in results if k not in keys]:
        del results[key]
    for key, state in saved.items():
        for name, value in state.items():
            setattr(results[key], name, value)


def journal_logged_metrics(trainer: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """Record what ``self.log`` changes from now on: ``(rollback, stop)``.

    Used around a step's whole-batch attempt, so that values logged before the point where its
    forward ran out of memory can be taken back. Cheap enough for every step: a set of the logged
    keys, and the previous state of a key only when the attempt logs it.
    """
    owner = _results_owner(trainer)
    results = None if owner is None else owner._results
    if results is None:
        return _nothing, _nothing
    keys = set(results.keys())
    before: dict[str, dict[str, Any]] = {}
    original = results.update_metrics

    def update_metrics(key: str, value: Any, batch_size: int) -> None:
        if key in keys and key not in before:
            before[key] = _metric_state(results[key])
        original(key, value, batch_size)

    results.update_metrics = update_metrics

    def stop() -> None:
        if vars(results).get("update_metrics") is update_metrics:
            del results.update_metrics

    def rollback() -> None:
        stop()
        _put_back(results, keys, before)

    return rollback, stop


def _nothing() -> None:
    return None


def save_logged_metrics(trainer: Any) -> Callable[[], None]:
    """Take what ``self.log`` has collected so far; returns the function that puts it back.

    Taken only while a step recovers, before a round of micro-batches: when one of them runs out of
    memory too, the round's earlier micro-batches have logged values that the next round logs again.
    """
    owner = _results_owner(trainer)
    results = None if owner is None else owner._results
    if results is None:
        return _nothing
    keys = set(results.keys())
    saved = {key: _metric_state(metric) for key, metric in results.items()}
    return lambda: _put_back(results, keys, saved)


def eval_logging(trainer: Any, batch: Any) -> Any:
    """An evaluation micro-batch logs into the run's metrics weighted by its own size."""
    return micro_batch_logging(trainer, batch, keep=True)
