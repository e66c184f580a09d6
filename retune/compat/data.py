"""Dataloaders: the user's hooks called at a candidate size, the loops' loaders rebuilt, batches moved.

Internals used and why: the ``DataLoaderSource`` of each stage (2.x ``<loop>._data_source``, 1.9
``_data_connector._<stage>_dataloader_source``), because probes need the user's dataloader *at a
candidate size*, which only re-calling the user's hook gives; and the loops' dataloader reload (2.x
``_combined_loader = None; setup_data()``, 1.9 ``reset_<stage>_dataloader``), because the epoch that
is about to start must run at the new size.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from itertools import islice
from typing import Any

from retune.compat import combined_loaders
from retune.compat.loops import eval_loop, trainer_fn
from retune.compat.namespace import import_module, is_legacy, namespace_of
from retune.errors import RetuneError
from retune.random_state import RngStates, preserved_rng, sampler_generators

_HOOKS = {
    "train": "train_dataloader",
    "val": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}
_FIT_ARG = {"train": "train_dataloaders", "val": "val_dataloaders", "test": "dataloaders", "predict": "dataloaders"}


def dataloader_hook(stage: str) -> str:
    return _HOOKS[stage]


def dataloader_source(trainer: Any, stage: str) -> Any:
    """Lightning's ``DataLoaderSource`` for ``stage``: what calls the user's ``<stage>_dataloader`` hook."""
    if is_legacy(trainer):
        return getattr(trainer._data_connector, f"_{'train' if stage == 'train' else stage}_dataloader_source")
    if stage == "train":
        return trainer.fit_loop._data_source
    return eval_loop(trainer, stage)._data_source


def check_source(trainer: Any, stage: str) -> None:
    """Refuse dataloaders passed straight to ``fit()``/``test()``: their batch size cannot be changed."""
    if not dataloader_source(trainer, stage).is_module():
        hook = _HOOKS[stage]
        raise RetuneError(
            f"ScheduledBatchSizeFinder needs to rebuild the {stage} dataloader at new batch sizes, so it must "
            f"come from `{hook}()` of your LightningModule or LightningDataModule, not be passed to the trainer "
            f"(`{_FIT_ARG[stage]}=...`)."
        )


def request_dataloader(trainer: Any, stage: str) -> Any:
    """Call the user's ``<stage>_dataloader`` hook (at whatever batch size the attribute now holds)."""
    source = dataloader_source(trainer, stage)
    if is_legacy(trainer):
        return source.dataloader()
    return import_module(namespace_of(trainer) + ".trainer.connectors.data_connector")._request_dataloader(source)


def reload_dataloader(trainer: Any, stage: str) -> None:
    """Make the loop that is about to run ``stage`` iterate a dataloader built at the current batch size."""
    set_epoch = import_module(namespace_of(trainer) + ".loops.fit_loop")._set_sampler_epoch
    if is_legacy(trainer):
        # the rebuild is retune's, not the reload ``reload_dataloaders_every_n_epochs`` schedules: the epoch of the
        # last one stays (counted from here, the next reload came an epoch late, and that epoch trained the loader
        # built for the one before: a curriculum's 64 tokens where a plain run trains 240)
        last = getattr(trainer, "_last_train_dl_reload_epoch", None)
        getattr(trainer, f"reset_{stage}_dataloader")(trainer.lightning_module)
        if stage == "train":  # the loop set the epoch on the loader this one replaces (shuffle order)
            trainer._last_train_dl_reload_epoch = last
            set_epoch(trainer.train_dataloader, trainer.fit_loop.epoch_progress.current.processed)
        return
    if stage == "train":
        loop = trainer.fit_loop
        last = loop._last_train_dl_reload_epoch  # as on 1.9: the schedule's last reload stays
        replaced = loop._combined_loader
        seeds = _base_seeds(replaced)
        generators = [g for dl in (replaced.flattened if replaced is not None else []) for g in sampler_generators(dl)]
        # ``setup_data`` calls the hook and creates the new loader's iterator, whose base seed is a draw (from
        # torch's global RNG, or the loader's own generator) a run started at this size never makes: it made
        # its draw for the loader this one replaces. Without this every later shuffle and dropout mask would
        # differ from that run's (a datamodule that keeps one generator for its loaders: its shuffles)
        global _seed_given
        given, _seed_given = _seed_given, seeds is not None
        try:
            with preserved_rng(generators):
                loop._combined_loader = None
                loop.setup_data()
        finally:
            _seed_given = given
        loop._last_train_dl_reload_epoch = last
        _give_base_seeds(loop._combined_loader, seeds)  # its workers seeded as the replaced loader's were
        # the loop gave the loader this one replaces its epoch (a DistributedSampler's shuffle order);
        # without it the new loader would replay epoch 0's order
        for loader in loop._combined_loader.flattened:
            set_epoch(loader, loop.epoch_progress.current.processed)
        return
    loop = eval_loop(trainer, stage)
    loop._combined_loader = None
    if trainer_fn(trainer) == "fit":
        return  # validation inside fit rebuilds it when it next runs
    loop.setup_data()  # validate/test/predict: the loop is starting now, as in Lightning's own finder
    before = loop.__dict__.get(_RNG_BEFORE_ITERATOR)
    if isinstance(before, RngStates):
        # the loop made the replaced loader's iterator before the search (its base seed, a shuffled sampler's
        # permutation: draws a run started at this size makes once); the new one draws from where that one did
        before.restore()
    loop.reset()


_RNG_BEFORE_ITERATOR = "_retune_rng_before_iterator"


def watch_eval_iterator(trainer: Any, stage: str) -> Callable[[], None]:
    """2.x, ``trainer.validate``/``test``/``predict``: note the random states right before the ``stage`` loop makes
    its loader's iterator (its ``reset``, which runs before the ``on_*_start`` hooks where retune searches), for
    :func:`reload_dataloader`; returns what puts the loop back. Without it, the rebuilt loader's iterator drew its
    base seed and a shuffled sampler's order after the first one had: another subset of a shuffled test set under
    ``limit_test_batches``, other ``multinomial`` draws in ``predict_step``. 1.9 makes the iterator after the hooks
    (nothing to note); inside ``fit`` the train stage's own rebuild keeps the draws (:func:`reload_dataloader`)."""
    if is_legacy(trainer) or trainer_fn(trainer) == "fit":
        return _nothing
    loop = eval_loop(trainer, stage)
    original = loop.reset

    def reset() -> None:
        combined = loop._combined_loader
        loaders = combined.flattened if combined is not None else []
        loop.__dict__[_RNG_BEFORE_ITERATOR] = RngStates.capture([g for dl in loaders for g in sampler_generators(dl)])
        original()

    loop.reset = reset

    def undo() -> None:
        loop.__dict__.pop("reset", None)
        loop.__dict__.pop(_RNG_BEFORE_ITERATOR, None)

    return undo


def _nothing() -> None:
    return None


_seed_given = False


def iterators_ahead(trainer: Any) -> int:
    """How many times the fit loop makes the train loader's iterator from now until the epoch's first batch, each
    drawing its workers' base seed from torch's global RNG before its sampler is iterated (``retune.buckets.drawn``
    starts a pass over a sampler on that RNG where a plain run's starts).

    1.9 makes the epoch's iterator once, when the epoch runs. 2.x makes one in ``setup_data`` right after it asks
    the new loader's length, and one more in the epoch loop's ``on_run_start`` after the first epoch (unless it is
    resuming); in :func:`reload_dataloader` the first one's draw is put back and its seed given from the loader it
    replaces, so it does not count."""
    if trainer is None:
        return 1
    if is_legacy(trainer):
        return 1
    loop = trainer.fit_loop
    fetcher = getattr(loop, "_data_fetcher", None)
    building = loop._combined_loader is not None and getattr(fetcher, "_combined_loader", None) is not (
        loop._combined_loader
    )  # inside setup_data: the loader is set, the fetcher not yet set up over it (then it makes the iterator)
    ahead = 1 if building and not _seed_given else 0
    epoch_loop = loop.epoch_loop
    if trainer.current_epoch > 0 and not loop.is_resuming and not epoch_loop.restarting:
        ahead += 1  # _TrainingEpochLoop.on_run_start: iter(data_fetcher)
    return ahead


def _base_seeds(combined: Any) -> list[int] | None:
    """The base seed (drawn from torch's RNG, seeding the workers) of each live ``DataLoader`` iterator of the
    fit loop's combined loader, in its order; None where there is none (no iterator yet)."""
    iterators = getattr(getattr(combined, "_iterator", None), "iterators", None)
    if not iterators:
        return None
    seeds: list[int] = []
    for iterator in iterators:
        seed = getattr(iterator, "_base_seed", None)
        if not isinstance(seed, int):
            return None
        seeds.append(seed)
    return seeds


def _give_base_seeds(combined: Any, seeds: list[int] | None) -> None:
    """Hand the replaced iterators' base seeds to the new ones (the same loaders, one for one)."""
    iterators = getattr(getattr(combined, "_iterator", None), "iterators", None)
    if seeds is None or not iterators or len(iterators) != len(seeds):
        return
    for iterator, seed in zip(iterators, seeds, strict=True):
        if isinstance(getattr(iterator, "_base_seed", None), int):
            iterator._base_seed = seed


def batch_to_device(trainer: Any, pl_module: Any, batch: Any, dataloader_idx: int | None = None) -> Any:
    """The same transfer the loops do: on 2.x the precision's ``convert_input`` (``16-true``, ``64-true``
    cast the inputs), then ``on_before_batch_transfer``, then the strategy's. The hooks get the batch's
    ``dataloader_idx`` (0 where the step does not take one, as Lightning passes them)."""
    return transfer_batch(trainer, pl_module, convert_input(trainer, batch), dataloader_idx)


def convert_input(trainer: Any, batch: Any) -> Any:
    """The first part of :func:`batch_to_device`: on 2.x the precision plugin's ``convert_input`` (``bf16-true``,
    ``16-true``, ``64-true`` cast the float tensors; the loop then holds the cast batch, not the loader's), else
    ``batch`` itself."""
    convert = getattr(trainer.precision_plugin, "convert_input", None)
    return convert(batch) if convert is not None and not is_legacy(trainer) else batch


def transfer_batch(trainer: Any, pl_module: Any, batch: Any, dataloader_idx: int | None = None) -> Any:
    """The rest of :func:`batch_to_device`, on a batch :func:`convert_input` made: ``on_before_batch_transfer``,
    then the strategy's move."""
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
    combined_loader = import_module(namespace_of(trainer) + ".utilities.combined_loader").CombinedLoader
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


__all__ = [
    "batch_to_device",
    "check_source",
    "convert_input",
    "dataloader_hook",
    "dataloader_source",
    "dataset_length",
    "eval_batches",
    "eval_dataloaders",
    "iterators_ahead",
    "probe_batches",
    "reload_dataloader",
    "request_dataloader",
    "transfer_batch",
]
