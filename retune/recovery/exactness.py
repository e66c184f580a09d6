"""Refuse, at fit start, an ``oom`` trigger whose recovery could not be exact for this loss (no Lightning here).

A step recovered in micro-batches (:mod:`retune.recovery.train_step`) weights each micro-batch's loss by
its share of the batch, as ``loss_reduction`` says (samples, counted items, or 1 for a sum). That makes the
whole batch's update only when the whole batch's loss *is* that weighted combination of its pieces' losses.
It is not for a sum loss left at the default ``mean``, for a causal LM whose items are counted without the
shift, or for a loss that couples the samples of a batch (in-batch negatives: InfoNCE, CLIP), and nothing
showed it: the run went on with updates that differ from the whole batch's.

So on the first training batch, before it trains, retune computes the loss of the whole batch and of its two
halves (:func:`~retune.recovery.split.split_batch`, the split the recovery itself makes), recombines the
halves with the weights the recovery would use (:func:`~retune.recovery.micro_batches.loss_weights`), and
compares. Equal within float noise: the recovery is exact for this loss. Otherwise the ``oom`` trigger is
refused with a :class:`~retune.errors.RetuneError` naming the likely cause, found by trying the other
weightings on the same numbers (:func:`judge`): a weighting that reproduces the whole batch's loss names the
setting to use; none does: the loss couples the samples and no recovery can be exact.

The check leaves no trace (:class:`ExactnessCheck`): under ``torch.no_grad``, the global RNGs put back, every
buffer of the module put back, its public attributes put back as after a probe (:mod:`retune.probing.attributes`:
the losses a ``training_step`` appends to ``self.training_step_outputs`` for an epoch-end mean are taken out
again) and every torchmetrics ``Metric``'s states (:mod:`retune.probing.metric_states`), what ``self.log``
records dropped, no backward and no optimizer step. Dropout
(its rate set to 0 too, which Hugging Face's attention reads) and BatchNorm layers run in eval mode while it
runs: a random mask or a batch statistic differs between a batch and its halves by nature (BatchNorm's
difference is the one a recovery accepts, see :mod:`retune.recovery.running_stats`), not because of the loss.
Randomness it cannot switch off is found by running the whole batch a second time and, when the loss moves,
the check is skipped with a warning rather than refusing a loss it cannot judge.

Example (the numbers of a sum loss configured as ``mean``: the whole batch's loss is the halves' sum):

    >>> mean = Weighting("mean", "`loss_reduction: mean`", (0.5, 0.5))
    >>> total = Weighting("sum", "`loss_reduction: sum`", (1.0, 1.0))
    >>> verdict = judge(10.0, (4.0, 6.0), mean, [total], rtol=1e-4)
    >>> verdict.exact, verdict.recombined, verdict.fits.name
    (False, 5.0, 'sum')
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from retune.errors import RetuneError
from retune.oom import clear_device_cache, forget_exception, is_oom_error
from retune.probing.attributes import attributes_kept
from retune.probing.metric_states import metrics_kept
from retune.random_state import preserved_rng
from retune.recovery.loss_items import BUILTIN, ItemsFn
from retune.recovery.micro_batches import LossReduction, loss_weights, samples_in
from retune.recovery.split import SplitFn, split_batch
from retune.step_parts import StepParts

FULL_RTOL = 1e-4
"""Float noise between a batch's loss and its halves' recombined, in float32 (and float64): the two sides
sum the same per-sample terms in another order and run kernels shaped for another batch, which moves a loss
by about 1e-7 of itself (measured on the tests' models: at most 1.0e-7, and 5e-8 under CPU bf16 autocast).
The losses this check is for differ by far more (a sum loss left at mean: 0.5; InfoNCE over 8 samples: 0.14;
a causal LM counted without the shift: 0.1 once trained a little, 1.2e-3 to 1.9e-4 from initialisation).
1e-4 is 1000x above the noise and still catches the last of these."""
REDUCED_RTOL = 1e-2
"""The same under reduced precision (bf16/fp16 autocast or weights, TF32 matmuls or convolutions on a GPU):
one rounding of a 16-bit value is up to 4e-3 of it (bf16), and a GPU picks kernels per batch shape that
round differently (not measured here: no GPU; CPU bf16 autocast rounds both sides alike). A sum (0.5),
in-batch (0.14) or trained causal-LM miscount (0.1) is still well above it; a miscount from initialisation
is not, and passes."""
SCALE_FLOOR = 1e-6
"""The smallest loss magnitude the relative tolerance is taken of, so that two losses of 0 (or 1e-9) compare
as equal instead of dividing noise by nothing."""


@dataclass(frozen=True)
class Weighting:
    """One way of recombining the halves' losses: ``name``, the setting that selects it, and the two weights."""

    name: str
    setting: str
    weights: tuple[float, ...]


@dataclass(frozen=True)
class Verdict:
    """What the check found on one batch (picklable: ranks exchange it)."""

    exact: bool
    whole: float
    halves: tuple[float, ...]
    configured: Weighting
    recombined: float
    difference: float
    """``|whole - recombined|`` relative to the larger magnitude of the two."""
    rtol: float
    fits: Weighting | None = None
    """Another weighting that reproduces the whole batch's loss within ``rtol`` (the closest one), if any."""


def recombine(halves: Sequence[float], weights: Sequence[float]) -> float:
    """The halves' losses combined as a recovered step combines its micro-batches' (a 0 weight leaves the
    piece out, as the recovery never back-propagates it: its token mean may be 0/0)."""
    return sum(loss * w for loss, w in zip(halves, weights, strict=True) if w != 0.0)


def relative_difference(a: float, b: float) -> float:
    """``|a - b|`` relative to the larger of ``|a|``, ``|b|`` and :data:`SCALE_FLOOR`.

    >>> relative_difference(2.0, 1.0), relative_difference(0.0, 0.0)
    (0.5, 0.0)
    """
    return abs(a - b) / max(abs(a), abs(b), SCALE_FLOOR)


def judge(
    whole: float, halves: Sequence[float], configured: Weighting, others: Sequence[Weighting], rtol: float
) -> Verdict:
    """Is the configured weighting exact on these numbers, and if not, which other one fits best?"""
    recombined = recombine(halves, configured.weights)
    difference = relative_difference(whole, recombined)
    exact = difference <= rtol
    fits = None
    if not exact:
        scored = [(relative_difference(whole, recombine(halves, w.weights)), w) for w in others]
        close = sorted((d, i, w) for i, (d, w) in enumerate(scored) if d <= rtol)
        fits = close[0][2] if close else None
    return Verdict(exact, whole, tuple(halves), configured, recombined, difference, rtol, fits)


def refusal(verdict: Verdict, samples: Sequence[int | None], opt_out: str, rank: int | None = None) -> str:
    """The message that refuses the ``oom`` trigger: what was measured, the likely cause, the way out."""
    where = "" if rank is None else f" of rank {rank}"
    pieces = " + ".join("?" if n is None else str(n) for n in samples)
    halves = ", ".join(f"{loss:.6g}" for loss in verdict.halves)
    weights = ", ".join(f"{w:.4g}" for w in verdict.configured.weights)
    measured = (
        f"the `oom` trigger recovers a step that runs out of memory in micro-batches, whose losses it weights as "
        f"{verdict.configured.setting} says; on the first training batch{where} that does not give the whole "
        f"batch's loss: the whole batch's is {verdict.whole:.6g}, its halves' ({pieces} samples) are {halves}, "
        f"weighted ({weights}) {verdict.recombined:.6g}, {verdict.difference:.2g} apart (float noise is below "
        f"{verdict.rtol:g}). A recovered step would then make another update than the whole batch's."
    )
    fits = verdict.fits
    if fits is None:
        cause = (
            " No weighting of the halves gives the whole batch's loss (mean, sum, or a token mean over the labels "
            "or the shifted labels): the loss couples the samples of a batch, as an in-batch contrastive loss "
            "(InfoNCE, CLIP: each sample's negatives are the batch's other samples) or a batch-level statistic "
            "does, so recovery in micro-batches cannot be exact for it. Remove the `oom` trigger (a smaller batch "
            "changes such a loss), or"
        )
        if verdict.configured.name.startswith("token_mean"):
            cause += (
                " if your loss is a token mean over other items than these, give loss_items a function that counts "
                "them; or"
            )
    elif fits.name == "sum":
        cause = (
            f" The whole batch's loss is the sum of its halves': a sum-reduced loss. Set {fits.setting} on the "
            "oom trigger; or"
        )
    elif fits.name == "token_mean:shifted_labels":
        cause = (
            " The halves weighted by their shifted labels (batch['labels'][..., 1:] that are not -100) give the "
            "whole batch's loss: a causal LM, whose position t predicts label t + 1. Set "
            f"{fits.setting} on the oom trigger; or"
        )
    elif fits.name.startswith("token_mean"):
        cause = (
            " The halves weighted by their labelled tokens (batch['labels'] that are not -100) give the whole "
            f"batch's loss: a mean over tokens. Set {fits.setting} on the oom trigger; or"
        )
    else:
        cause = (
            f" The halves weighted by their samples give the whole batch's loss: a mean over samples. Set "
            f"{fits.setting} on the oom trigger; or"
        )
    return (
        f"{measured}{cause} to train anyway, accepting recovered steps whose update differs from the whole "
        f"batch's, set {opt_out}."
    )


# -- the check on a real step (torch) --------------------------------------------------------------------------


def candidates(micro: Sequence[Any]) -> dict[str, Weighting]:
    """Every weighting of the halves retune knows, keyed by ``loss_reduction`` (``token_mean:<items>``).

    Token-mean weightings are offered only for a batch with per-token ``labels`` holding ignored positions
    (what a token mean averages over differs from the samples only then)."""
    found = {
        "mean": Weighting("mean", "`loss_reduction: mean`", tuple(loss_weights(micro, "mean"))),
        "sum": Weighting("sum", "`loss_reduction: sum`", tuple(loss_weights(micro, "sum"))),
    }
    labels = [m.get("labels") if isinstance(m, Mapping) else None for m in micro]
    if all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in labels):
        for name, fn in BUILTIN.items():
            setting = "`loss_reduction: token_mean`" + ("" if name == "labels" else f" with `loss_items: {name}`")
            weights = tuple(loss_weights(micro, "token_mean", fn))
            found[f"token_mean:{name}"] = Weighting(f"token_mean:{name}", setting, weights)
    return found


@contextmanager
def no_trace(module: nn.Module) -> Iterator[None]:
    """Run forwards that leave nothing behind: no graph, RNGs and buffers put back, dropout and BatchNorm
    in eval mode (dropout's rate 0 as well, for attention that reads it) for the duration, and the module's
    public attributes as they were (what a ``training_step`` appends to a list on the module, or counts in
    ``self.steps += 1``, is the run's steps only, as after a probe)."""
    layers = [m for m in module.modules() if isinstance(m, (_DropoutNd, _BatchNorm))]
    modes = [(m, m.training, m.p if isinstance(m, _DropoutNd) else None) for m in layers]
    buffers = [b for b in module.buffers() if isinstance(b, torch.Tensor)]
    saved = [b.detach().clone() for b in buffers]
    # metrics outermost: put back after the attributes, which would otherwise rename the updated state objects
    with metrics_kept(module), attributes_kept(module), preserved_rng(), torch.no_grad():
        try:
            for m, _, p in modes:
                m.training = False
                if p is not None:
                    m.p = 0.0
            yield
        finally:
            for m, training, p in modes:
                m.training = training
                if p is not None:
                    m.p = p
            for live, copy in zip(buffers, saved, strict=True):
                live.copy_(copy)


def uses_reduced_precision(module: nn.Module, precision_reduced: bool) -> bool:
    """True when the step computes below float32: a 16-bit precision setting, or TF32 on a CUDA device
    where the module uses it (:func:`tf32_in_use`, with torch's settings now)."""
    if precision_reduced:
        return True
    if not any(p.is_cuda for p in module.parameters()):
        return False
    matmul = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return tf32_in_use(module, matmul=matmul, cudnn=torch.backends.cudnn.allow_tf32)


CUDNN_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.RNNBase)
"""The layers cuDNN runs, whose float32 math ``torch.backends.cudnn.allow_tf32`` turns to TF32."""


def tf32_in_use(module: nn.Module, *, matmul: bool, cudnn: bool) -> bool:
    """Whether a float32 step of ``module`` on a GPU rounds to TF32 somewhere.

    Matmul TF32 (off by default) reaches every module; cuDNN's (on by default) only the layers cuDNN
    runs. So a float32 transformer on a GPU keeps the full-precision tolerance, and a causal LM counted
    without the shift is still refused there, while a CNN under cuDNN's default gets the wider one.

    Args:
        module: the LightningModule whose step is checked.
        matmul: whether float32 matmuls may use TF32.
        cudnn: whether cuDNN may use TF32.

    >>> tf32_in_use(nn.Sequential(nn.Linear(4, 4)), matmul=False, cudnn=True)
    False
    >>> tf32_in_use(nn.Sequential(nn.Conv2d(3, 4, 3)), matmul=False, cudnn=True)
    True
    """
    return matmul or (cudnn and any(isinstance(m, CUDNN_LAYERS) for m in module.modules()))


class _Skip(Exception):
    """The check cannot judge this batch (a reason agreed by every rank)."""


class ExactnessCheck:
    """The first-batch check, run by :class:`~retune.recovery.train_step.TrainStepRecovery` before the batch trains.

    ``agree(obj)`` returns every rank's ``obj`` in rank order (``[obj]`` on one device): the ranks exchange
    their state after each forward, so they run the same forwards (a ``training_step`` that calls a collective,
    ``self.all_gather`` for a cross-rank contrastive loss, stays matched), skip together, and refuse together
    (one rank refusing while the others train would leave them waiting in the gradient all-reduce).
    ``note(msg)`` says why a check was skipped; ``warn(msg)`` warns where the user must know it did not judge.
    """

    def __init__(
        self,
        module: nn.Module,
        loss_reduction: LossReduction,
        items_fn: ItemsFn,
        split_fn: SplitFn | None,
        precision_reduced: bool,
        agree: Callable[[Any], list[Any]],
        note: Callable[[str], None],
        warn: Callable[[str], None],
        opt_out: str = "`check_exactness: false` on the oom trigger",
    ) -> None:
        self.module = module
        self.loss_reduction = loss_reduction
        self.items_fn = items_fn
        self.split_fn = split_fn
        self.precision_reduced = precision_reduced
        self.agree = agree
        self.note = note
        self.warn = warn
        self.opt_out = opt_out
        self.verdict: Verdict | None = None
        """What this rank measured (None: skipped, or not run yet); kept for tests and reports."""
        self.skipped: str | None = None
        """Why the check did not judge, when it did not."""

    def __call__(self, step: StepParts) -> None:
        try:
            found, samples = self._measure(step)
        except _Skip as skip:
            self.skipped = str(skip)
            return
        refused = [(rank, v) for rank, v in enumerate(found) if not v.exact]
        if refused:
            rank, first = refused[0]
            raise RetuneError(refusal(first, samples, self.opt_out, rank if len(found) > 1 else None))

    # -- the measurement -------------------------------------------------------------------------------------

    def _measure(self, step: StepParts) -> tuple[list[Verdict], list[int | None]]:
        micro, configured, others = self._prepare(step.batch)
        samples = [samples_in(m) for m in micro]
        rtol = REDUCED_RTOL if uses_reduced_precision(self.module, self.precision_reduced) else FULL_RTOL
        with no_trace(self.module):
            whole = self._loss(step, step.batch, "the whole batch")
            halves = tuple(self._loss(step, m, "a half of the batch") for m in micro)
            self.verdict = judge(whole, halves, configured, others, rtol)
            found: list[Verdict] = self.agree(self.verdict)
            if any(not v.exact for v in found):
                # before refusing: is the loss itself random (F.dropout at its own rate, stochastic depth, noise
                # added in training_step)? The RNG has moved on since the first forward, so such a loss moves too
                again = self._loss(step, step.batch, "the whole batch")
                moved = relative_difference(again, whole) > rtol
                if any(self.agree(moved)):
                    self.warn(
                        "the `oom` trigger's exactness check was skipped: the first training batch's loss changes "
                        f"between two forwards ({whole:.6g}, then {again:.6g}) with dropout and BatchNorm in eval "
                        "mode, so randomness retune cannot switch off (F.dropout at its own rate, stochastic depth, "
                        "noise added in training_step) hides whether a recovered step would be exact. Make sure "
                        "loss_reduction matches your loss (docs: guides/oom.md)"
                    )
                    self.verdict = None
                    raise _Skip("the loss is random")
        return found, samples

    def _prepare(self, batch: Any) -> tuple[list[Any], Weighting, list[Weighting]]:
        """The halves and their weightings; a batch that cannot be split or counted is skipped on every rank
        (the recovery's own first-batch checks then raise what is wrong with it)."""
        reason = None
        micro: list[Any] = []
        configured = Weighting("", "", ())
        others: list[Weighting] = []
        try:
            micro = split_batch(batch, 2, self.split_fn)
            if len(micro) < 2:
                reason = "the first training batch holds one sample, which cannot be split in two"
            else:
                configured, others = self._weightings(micro)
        except Exception as exc:  # SplitError, a loss_items count that fails: reported by the recovery's checks
            reason = f"the first training batch cannot be split or counted ({type(exc).__name__}: {exc})"
        self._agree_or_skip(reason)
        return micro, configured, others

    def _weightings(self, micro: Sequence[Any]) -> tuple[Weighting, list[Weighting]]:
        known = candidates(micro)
        if self.loss_reduction == "token_mean":
            items = items_name(self.items_fn)
            name = f"token_mean:{items}"
            setting = "`loss_reduction: token_mean`" + ("" if items == "labels" else f" with `loss_items: {items}`")
            configured = Weighting(name, setting, tuple(loss_weights(micro, "token_mean", self.items_fn)))
        else:
            configured = known[self.loss_reduction]
        others = [w for key, w in known.items() if key != configured.name]
        return configured, others

    def _loss(self, step: StepParts, batch: Any, what: str) -> float:
        reason = None
        value = math.nan
        ran_out = False
        error: Exception | None = None
        try:
            with step.logs.discard(batch):
                result = step.forward(batch)
            loss = step.loss_of(result)
            del result
            if loss is None:
                reason = f"training_step returned no loss for {what}"
            else:
                value = float(loss.detach().float().sum())
                if not math.isfinite(value):
                    reason = f"the loss of {what} is {value}"
        except Exception as exc:
            ran_out = is_oom_error(exc)
            message = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
            kind = type(exc).__name__
            forget_exception(exc)  # its frames hold the forward's activations
            if ran_out:
                reason = f"{what} ran out of memory in a forward without gradients"
            else:
                # a step that needs gradients (torch.autograd.grad for a gradient penalty, a hook registered on an
                # activation) raises without them: the same forward with them tells it from a genuine error (one
                # that only a half batch meets, say), which must reach the user now, not at the first recovery
                error, ran = self._forward_with_gradients(step, batch)
                reason = (
                    f"training_step raised {kind} ({message}) on {what} in a forward without gradients "
                    "(torch.no_grad, as the check runs) and "
                    + ("ran with them" if ran else "ran out of memory with them")
                )
        if error is not None:  # outside the except block: the no-gradient attempt's frames are gone
            self.agree(f"training_step raised {type(error).__name__} on {what}")  # the others skip; the step's status
            raise error  # tells them
        if ran_out:
            clear_device_cache()
        self._agree_or_skip(reason)
        return value

    def _forward_with_gradients(self, step: StepParts, batch: Any) -> tuple[Exception | None, bool]:
        """The check's forward again, with gradients (no backward): ``(error, ran)``; the error (with the user's
        traceback) where it raised anything but an out-of-memory error, which the check then skips on."""
        try:
            with torch.enable_grad(), step.logs.discard(batch):
                result = step.forward(batch)
            del result
        except Exception as exc:
            if not is_oom_error(exc):
                return exc, False
            forget_exception(exc)
            clear_device_cache()
            return None, False
        return None, True

    def _agree_or_skip(self, reason: str | None) -> None:
        """Skip the check on every rank when one has a reason: a warning where the user's step kept the check
        from running (the loss reduction is then unchecked), else a note."""
        reasons = [r for r in self.agree(reason) if r is not None]
        if reasons:
            user = [r for r in reasons if r.startswith("training_step raised")]
            if user:  # on every rank, whichever rank's step it was
                self.warn(
                    f"the `oom` trigger's exactness check was skipped: {user[0]}. A recovered step is exact only "
                    "when `loss_reduction` matches how training_step reduces its loss (docs: guides/oom.md)"
                )
            else:
                self.note(f"the `oom` trigger's exactness check was skipped: {reasons[0]}")
            raise _Skip(reasons[0])


def items_name(fn: ItemsFn) -> str:
    """``labels``, ``shifted_labels`` or the function's dotted name, as the schedule would write it.

    >>> from retune.recovery.loss_items import shifted_label_items
    >>> items_name(shifted_label_items)
    'shifted_labels'
    """
    for name, builtin in BUILTIN.items():
        if fn is builtin:
            return name
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}.{qualname}" if module else str(qualname)


__all__ = [
    "FULL_RTOL",
    "CUDNN_LAYERS",
    "REDUCED_RTOL",
    "SCALE_FLOOR",
    "ExactnessCheck",
    "Verdict",
    "Weighting",
    "candidates",
    "items_name",
    "judge",
    "no_trace",
    "recombine",
    "refusal",
    "relative_difference",
    "tf32_in_use",
    "uses_reduced_precision",
]
