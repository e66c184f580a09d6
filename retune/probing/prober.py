"""One trial: real training steps at a candidate batch size, with the run left as it was.

A trial sets the batch-size attribute, asks the user's ``train_dataloader()`` for a loader at that
size, and runs ``steps_per_trial`` real steps (forward, backward, optimizer step under the
trainer's strategy and precision). The first step allocates optimizer state exactly as training
will, so the memory measured is the memory the run needs. Between trials and at the end of the
search, the snapshot taken before the first trial is restored: each trial after the first starts
with a reset to it, and the session ends with the final restore (a trial's leftovers are never
copied back just to be overwritten by the next one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch

from retune import compat
from retune.allocator import MemoryStats, checked_peak, process_limit, stats_for
from retune.distributed.collective_guard import PeerFailed
from retune.distributed.fsdp2 import ShardedTrials
from retune.errors import RetuneError
from retune.memory import (
    PhaseMarks,
    StepPhases,
    gradient_bytes,
    has_gradients,
    has_optimizer_state,
    held_bytes,
    measure_peak,
    resident_bytes,
    resident_in_evaluation,
)
from retune.messages import warn
from retune.oom import clear_device_cache, forget_exception, is_oom_error
from retune.probing.snapshot import TrainingSnapshot, sampler_generators
from retune.probing.timing import Clock, default_clock, samples_per_second, steady, timed
from retune.recovery.split import SplitError, batch_length

TrialReport = Callable[[int, bool, int | None, float | None], None]
"""``on_trial(size, fits, peak_bytes, samples_per_s)``, called after every trial on every rank."""


def capture_run_state(trainer: Any, pl_module: Any, training: bool = True) -> TrainingSnapshot:
    """Snapshot what real steps outside the loop can change (see :mod:`retune.probing.snapshot`).

    Training steps can change weights, optimizer state, LR schedulers, the grad scaler and the loops'
    progress counters; an evaluation step only buffers, train/eval flags, metrics and RNG.
    """
    stateful: list[Any] = [*compat.lr_schedulers(trainer), *compat.loop_progress(trainer)] if training else []
    scaler = compat.grad_scaler(trainer)
    if scaler is not None and training:
        stateful.append(scaler)
    return TrainingSnapshot.capture(
        pl_module,
        optimizers=list(trainer.optimizers) if training else [],
        stateful=stateful,
        counters=compat.loop_counters(trainer) if training else [],
        include_params=training,
    )


def sharded_trials(trainer: Any, pl_module: Any) -> ShardedTrials | None:
    """The trial wrapper for this run (guarded trials, FSDP2 reset after a failure), or None when the
    model is not sharded with FSDP2."""
    if not compat.is_sharded(trainer):
        return None
    return ShardedTrials(pl_module, int(getattr(trainer, "world_size", 1)), trainer.strategy.root_device)


class Prober:
    """Runs trials for one search. Use as ``with Prober(...).session(): prober.measure(size)``.

    ``stage`` is ``train`` (forward, backward and optimizer step) or an evaluation stage (``val``,
    ``test``, ``predict``: the module's ``*_step`` in eval mode without gradients, as Lightning runs it).
    """

    def __init__(
        self,
        trainer: Any,
        pl_module: Any,
        batch_arg_name: str,
        steps_per_trial: int,
        budget_bytes: int | None = None,
        on_trial: TrialReport | None = None,
        stage: str = "train",
        track_memory: bool = True,
        arrange: Callable[[Any], Any] | None = None,
        time_steps: bool = False,
        clock: Clock | None = None,
        device_limit: int | None = None,
    ) -> None:
        self.trainer = trainer
        self.pl_module = pl_module
        self.batch_arg_name = batch_arg_name
        self.steps_per_trial = steps_per_trial
        self.budget_bytes = budget_bytes
        self.on_trial = on_trial
        self.stage = stage
        self.track_memory = track_memory or budget_bytes is not None
        self.arrange = arrange
        """Turns the loader the hook returned into the one a trial iterates (``search.probe_samples``)."""
        self.peaks: list[int | None] = []
        """Measured peak of each trial, in order (None where no statistic exists or the trial hit a real OOM)."""
        self.time_steps = time_steps
        self.clock = clock or default_clock
        self.step_times: list[list[float] | None] = []
        """With ``time_steps``: the seconds of each step of each trial, in trial order, the slowest rank's
        under DDP (None where the trial failed or its steps were not timed)."""
        self._untracked = False  # time() runs its trials without the CPU memory tracker
        self._times: list[float] | None = None  # the current trial's step seconds
        self._snapshot: TrainingSnapshot | None = None
        self._trials_run = 0  # in the current session
        self._warned_window = False  # a manual step's trial that never stepped an optimizer: said once
        self._sharded = sharded_trials(trainer, pl_module)  # FSDP2: guarded trials, reset after a failure
        self._stats: MemoryStats | None = None  # the device allocator's statistics (CUDA), per session
        self.device_limit = device_limit
        """Without a budget, the limit the search agreed for every rank where it started
        (:func:`retune.search.stage.agreed_limits`: the smallest rank's); None: read this process's own."""
        self.limit: int | None = budget_bytes
        """The bytes a trial may peak at: the budget, else on a caching allocator ``device_limit`` or, not given,
        what this process can get (:func:`retune.allocator.process_limit`, read at the session's start), else None
        (only a real OOM fails). A search passes ``device_limit``: verdicts from each rank's own free memory would
        differ between DDP ranks (a size fitting on one, not on another), and the ranks must take the same
        decisions."""
        self.headroom = 0
        """The largest unreleasable fragmentation measured after a trial this session (reserved but unallocated
        after the cache was emptied): a trial fits only if its peak leaves that much below the limit."""
        self._reserved: int | None = None  # the current trial's peak reserved bytes
        self.steady_peaks = False
        """A verifying probe (``search.predict``): a step that creates optimizer state counts the state with its
        peak, so a one-step trial measures the steady state (see :meth:`_run_steps`)."""
        self.steady_stop = False
        """With ``steady_peaks``, every step of a trial being the same batch: stop the trial after its first step
        with the steady-state peak."""
        self.eval_extra = 0
        """Evaluation inside fit: bytes the training steps leave resident when validation really runs (gradients,
        optimizer state, the state the next step creates for parameters just unfrozen), added to every peak."""
        self.record_phases = False
        """Measure each training trial's peak per phase of the step too (:meth:`phases_at`; ``mode: model`` draws a
        line per phase). Where the CPU tracker measures: a caching allocator's peak is the step's alone."""
        self._phases: dict[int, tuple[int, ...]] = {}  # by size, the last trial's agreed peak per phase
        self._readings: dict[int, tuple[int, int | None]] = {}  # by size, the last trial's agreed allocated, reserved
        self._last_reading: tuple[int, int | None] | None = None
        self._trial_phases: tuple[int, ...] | None = None  # the current trial's, on this rank

    @contextmanager
    def session(self) -> Iterator[Callable[[int], bool]]:
        """Snapshot the training state, yield ``fits(size)``, and always restore on the way out."""
        if self._sharded is not None:
            self._sharded.prepare()
        self._snapshot = capture_run_state(self.trainer, self.pl_module, training=self.stage == "train")
        self._trials_run = 0
        self._stats = stats_for(self.pl_module.device)
        self.headroom = 0
        self._readings.clear()
        self._phases.clear()
        evaluating = self.stage != "train"
        in_fit = evaluating and compat.trainer_fn(self.trainer) == "fit"
        optimizers = list(self.trainer.optimizers) if evaluating else []
        self.eval_extra = (
            resident_in_evaluation(self.pl_module, optimizers, self._stats is not None, upcoming=in_fit)
            if evaluating
            else 0
        )
        if self._stats is not None:
            # what training left cached (an earlier epoch's larger blocks) goes back first, budget or not: a
            # trial's new optimizer state would be carved out of a cached segment and pin it, and the trial's
            # fragmentation would read it as headroom (an H100 run: 0.94 GiB of a 2 GiB budget, the size found
            # 38% below the largest that trains). Training starts from an emptied cache after the search (below).
            clear_device_cache(collect=False)
            if self.budget_bytes is None:
                self.limit = process_limit(self._stats) if self.device_limit is None else self.device_limit
        try:
            yield self.fits
        finally:
            self._snapshot.restore()
            self._snapshot = None
            if self._sharded is not None:
                self._sharded.prepare()  # an evaluation probe leaves FSDP2's root unsharded: as before the search
            clear_device_cache(collect=False)  # the trials' cached blocks: training starts with the device's memory

    @property
    def last_reading(self) -> tuple[int, int | None] | None:
        """The last trial's agreed ``(allocated peak, reserved peak)`` when it ran (None: it ran out of memory, or
        measured nothing): :meth:`checked_from` reads it at the headroom of any later moment."""
        return self._last_reading

    def checked_from(self, reading: tuple[int, int | None]) -> int:
        """A trial's ``(allocated, reserved)`` reading as the verdict reads it now (:meth:`checked_at`)."""
        allocated, reserved = reading
        return allocated if self.limit is None else checked_peak(allocated, reserved, self.headroom)

    def checked_at(self, size: int) -> int | None:
        """The last trial at ``size`` that ran, as :meth:`measure` would return it now: on a caching allocator with a
        limit, its allocated peak plus the headroom measured *so far* (or its reserved peak). The headroom is the
        largest fragmentation of the session's trials and can grow after a trial: a line through peaks returned at
        different headrooms mixes two bases (a fit below the limit kept at the lower one), so a search re-reads
        its points here before drawing a line. None where the size has no reading."""
        reading = self._readings.get(size)
        return None if reading is None else self.checked_from(reading)

    def phases_at(self, size: int) -> tuple[int, ...] | None:
        """With :attr:`record_phases`, the last trial at ``size`` that ran: its peak by phase of the step (forward,
        backward, the update), each the highest of its steps and on the same scale as the trial's peak (the
        largest rank's under DDP); None where the trial did not tell them apart (an allocator, an evaluation
        stage, manual optimization, a rank without them)."""
        return self._phases.get(size)

    @property
    def snapshot_bytes(self) -> int:
        return 0 if self._snapshot is None else self._snapshot.nbytes

    def fits(self, size: int) -> bool:
        """Run one trial at ``size``; False when it runs out of memory or exceeds the budget."""
        return self.measure(size)[0]

    def time(self, size: int, steps: int | None = None) -> tuple[bool, list[float]]:
        """Run one trial at ``size`` for its timings alone: ``(fits, steady step seconds)``.

        For sizes already known to fit (below the largest that fit), so no budget applies. On a CPU the
        memory tracker slows every operator and would distort the timings, so it is left off here.
        ``steps`` (at least ``steps_per_trial``) runs more steps in this trial: a median of more steps
        is what separates sizes whose rates differ by a few percent.
        """
        self._untracked = True
        planned = self.steps_per_trial
        self.steps_per_trial = max(planned, steps or planned)
        try:
            ok, _ = self.measure(size)
        finally:
            self._untracked = False
            self.steps_per_trial = planned
        return ok, steady(self.step_times[-1])

    def measure(self, size: int) -> tuple[bool, int | None]:
        """Run one trial at ``size``: whether it fits, and its peak memory when measurable: on a caching allocator
        with a limit, the quantity the verdict compares with the limit (:func:`retune.allocator.checked_peak`:
        the allocated peak plus the measured headroom, or the reserved peak), so that a line through the peaks
        agrees with the verdicts; :attr:`peaks` keeps the allocated peaks (what the events report).

        A trial fails on an out-of-memory error or a peak above the budget; any other error propagates
        after the state is restored. Under DDP every rank runs the trial, then the outcome is agreed in
        exactly one collective call whatever happened locally: the trial fits only if it fit on every
        rank, the peak is the largest rank's, and an error on any rank is raised on all of them. Under
        FSDP2 a rank whose trial fails stops the others at their next collective (``"peer"``: they
        stopped because another rank failed), so every rank reaches that agreement.
        """
        status, peak, error = self._local_trial(size)
        message = "" if error is None else f"{type(error).__name__}: {error}"
        times = self._times if status == "fits" else None
        memory = (self._reserved if status == "fits" else None, self.headroom, self._trial_phases)
        gathered = compat.all_gather_object(self.trainer, (status, peak, message, times, memory))
        outcomes = [(state, rank_peak, text) for state, rank_peak, text, _, _ in gathered]
        failed = [(rank, text) for rank, (state, _, text) in enumerate(outcomes) if state == "error"]
        if failed:
            if error is not None:
                raise error
            rank, text = failed[0]
            raise RetuneError(f"rank {rank} failed during a batch-size probe at size {size}: {text}")
        ok = all(state == "fits" for state, _, _ in outcomes)
        peaks = [p for _, p, _ in outcomes]
        agreed_peak = max(p for p in peaks if p is not None) if ok and all(p is not None for p in peaks) else None
        reserved = [r for *_, (r, _, _) in gathered if r is not None]
        self.headroom = max(h for *_, (_, h, _) in gathered)
        by_phase = [ph for *_, (_, _, ph) in gathered]
        if agreed_peak is not None and by_phase and all(ph and len(ph) == len(by_phase[0]) for ph in by_phase):
            self._phases[size] = tuple(max(parts) for parts in zip(*[ph for ph in by_phase if ph], strict=True))
        else:
            self._phases.pop(size, None)
        checked = agreed_peak
        self._last_reading = None if agreed_peak is None else (agreed_peak, max(reserved, default=None))
        if self._last_reading is not None:
            self._readings[size] = self._last_reading
        if ok and agreed_peak is not None and self.limit is not None:
            # ran, but needs more than the budget (or the process's share of the device) allows
            checked = checked_peak(agreed_peak, max(reserved, default=None), self.headroom)
            ok = checked <= self.limit
        self.peaks.append(agreed_peak)
        agreed_times = _slowest_rank([t for _, _, _, t, _ in gathered]) if ok else None
        self.step_times.append(agreed_times)
        if self.on_trial is not None:
            self.on_trial(size, ok, agreed_peak, samples_per_second(size, steady(agreed_times)))
        return ok, checked

    def sample_batch(self, size: int) -> Any:
        """The first batch a trial at ``size`` would train on, as the loader yields it (on the host), without
        running a step: what a prediction (:mod:`retune.prediction`) fakes at other sizes. Inside ``session()``;
        the sampler's generators are put back, and the session's end restores what the loader drew."""
        assert self._snapshot is not None, "sample_batch() is only valid inside session()"
        compat.set_batch_attr(self.trainer, self.pl_module, self.batch_arg_name, size)
        loader = compat.request_dataloader(self.trainer, self.stage)
        generators = [(g, g.get_state()) for g in sampler_generators(loader)]
        if self.arrange is not None:
            loader = self.arrange(loader)
        batches = compat.probe_batches(self.trainer, self.stage, loader, 1)
        try:
            raw, _, _ = next(batches)
        finally:
            batches.close()
            for generator, state in generators:
                generator.set_state(state)
        return raw

    def _local_trial(self, size: int) -> tuple[str, int | None, BaseException | None]:
        """This process's trial: ``("fits" | "oom" | "error", peak, the error to re-raise)``."""
        assert self._snapshot is not None, "measure() is only valid inside session()"
        generators: list[tuple[torch.Generator, torch.Tensor]] = []
        status, error, peak = "fits", None, None
        self._times = None
        self._reserved = None
        self._trial_phases = None
        try:
            with self._isolated():
                if self._trials_run:
                    self._snapshot.reset()  # start from the captured state, not the previous trial's
                # after the reset, which puts the module's public attributes back (the size may live there)
                compat.set_batch_attr(self.trainer, self.pl_module, self.batch_arg_name, size)
                self._trials_run += 1
                loader = compat.request_dataloader(self.trainer, self.stage)
                generators = [(g, g.get_state()) for g in sampler_generators(loader)]
                if self.arrange is not None:
                    loader = self.arrange(loader)
                with compat.hooks_isolated(self.trainer, self.pl_module, self.stage):
                    peak = self._run_steps(loader, size)
        except BaseException as exc:
            if isinstance(exc, PeerFailed):
                status = "peer"
            elif is_oom_error(exc):
                status = "oom"
                forget_exception(exc)  # the failed trial's frames and activations: gone before the next trial
            else:
                status, error = "error", exc
        finally:
            if self.stage == "train":
                for optimizer in self.trainer.optimizers:
                    optimizer.zero_grad(set_to_none=True)
            loader = None
            if status == "oom" or self._stats is not None:
                clear_device_cache(collect=status == "oom")
            if self._stats is not None and status == "fits":
                left = self._stats.read()  # what emptying the cache could not give back: fragmented segments
                self.headroom = max(self.headroom, left.reserved - left.allocated)
            for generator, state in generators:
                generator.set_state(state)
        return status, (peak if status == "fits" else None), error

    def _isolated(self) -> Any:
        return nullcontext() if self._sharded is None else self._sharded.trial()

    def _run_steps(self, loader: Any, size: int) -> int | None:
        """Run the steps; return the largest step peak (None when not tracked or not measurable).

        An evaluation stage with several dataloaders runs ``steps_per_trial`` steps on each, one loader
        after another as Lightning does, so the trial fits only if every loader's steps fit, and its
        peak is the largest of them: one size for all the stage's loaders.

        Only the step is measured, from the device transfer on: the dataloader's own work (collate,
        per-sample conversion) is host-side and, under the CPU tracker, slow to trace. On CPU the
        batch the loader produced is added to the step's peak, since there it is the step's memory.

        With ``time_steps`` each step whose batch holds ``size`` samples is timed: a short last batch of
        a small dataset (the loader cycles) would time another size.

        A training step runs as the loop runs it (:func:`retune.compat.training_step`): the step before's
        gradients alive in its forward (on the CPU tracker counted while alive, ``measure_peak(grads=True)``),
        what ``training_step`` returned alive until the update is done.

        With ``steady_peaks`` (a verifying probe), on the CPU tracker, each step is measured by phase
        (:class:`~retune.memory.StepPhases`) and counts as its peak the one a later step has
        (:meth:`~retune.memory.StepPhases.steady`): forward with the gradients of a step before and the optimizer
        state this one created, backward with the state, an update that created the state as the same update
        on it (once: where the update is the peak, the state is not added to it again). So a trial of one step
        at fit start (or just after an unfreeze) is honest about the steps that follow it, which its peak
        alone is not. A caching allocator's reserved bytes follow no such sum, so there only a step that began
        with the state and the gradients is steady: a verifying probe there runs two steps at least, and the
        second (after one of its own) is. With gradient accumulation a window's later micro-batches hold the
        gradients through backward too; a probe's steps zero where the loop does (at a window's first), so
        there too a verifying probe runs two steps and its second, a later micro-batch, is the steady one. With
        ``steady_stop`` as well (every step of the trial holds the same batch) the trial ends after its first
        steady step.
        """
        accumulating = self.stage == "train" and compat.get_accumulation(self.trainer) > 1
        steps = self.steps_per_trial
        # a manual step marks no phases: where it creates the optimizer state, only its peak plus that state bounds
        # a later step's, which counts the state twice where the update is the peak; a second step measures it
        manual = self.stage == "train" and not getattr(self.pl_module, "automatic_optimization", True)
        if self.steady_peaks and self.stage == "train" and (self._stats is not None or accumulating or manual):
            steps = max(2, steps)  # only a step after one of the trial's own is steady there (below)
        # a manual step may update only every few batches (its own accumulation by batch_idx): the trial goes on
        # until one update has run and a step after it has, with the state and accumulated gradients alive (up to
        # MANUAL_WINDOW steps)
        manual = manual and bool(self.trainer.optimizers)  # a manual step without optimizers: nothing to wait for
        updates = _UpdateCount(self.trainer.optimizers if manual else [])
        budget = max(steps, MANUAL_WINDOW) if manual else steps
        batches = compat.probe_batches(self.trainer, self.stage, loader, budget)  # close() ends workers
        device = self.pl_module.device
        optimizers = list(self.trainer.optimizers) if self.stage == "train" else []
        if self.stage != "train":
            self.pl_module.eval()  # the snapshot puts the train/eval flags back
        peak: int | None = None
        # a trial without a steady step of its own (one step, or later batches short of `size`: a batch near the
        # dataset's length) reads its first step as a later step has it, the state it created and the gradients of
        # a step before alive, as a verifying probe does: its own peak is not what training at `size` holds
        first_bound: tuple[int, tuple[int, ...] | None] | None = None
        steady_seen = False
        bound_first = self.stage == "train" and not self.steady_peaks and self._stats is None
        bound_first = bound_first and not manual
        track = self.track_memory and not (self._untracked and device.type == "cpu")
        # the CPU tracker's Python dispatch slows every operator: steps it measures are not timed
        times: list[float] | None = [] if self.time_steps and not (track and device.type == "cpu") else None
        self._times = times
        try:
            for step, (raw, batch_idx, dataloader_idx) in enumerate(batches):
                if manual and step >= steps and updates.window_measured:
                    break  # an update ran, and a step after it as training has it: the window's memory is measured
                updates.step_starts(manual and _any_gradient(self.trainer.optimizers))
                train = self.stage == "train"
                steady = self.steady_peaks and train
                # a step after one of this trial's holds the gradients a later training step holds (some
                # parameters may never get one: a pooler, an expert no token reached)
                had_state = steady and has_optimizer_state(optimizers) and (step > 0 or has_gradients(optimizers))
                bounded = bound_first and step == 0  # read as steady below unless a later step of its own is
                held = resident_bytes(self.pl_module, optimizers) if steady or bounded else 0
                if bound_first and step > 0 and has_optimizer_state(optimizers) and _holds(raw, size):
                    steady_seen = True  # after a step of this trial's, with the state: as training holds `size`
                phases: StepPhases | None = None
                with ExitStack() as stack:
                    reading = (
                        stack.enter_context(
                            measure_peak(device, self.pl_module, optimizers, self._stats, self.eval_extra, train)
                        )
                        if track
                        else None
                    )
                    marks = None
                    if (
                        (steady or bounded or (self.record_phases and train))
                        and reading is not None
                        and reading.tracker is not None
                    ):
                        # accumulating, a bounded first step's backward holds the window's gradients too (steady)
                        marks = PhaseMarks(reading.tracker, reading.grads_before, accumulating and bounded)
                        stack.enter_context(compat.step_marks(marks))
                    if times is not None and _holds(raw, size):
                        stack.enter_context(timed(device, self.clock, times))
                    converted = compat.convert_input(self.trainer, raw)
                    # of the loader's batch, what the step holds: a copy the precision plugin cast replaced its
                    # source (see below); whatever the hooks make of the batch afterwards may keep the rest
                    raw_held = held_bytes(raw, converted) if device.type == "cpu" else 0
                    batch = compat.transfer_batch(self.trainer, self.pl_module, converted, dataloader_idx)
                    del converted
                    compat.run_step(self.trainer, self.pl_module, self.stage, batch, batch_idx, dataloader_idx)
                    if marks is not None:
                        phases = marks.finish(gradient_bytes(self.pl_module))
                if reading is None:
                    del batch, raw
                    continue
                step_peak = reading.peak_bytes
                if reading.peak_reserved is not None:
                    self._reserved = max(self._reserved or 0, reading.peak_reserved)
                if step_peak is not None and device.type == "cpu":
                    # the loader's tensors the step holds; a copy the precision plugin cast (bf16-true) is counted by
                    # the tracker, and its source is not: Lightning's loop drops it before the step (a sized loader's:
                    # a loader without a length has Lightning hold the next batch too, which no probe counts)
                    step_peak += raw_held
                created = max(0, resident_bytes(self.pl_module, optimizers) - held) if steady or bounded else 0
                if bounded and step_peak is not None and phases is not None:
                    base = step_peak - phases.peak
                    parts = tuple(base + part for part in phases.steady_parts(created)) if phases.marked else None
                    first_bound = (base + phases.steady(created), parts)
                if step_peak is not None and phases is not None and phases.marked and self.record_phases:
                    # each phase on the step's scale (what is resident, the batch), the highest of the trial's steps
                    parts = phases.steady_parts(created) if steady else (phases.forward, phases.backward, phases.update)
                    base = step_peak - phases.peak
                    here = tuple(base + part for part in parts)
                    before = self._trial_phases
                    self._trial_phases = here if before is None else tuple(map(max, before, here))
                # unmarked, a step that created the state is bounded only where no later step of the trial measures
                # a manual trial always goes on past the step that created the state (the window rule above)
                measured_later = (
                    phases is not None and not phases.marked and created > 0 and (manual or step + 1 < steps)
                )
                if step_peak is not None and phases is not None and steady and not measured_later:
                    # as a later step has it: the state this one created, the gradients of a step before
                    step_peak += phases.steady(created) - phases.peak
                del batch, raw
                if step_peak is not None:
                    peak = step_peak if peak is None else max(peak, step_peak)
                # accumulating, the trial's second step is a window's later micro-batch (no zero_grad: backward
                # holds the gradients), measured as it runs; the first one's steady sum would only bound it
                steady_now = had_state or (phases is not None and (step > 0 or not (accumulating or measured_later)))
                if steady and self.steady_stop and steady_now and not manual and has_optimizer_state(optimizers):
                    break
        finally:
            batches.close()
            updates.close()
        if first_bound is not None and not steady_seen:
            bound, parts = first_bound
            peak = bound if peak is None else max(peak, bound)
            if self._trial_phases is not None and parts is not None and len(parts) == len(self._trial_phases):
                self._trial_phases = tuple(map(max, self._trial_phases, parts))  # the phases on the same reading
        if manual and not updates.seen and not self._warned_window:
            self._warned_window = True
            warn(
                f"a trial's {budget} training steps never stepped an optimizer (a manual training_step that updates "
                "every few batches by batch_idx?): the optimizer state its update creates is not in any probe's "
                "peak, so the size may not fit once it exists. Step the optimizer within the first "
                f"{MANUAL_WINDOW} batches of a trial (or raise memory.margin)",
            )
        return peak


def _any_gradient(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether any parameter of ``optimizers`` holds a gradient (one that never gets one, a pooler, does not count)."""
    return any(p.grad is not None for opt in optimizers for group in opt.param_groups for p in group["params"])


MANUAL_WINDOW = 16
"""The most steps a trial of a manual ``training_step`` runs while waiting for its first optimizer update."""


class _UpdateCount:
    """Counts the optimizers' ``step`` calls (``register_step_post_hook``) while a trial of a manual step runs, to
    tell when the trial has measured what training holds; closed after it."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.seen = 0
        self._at_start = 0
        self._after_update = False
        self._with_gradients = False
        self._handles = [opt.register_step_post_hook(self._count) for opt in optimizers]

    def _count(self, *args: Any) -> None:
        self.seen += 1

    def step_starts(self, gradients: bool) -> None:
        """A step starts, with ``gradients`` of the steps before alive or not."""
        self._at_start, self._after_update, self._with_gradients = self.seen, self.seen > 0, gradients

    @property
    def window_measured(self) -> bool:
        """Whether the last step ran as a later step of training does: it started after an update (with the state
        it created), and either with the gradients of the step before alive (a window accumulating them) or
        updating itself (a step that updates every batch, zeroing after its update, accumulates nothing)."""
        return self._after_update and (self._with_gradients or self.seen > self._at_start)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _holds(batch: Any, size: int) -> bool:
    """Whether ``batch`` holds ``size`` samples (True when its length cannot be told)."""
    try:
        length = batch_length(batch)
    except SplitError:
        return True
    return length is None or length == size


def _slowest_rank(per_rank: list[list[float] | None]) -> list[float] | None:
    """Step by step, the slowest rank's seconds: under DDP every rank waits for the slowest at each step.

    None when any rank has no timings (steps not timed); truncated to the rank with the fewest steps.
    """
    if not per_rank or any(times is None for times in per_rank):
        return None
    return [max(step) for step in zip(*[t for t in per_rank if t is not None], strict=False)]


__all__ = ["Prober", "TrialReport", "capture_run_state", "sharded_trials"]
