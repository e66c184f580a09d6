"""The ``oom`` trigger's step recovery wired into a fit: what ``ScheduledBatchSizeFinder`` owns for it.

The mechanics (re-running a step in micro-batches, exactly) live in :mod:`retune.recovery.train_step`
and :mod:`retune.recovery.eval_step`; this module is their wiring into Lightning's hooks, kept out of
the callback so the callback stays a thin layer of hooks: :class:`OomRecovery` installs the train
recovery in Lightning's closure (with gradient sync under DDP), wraps each evaluation step for one
loop run, keeps the split an epoch trains with across a checkpoint, notes why an out-of-memory error
it did not see was not recovered, and turns each recovered step into a
:class:`~retune.events.RetuneEvent` the callback records.
:func:`resolve_loss_items` checks the ``token_mean`` counting function when the callback is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from retune import compat
from retune.buckets.train_buckets import TrainBuckets
from retune.compat.closure_runner import install_closure_runner
from retune.distributed.grad_sync import SyncedSteps
from retune.errors import FieldProblem, RetuneError, ScheduleError
from retune.events import RetuneEvent
from retune.messages import Say
from retune.oom import is_oom_error
from retune.recovery.eval_step import EvalStepRecovery
from retune.recovery.exactness import ExactnessCheck
from retune.recovery.loss_items import ItemsFn, resolve_items_fn
from retune.recovery.micro_batches import LossReduction, Recovered
from retune.recovery.oom_sites import add_note, oom_site, why_not_recovered
from retune.recovery.split import SplitFn, join_detached
from retune.recovery.train_step import TrainStepRecovery
from retune.schedule.models import RetuneSchedule
from retune.schedule.triggers import OutOfMemory, Trigger

AttrName = Callable[[Any, Any, str], str]
"""``attr(trainer, pl_module, stage)``: the batch-size attribute a stage reads."""
Record = Callable[..., None]
"""``record(trainer, event, warn=True)``: the callback keeps, prints (as a warning) and logs an event."""


class OomRecovery:
    """The ``oom`` trigger's recovery across one callback's fits (built only when the schedule has the trigger).

    ``say``, ``attr`` and ``record`` are the owning callback's bound methods (no lambdas: ``ddp_spawn``
    pickles the callback, and this object with it).
    """

    def __init__(
        self,
        trigger: OutOfMemory,
        *,
        split_batch: SplitFn | None,
        items_fn: ItemsFn | None,
        buckets: TrainBuckets | None,
        say: Say,
        attr: AttrName,
        record: Record,
    ) -> None:
        self.trigger = trigger
        self.split_batch = split_batch
        self.items_fn = items_fn
        self.buckets = buckets
        self._say = say
        self._attr = attr
        self._record = record
        self.train: TrainStepRecovery | None = None
        self.eval: EvalStepRecovery | None = None
        self._undo: list[Callable[[], None]] = []
        self._eval_undo: Callable[[], None] | None = None
        self.resumed_split: tuple[int | None, int] = (None, 1)
        """``(max_size, pieces)`` a checkpoint carried, handed to the next train recovery (then reset)."""
        self.resumed_splits: dict[Any, tuple[int | None, int]] = {}
        """With buckets, the split each bucket keeps, as a checkpoint carried it."""
        self.peer_split: tuple[int | None, int] = (None, 1)
        """Under DDP, the tightest split another rank keeps this epoch (told in the step's agreement): a checkpoint
        carries the tightest of every rank's, and a resumed run applies it on every rank."""
        self.peer_splits: dict[Any, tuple[int | None, int]] = {}
        """The same by bucket (``batching: buckets``)."""
        self._news: RecoveryNews | None = None
        """Under DDP, what this rank tells the others in each step's agreement (:class:`RecoveryNews`)."""
        self._pending: list[int] | None = None
        """This rank's recovery in the step running now, not yet told to the other ranks."""
        self._rank = 0

    @classmethod
    def for_triggers(
        cls,
        triggers: Sequence[Trigger],
        schedule: RetuneSchedule,
        source: Any,
        loss_items: str | Callable[[Any], Any] | None,
        *,
        split_batch: SplitFn | None,
        buckets: TrainBuckets | None,
        say: Say,
        attr: AttrName,
        record: Record,
    ) -> OomRecovery | None:
        """The recovery of the ``oom`` trigger among ``triggers``, or None without one; ``loss_items`` (the
        callback's argument) is checked either way (:func:`resolve_loss_items`)."""
        trigger = next((t for t in triggers if isinstance(t, OutOfMemory)), None)
        items_fn = resolve_loss_items(schedule, source, trigger, loss_items)
        if trigger is None:
            return None
        return cls(
            trigger, split_batch=split_batch, items_fn=items_fn, buckets=buckets, say=say, attr=attr, record=record
        )

    # -- setup checks ---------------------------------------------------------------------------

    @staticmethod
    def check_strategy(trainer: Any) -> None:
        """Every stage: evaluation steps are recovered in micro-batches too."""
        compat.check_oom_trigger(trainer)

    @staticmethod
    def check_fit(pl_module: Any) -> None:
        if not pl_module.automatic_optimization:
            raise RetuneError(
                "the `oom` trigger recovers a training step by re-running it in micro-batches inside Lightning's "
                "closure, which manual optimization does not use; remove `oom` from the schedule's triggers, or "
                "catch torch.OutOfMemoryError in your training_step (retune.recovery.split.split_batch splits a batch)"
            )

    # -- training -------------------------------------------------------------------------------

    def start_train(self, trainer: Any, pl_module: Any) -> None:
        """Install the train step's recovery in Lightning's closure (``on_train_start``)."""
        reduction = self.trigger.loss_reduction
        recovery = TrainStepRecovery(
            lambda: list(pl_module.parameters()),
            split_fn=self.split_batch,
            loss_reduction="sum" if reduction == "sum" else "token_mean" if reduction == "token_mean" else "mean",
            on_recovered=lambda done: self.recovered(trainer, pl_module, "train", done),
            items_fn=self.items_fn,
            module=pl_module,
            warn=lambda message: self._say(message, warn=True),
            split_key=None if self.buckets is None else lambda: self._bucket_now(trainer),
            asked=lambda: self._asked(trainer, pl_module, "train"),
        )
        if self.trigger.check_exactness:  # before the first batch trains: can a recovery be exact for this loss?
            recovery.first_check = self._exactness_check(trainer, pl_module, recovery.loss_reduction)
        (recovery.max_size, recovery.pieces), self.resumed_split = self.resumed_split, (None, 1)
        recovery.splits, self.resumed_splits = self.resumed_splits, {}
        self.train = recovery
        self.peer_split, self.peer_splits, self._pending, self._news = (None, 1), {}, None, None
        self._rank = int(getattr(trainer, "global_rank", 0) or 0)
        run: Callable[[Any], Any] = recovery.run
        if compat.is_distributed(trainer):
            ddp = compat.ddp_wrapper(trainer)
            if ddp is None:
                raise RetuneError(
                    f"the `oom` trigger under {type(trainer.strategy).__name__} needs a DDP-wrapped model"
                )
            self._news = RecoveryNews(self, trainer, pl_module)
            synced = SyncedSteps(
                ddp,
                recovery.run,
                accumulating=lambda: compat.batch_is_accumulating(trainer),
                params=lambda: list(pl_module.parameters()),
                buffers=lambda: list(pl_module.buffers()),
                news=self._news,
            )
            run = synced.run
            self._undo.append(synced.close)
        self._undo += [install_closure_runner(trainer, run, join_detached), recovery.close]

    def share_failures(self, trainer: Any) -> None:
        """At an epoch start under DDP: a rank that ran out of memory tells the others, so rank zero's
        trigger decision (and each bucket's next search) includes it."""
        if not compat.is_distributed(trainer):
            return
        failures = {} if self.buckets is None else self.buckets.failures
        gathered = compat.all_gather_object(trainer, (self.trigger.consume(), failures))
        for known, _ in gathered:
            if known is not None:
                self.trigger.record(failed_size=known[1], fitting_size=known[0])
        if self.buckets is not None:
            self.buckets.merge_failures([bucket_failures for _, bucket_failures in gathered])

    def _exactness_check(self, trainer: Any, pl_module: Any, reduction: LossReduction) -> ExactnessCheck:
        """The first batch's loss against its halves' before it trains (``retune.recovery.exactness``)."""
        return ExactnessCheck(
            pl_module,
            reduction,
            self.items_fn or resolve_items_fn(None),
            self.split_batch,
            precision_reduced=compat.reduced_precision(trainer),
            agree=lambda obj: compat.all_gather_object(trainer, obj),
            note=self._say,
            warn=lambda message: self._say(message, warn=True),
        )

    def new_epoch(self) -> None:
        """Each epoch starts whole, at the size the search picks now (a run resumed mid-epoch keeps its split
        until the next epoch start: the callback does not call this for the resumed epoch)."""
        if self.train is not None:
            self.train.new_epoch()
        self.peer_split, self.peer_splits = (None, 1), {}

    def _bucket_now(self, trainer: Any) -> int | None:
        """The bucket of the batch being trained (None: not bucketed): the key of the split it keeps."""
        return None if self.buckets is None else self.buckets.bucket_now(trainer)

    # -- evaluation -----------------------------------------------------------------------------

    def guard_eval(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Recover an evaluation step that runs out of memory, for this loop run (after its search)."""
        if self.eval is not None:
            return

        def wrap(step: Callable[..., Any]) -> Callable[..., Any]:
            recovery = EvalStepRecovery(
                step,
                logging=lambda batch: compat.eval_logging(trainer, batch),
                save_logs=lambda: compat.save_logged_metrics(trainer),
                journal_logs=lambda: compat.journal_logged_metrics(trainer),
                split_fn=self.split_batch,
                on_recovered=lambda done: self.recovered(trainer, pl_module, stage, done),
                where=lambda: f"{stage}, epoch {trainer.current_epoch}, global step {trainer.global_step}",
                module=pl_module,
                asked=lambda: self._asked(trainer, pl_module, stage),
            )
            self.eval = recovery
            return recovery

        self._eval_undo = compat.wrap_eval_step(pl_module, stage, wrap)

    def _attr_size(self, trainer: Any, pl_module: Any, stage: str) -> int:
        """``stage``'s batch-size attribute's value; 0 where it has none (loaders passed straight to
        validate/predict)."""
        name = self._attr(trainer, pl_module, stage)
        size = compat.get_batch_attr(trainer, pl_module, name) if compat.has_batch_attr(trainer, pl_module, name) else 0
        return size if isinstance(size, int) else 0

    def _asked(self, trainer: Any, pl_module: Any, stage: str) -> int | None:
        """The batch size ``stage``'s loader was asked for (None where it has no attribute, or under buckets, whose
        batches hold their bucket's size)."""
        if stage == "train" and self.buckets is not None:
            return None
        return self._attr_size(trainer, pl_module, stage) or None

    def unguard_eval(self) -> None:
        if self._eval_undo is not None:
            self._eval_undo()
        self._eval_undo = self.eval = None

    # -- the end of a fit -----------------------------------------------------------------------

    def uninstall(self) -> None:
        """Undo what :meth:`start_train` and :meth:`guard_eval` installed (fit end, or an exception)."""
        self.unguard_eval()
        while self._undo:
            self._undo.pop()()
        self.train = None
        self._news = self._pending = None

    @staticmethod
    def note_unrecovered(exception: BaseException) -> None:
        """An OOM the recovery did not see (a hook before or after the step): say where, and why not."""
        if is_oom_error(exception):
            add_note(exception, why_not_recovered(oom_site(exception.__traceback__)))

    # -- a recovered step -----------------------------------------------------------------------

    def recovered(self, trainer: Any, pl_module: Any, stage: str, done: Recovered) -> None:
        """Record a step that ran out of memory and was trained in micro-batches; the next search starts below it."""
        # loaders passed straight to validate/predict have no batch-size attribute: the batch's own size
        size = self._attr_size(trainer, pl_module, stage)
        samples = done.samples or size
        size = size or samples
        largest_piece = done.micro_size or -(-samples // done.pieces)
        bucket = None
        if stage == "train":
            self.trigger.record(failed_size=samples, fitting_size=largest_piece)
            if self.buckets is not None:
                bucket = self.buckets.record_failure(trainer, failed=samples, fitting=largest_piece)
            if self._news is not None:  # told to the other ranks in this step's agreement (RecoveryNews)
                code = FAILED_IN.index(done.failed_in) if done.failed_in in FAILED_IN else 0
                self._pending = [1, samples, largest_piece, done.pieces, code, 0 if bucket is None else bucket + 1]
        rank = f"rank {self._rank}: " if stage == "train" and self._news is not None else ""
        self._record_recovery(
            trainer, pl_module, stage, samples, done.pieces, largest_piece, done.failed_in, bucket, size, rank
        )

    def _record_recovery(
        self,
        trainer: Any,
        pl_module: Any,
        stage: str,
        samples: int,
        pieces: int,
        largest_piece: int,
        failed_in: str,
        bucket: int | None,
        size: int,
        rank: str = "",
    ) -> None:
        where = "" if bucket is None else f" (bucket {bucket}, its next search lowers only its size)"
        if bucket is not None and self.buckets is not None:
            # the attribute holds the longest samples' bucket's size only: the size in force is the failed bucket's
            sizes = self.buckets.state.sizes
            size = sizes[bucket] if 0 <= bucket < len(sizes) else samples
        site = f" in {failed_in}" if failed_in else ""
        event = RetuneEvent(
            epoch=trainer.current_epoch,
            global_step=trainer.global_step,
            trigger="oom",
            stage=stage,
            batch_size_before=size,
            batch_size_after=size,
            direction="down",
            micro_batches=pieces,
            note=f"{rank}out of memory{site} on a batch of {samples}; trained it as {pieces} "
            f"micro-batches of at most {largest_piece}{where}",
        )
        self._record(trainer, event, warn=True)

    # -- DDP: every rank learns each rank's recovery at the step's agreement ----------------------------

    def take_news(self) -> list[int]:
        """This rank's recovery in the step that just ran (:class:`RecoveryNews` width; zeros: none), with the split
        it keeps now, and forget it."""
        pending, self._pending = self._pending, None
        if pending is None or self.train is None:
            return [0] * RecoveryNews.width
        max_size, pieces = self.train.max_size, self.train.pieces  # the split of the batch that just trained
        return [*pending, 0 if max_size is None else max_size + 1, max(1, pieces)]

    def peer_recovered(self, trainer: Any, pl_module: Any, rows: list[list[int]]) -> None:
        """Every rank's news of one step (rank order): another rank's recovery is this rank's to remember too. Its
        failure goes into the ``oom`` trigger (and its bucket's failures), its split into what a checkpoint carries,
        and an event into the history: rank 0's callback state, the one Lightning checkpoints, includes a failure on
        any rank from the step it happened in, as the epoch-start exchange (:meth:`share_failures`) made it later."""
        for rank, row in enumerate(rows):
            if rank == self._rank or not row[0]:
                continue
            _, samples, fitting, pieces, code, bucket_code, kept_size, kept_pieces = row
            bucket = None if bucket_code == 0 else bucket_code - 1
            self.trigger.record(failed_size=samples, fitting_size=fitting)
            if bucket is not None and self.buckets is not None:
                self.buckets.note_failure(bucket, failed=samples, fitting=fitting)
            kept = (None if kept_size == 0 else kept_size - 1, max(1, kept_pieces))
            if self.buckets is None:
                self.peer_split = tightest(self.peer_split, kept)
            else:
                self.peer_splits[bucket] = tightest(self.peer_splits.get(bucket, (None, 1)), kept)
            size = self._attr_size(trainer, pl_module, "train")
            failed_in = FAILED_IN[code] if 0 <= code < len(FAILED_IN) else ""
            self._record_recovery(
                trainer,
                pl_module,
                "train",
                samples,
                pieces,
                fitting,
                failed_in,
                bucket,
                size or samples,
                f"rank {rank}: ",
            )

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The split in force, the tightest of every rank's under DDP (no collective here: the ranks told each other
        at the steps that split, so a checkpoint saved on one rank alone cannot hang)."""
        return split_state(self.train, self.peer_split, self.peer_splits)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The split a checkpointed epoch kept after a recovered OOM: a run resumed mid-epoch need not fail again."""
        max_size = state_dict.get("oom_max_size")
        self.resumed_split = (None if max_size is None else int(max_size), int(state_dict.get("oom_pieces", 1)))
        self.resumed_splits = {
            None if key is None else int(key): (None if size is None else int(size), int(pieces))
            for key, size, pieces in state_dict.get("oom_splits") or []  # absent before issue 28
        }


def split_state(
    train: TrainStepRecovery | None,
    peer: tuple[int | None, int] = (None, 1),
    peers: dict[Any, tuple[int | None, int]] | None = None,
) -> dict[str, Any]:
    """The checkpoint keys of the split the epoch keeps after a recovered OOM (the defaults without one); under DDP
    the tightest of this rank's and the others' (``peer``; ``peers`` by bucket), as the step agreements told them."""
    if train is None:
        return {"oom_max_size": None, "oom_pieces": 1, "oom_splits": []}
    max_size, pieces = tightest((train.max_size, train.pieces), peer)
    splits = dict(train.splits)
    for key, split in (peers or {}).items():
        splits[key] = tightest(splits.get(key, (None, 1)), split)
    return {
        "oom_max_size": max_size,
        "oom_pieces": pieces,
        # with buckets, the split each bucket keeps ([bucket or None, max_size, pieces])
        "oom_splits": [[key, size, count] for key, (size, count) in splits.items()],
    }


def tightest(a: tuple[int | None, int], b: tuple[int | None, int]) -> tuple[int | None, int]:
    """The split that cuts a batch at least as small as both ``(max_size, pieces)`` splits do.

    >>> tightest((None, 1), (25, 1)), tightest((30, 1), (25, 1)), tightest((None, 3), (None, 2))
    ((25, 1), (25, 1), (None, 3))
    """
    sizes = [size for size in (a[0], b[0]) if size is not None]
    return (min(sizes) if sizes else None), max(a[1], b[1])


FAILED_IN = (
    "",
    "forward",
    "backward",
    "a micro-batch",
    "on_before_backward",
    "on_before_zero_grad",
    "optimizer_zero_grad",
)
"""Where a recovered step ran out of memory (:class:`~retune.recovery.micro_batches.Recovered`'s ``failed_in``), by
the code the step's agreement carries it as (0: somewhere else, not named)."""


class RecoveryNews:
    """What a rank tells the others in each training step's agreement under DDP (a
    :class:`~retune.distributed.grad_sync.StepNews`): whether its step was recovered in micro-batches, the batch size
    that ran out of memory and the micro-batches that trained it, where it failed, its bucket, and the split the rank
    keeps now. Eight integers per rank in the status all-reduce the step makes anyway: no collective of its own."""

    width = 8

    def __init__(self, owner: OomRecovery, trainer: Any, pl_module: Any) -> None:
        self.owner = owner
        self.trainer = trainer
        self.pl_module = pl_module

    def local(self) -> list[int]:
        return self.owner.take_news()

    def agreed(self, rows: list[list[int]]) -> None:
        self.owner.peer_recovered(self.trainer, self.pl_module, rows)


def resolve_loss_items(
    schedule: RetuneSchedule,
    source: Any,
    trigger: OutOfMemory | None,
    loss_items: str | Callable[[Any], Any] | None,
) -> ItemsFn | None:
    """The ``token_mean`` counting function, resolved now so a wrong path fails when the callback is built."""
    configured = None if trigger is None else trigger.loss_items
    if loss_items is not None and configured is not None:
        raise RetuneError(
            f"loss_items is given twice: as a constructor argument ({loss_items!r}) and as the oom trigger's "
            f"loss_items ({configured!r}) in the schedule; keep one"
        )
    if loss_items is not None and not callable(loss_items) and not isinstance(loss_items, str):
        raise RetuneError(f"loss_items must be a function fn(batch) -> int or a name, got {loss_items!r}")
    if loss_items is not None and (trigger is None or trigger.loss_reduction != "token_mean"):
        # as the schedule refuses it on the trigger: a count nothing would use is a mistake, not a no-op
        why = (
            "the schedule has no oom trigger"
            if trigger is None
            else (f"the oom trigger's loss_reduction is {trigger.loss_reduction!r}")
        )
        raise RetuneError(
            f"loss_items counts what a token_mean loss averages over, but {why}; set `loss_reduction: "
            "token_mean` on the oom trigger, or drop the loss_items argument"
        )
    try:
        return resolve_items_fn(loss_items if loss_items is not None else configured)
    except ValueError as exc:
        name = str(source) if isinstance(source, (str, Path)) else "<schedule>"
        index = next((i for i, t in enumerate(schedule.triggers) if t.kind == "oom"), 0)
        raise ScheduleError(name, [FieldProblem(f"triggers[{index}].loss_items", str(exc))]) from None


__all__ = ["FAILED_IN", "OomRecovery", "RecoveryNews", "resolve_loss_items", "split_state", "tightest"]
