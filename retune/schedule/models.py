"""The schedule format: pydantic models for what users write in YAML, JSON or TOML.

Field names here are the public file format. Every model forbids unknown keys (a misspelt key
must never be silently ignored) and is frozen after validation, so a schedule shared between
callbacks cannot drift. Numbers and booleans are strict: a quoted ``init_val: "2"`` or
``warm_start: 1`` is a type error rather than a guess (YAML itself reads unquoted ``yes``/``on``
as true, as every YAML 1.1 parser does).

Example:
    >>> from retune import load_schedule
    >>> s = load_schedule({"triggers": [{"kind": "fit_start"}, {"kind": "epoch", "at": [5]}]})
    >>> s.search.mode, s.triggers[1].at
    ('binsearch', (5,))
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from retune.schedule.dotted import DOTTED_RE, resolve_dotted

DEFAULT_BUCKETS = 6
"""Buckets when the schedule does not say: enough to take most of the padding and memory waste out of
long-tailed text and speech data, few enough that re-tuning every bucket stays cheap (a re-tune costs
about ``buckets + 2`` probes)."""


SearchMode = Literal["power", "binsearch", "model"]
Objective = Literal["largest", "throughput"]
Stage = Literal["train", "val", "test", "predict"]
StrictFloat = Annotated[float, Strict()]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_NUMBER_RE = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(text: str) -> int:
    """Parse ``"512MiB"``, ``"2GB"`` or ``"1.5 GiB"`` into bytes; raise ValueError otherwise."""
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{text!r} is not a memory size; write a number with a unit such as '512MiB', '2GB' "
            f"or '1.5GiB' (units: {', '.join(u for u in _UNITS if u)})"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"{text!r} is less than one byte")
    return int(value)


class FieldConflict(ValueError):
    """A value that conflicts with another field's (written or defaulted), raised by a model validator.

    Pydantic locates a model validator's error at the model itself (a list validator's at the list); ``field``
    names the key (or the index) to point at (``retune.schedule.loading`` appends it to the error's path).
    """

    def __init__(self, field: str | int, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SearchConfig(_Config):
    """How the largest batch size is searched; the semantics follow Lightning's ``BatchSizeFinder``."""

    mode: SearchMode = Field(
        "binsearch",
        description="power: double until out of memory; binsearch: double, then bisect; "
        "model: fit memory = fixed + per_sample * batch size and verify the prediction.",
    )
    init_val: StrictInt = Field(2, ge=1, description="First size tried by a cold search.")
    steps_per_trial: StrictInt = Field(3, ge=1, description="Training steps run at each candidate size.")
    max_trials: StrictInt = Field(25, ge=1, description="Most candidate sizes tried in one search.")
    margin: StrictFloat = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description=(
            "Safety cut applied to the size found by binsearch (and model): found * (1 - margin). Where the "
            "probes measure a memory line (mode: model, batching: buckets, predict), to the size at which the "
            "line reaches the limit, never above the size that fit (2.7 -> 2 at 0.05, not int(2 * 0.95) = 1)."
        ),
    )
    max_val: StrictInt = Field(8192, ge=1, description="Largest batch size ever tried.")
    warm_start: StrictBool = Field(
        True,
        description="A re-tune starts from the last found size and searches in the direction the trigger "
        "implies, instead of climbing from init_val again.",
    )

    objective: Objective = Field(
        "largest",
        description="largest: the largest size that fits; throughput: among the sizes that fit, the one with the "
        "most samples per second, timed on the probes' steps after the first of each trial (with batching: "
        "buckets, timed in the bucket with the most padded work, and every bucket capped at the same padded "
        "work per step).",
    )
    throughput_tolerance: StrictFloat = Field(
        0.02,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="throughput: sizes within this fraction of the fastest count as ties, and the smallest of "
        "them is chosen (less memory, more optimizer steps).",
    )

    probe_samples: Literal["first", "largest"] = Field(
        "first",
        description="first: probe on the first batches of the dataloader; largest: every probe batch at size b "
        "holds the b largest samples of the dataset (pad-to-longest text, variable image sizes), read once "
        "and sized by sample_size.",
    )
    sample_size: Union[StrictStr, None] = Field(
        None,
        description="Dotted path to fn(sample) -> int, e.g. 'mypkg.sizes.tokens' (or 'mypkg.sizes:tokens'); null: "
        "the number of elements in the sample's tensors, numbers and strings.",
    )
    scan_limit: Union[Annotated[StrictInt, Field(ge=1)], None] = Field(
        None,
        description="largest: size only this many samples, a seeded random subset (null: every sample); "
        "the largest samples may be missed.",
    )

    batching: Literal["fixed", "buckets"] = Field(
        "fixed",
        description="fixed: one train batch size for every batch; buckets: samples grouped by size (sample_size) "
        "into `buckets` buckets, each with its own batch size, the largest that fits its longest samples.",
    )
    buckets: Annotated[StrictInt, Field(ge=2)] = Field(
        DEFAULT_BUCKETS,
        description="batching: buckets: how many length buckets (at least 2; fewer are made when the samples "
        "have fewer distinct sizes).",
    )

    predict: Literal["off", "auto"] = Field(
        "off",
        description="auto: trace the training step on fake tensors (no compute, no memory) at a few sizes, jump to "
        "the largest size the traced peak line keeps within the limit, and verify it with real probes, "
        "calibrating the prediction on them (a size is used only after a real probe fit); where the step cannot "
        "be traced (a data-dependent operator, a custom kernel) or there is no "
        "limit to predict against "
        "(no memory.budget, no device statistics), it says why once and searches with real probes. A trace costs "
        "Python dispatch per operator whatever the size or device: worth it where a real step costs more (large "
        "models, long sequences, many buckets), not for a small model on a GPU. off: real probes only (the "
        "search set by mode).",
    )

    @field_validator("predict", mode="before")
    @classmethod
    def _yaml_switch(cls, value: Any) -> Any:
        # YAML 1.1 (PyYAML) reads a bare `off` (and `no`) as false: `predict: off` means "off". A true (`true`,
        # `yes`, a bare `on`) names no value: refused, with the word to write, rather than read as one
        if value is False:
            return "off"
        if value is True:
            raise ValueError("predict takes 'off' or 'auto', not a boolean: write predict: auto")
        return value

    @field_validator("sample_size")
    @classmethod
    def _dotted_path(cls, value: str | None) -> str | None:
        if value is not None and not DOTTED_RE.match(value):
            raise ValueError(
                f"{value!r} is not a dotted path to a function; write 'package.module.function' "
                "or 'package.module:function'"
            )
        if value is not None:
            resolve_dotted(value, "fn(sample) -> int")  # `retune validate` refuses what the callback would
        return value

    @field_validator("batching")
    @classmethod
    def _buckets_need_every_size(cls, value: str, info: ValidationInfo) -> str:
        if value == "buckets" and info.data.get("scan_limit") is not None:
            raise ValueError(
                "buckets needs every sample's size to put it in a bucket, so it cannot be combined with "
                "search.scan_limit; remove scan_limit"
            )
        if value == "buckets" and info.data.get("mode") == "power":
            # power promises sizes that are init_val doubled; a bucket's size is read off a memory model of its
            # lengths (retune.buckets.sizes), whatever mode says, so that promise would be broken in silence
            raise ValueError(
                "buckets sizes each bucket from a memory model of its lengths, so its sizes are not init_val doubled "
                "as search.mode: power promises; remove mode (binsearch) or use batching: fixed"
            )
        return value

    @field_validator("objective")
    @classmethod
    def _timed_steps(cls, value: str, info: ValidationInfo) -> str:
        steps = info.data.get("steps_per_trial")
        if value == "throughput" and steps is not None and steps < 2:
            raise ValueError(
                f"objective {value!r} times the steps after the first of each trial (the first warms up), so it "
                f"needs search.steps_per_trial >= 2, got {steps}"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SearchConfig:
        # on the final values, defaults included: `init_val: 10000` conflicts with the default max_val 8192 as
        # surely as with one written in the file. The error names a field the user wrote (they can change it).
        if self.max_val < self.init_val:
            field = "max_val" if "max_val" in self.model_fields_set else "init_val"
            raise FieldConflict(
                field,
                f"max_val ({self._shown('max_val')}) must be >= init_val ({self._shown('init_val')}); raise "
                "max_val or lower init_val",
            )
        # a field another field makes meaningless is refused where the file chose its value: written, and other
        # than the default (the annotated reference block restates every default, and copies of it must load)
        if self._chosen("scan_limit") and self.probe_samples == "first":
            raise FieldConflict(
                "scan_limit",
                f"scan_limit ({self.scan_limit}) limits the samples probe_samples: largest sizes, but probe_samples "
                f"is {self._is('probe_samples')}, which sizes none; set `probe_samples: largest` or remove "
                "scan_limit",
            )
        if self._chosen("margin") and self.margin > 0 and self.mode == "power":  # 0 says what power does
            raise FieldConflict(
                "margin",
                f"margin ({self.margin}) cuts the size binsearch or model find, but mode is {self._is('mode')}, "
                "whose sizes (init_val doubled) are used as tried, with no margin; set `mode: binsearch` for a "
                "margin, or remove margin",
            )
        if self._chosen("buckets") and self.batching == "fixed":
            raise FieldConflict(
                "buckets",
                f"buckets ({self.buckets}) is how many length buckets batching: buckets makes, but batching is "
                f"{self._is('batching')}, which makes none; set `batching: buckets` or remove buckets",
            )
        if self._chosen("throughput_tolerance") and self.objective == "largest":
            raise FieldConflict(
                "throughput_tolerance",
                f"throughput_tolerance ({self.throughput_tolerance}) picks among the fastest sizes of objective: "
                f"throughput, but objective is {self._is('objective')}, which times none; set `objective: "
                "throughput` or remove throughput_tolerance",
            )
        return self

    def _chosen(self, field: str) -> bool:
        """Whether the file wrote ``field`` with a value other than its default."""
        return field in self.model_fields_set and getattr(self, field) != type(self).model_fields[field].default

    def _shown(self, field: str) -> str:
        value = getattr(self, field)
        return f"{value}" if field in self.model_fields_set else f"{value}, the default"

    def _is(self, field: str) -> str:
        value = getattr(self, field)
        return f"{value!r}" if field in self.model_fields_set else f"{value!r} (the default)"


MIN_BUDGET_FRACTION = 1e-6
"""The smallest fraction ``memory.budget`` takes: below it (``1e-300``, ``1e-9``) a fraction is bytes or nothing
of any device; a budget that small is written as an absolute size."""


class MemoryConfig(_Config):
    """What counts as "does not fit"."""

    budget: Union[float, str, None] = Field(
        None,
        description="null: only a real out-of-memory error counts; a number in (0, 1] (quoted or not): that "
        "fraction of the device's total memory; a size with a unit such as '512MiB' or '2GB': an absolute size.",
    )

    @field_validator("budget", mode="before")
    @classmethod
    def _check_budget(cls, value: object) -> float | str | None:
        if value is None:
            return None
        shown = f"{value}"
        if isinstance(value, str):
            if not _NUMBER_RE.match(value):
                parse_byte_size(value)
                return value
            # a quoted number means the number (`budget: "0.8"` is the fraction 0.8, as `budget: 0.8` is), not
            # a count of bytes: a unit is what makes a size absolute
            shown, value = repr(value), float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"expected null, a fraction of device memory in (0, 1], or a size such as '512MiB', got {value!r}"
            )
        if not 0.0 < value <= 1.0:
            raise ValueError(
                f"a number budget is a fraction of device memory in (0, 1], got {shown}; "
                "write absolute sizes with a unit, e.g. '512MiB'"
            )
        if value < MIN_BUDGET_FRACTION:
            # 1e-300 of any device is 0 bytes, as '0MiB' is ("less than one byte"): not a budget anyone means
            raise ValueError(
                f"a fraction budget below a millionth of device memory leaves {int(value * 80e9)} bytes of an 80 GB "
                f"GPU, got {shown}; write a fraction such as 0.8, or a budget that small as a size with a unit, "
                "e.g. '64KiB'"
            )
        return value

    def budget_bytes(self, device_total_bytes: int | None) -> int | None:
        """The budget in bytes, or None when no budget is set (or a fraction has no total to apply to)."""
        if self.budget is None:
            return None
        if isinstance(self.budget, str):
            return parse_byte_size(self.budget)
        if device_total_bytes is None:
            return None
        return int(self.budget * device_total_bytes)


class FitStartTrigger(_Config):
    """Search once when ``fit`` starts (at the first epoch start, after freezing callbacks ran)."""

    kind: Literal["fit_start"] = "fit_start"


class EpochTrigger(_Config):
    """Search at the start of given epochs (0-based, as ``trainer.current_epoch``)."""

    kind: Literal["epoch"] = "epoch"
    at: Union[tuple[Annotated[StrictInt, Field(ge=0)], ...], None] = Field(
        None, description="Epochs at whose start to search, e.g. [5, 10]."
    )
    every: Union[Annotated[StrictInt, Field(ge=1)], None] = Field(
        None, description="Search at the start of every N-th epoch (N, 2N, ...)."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> EpochTrigger:
        if (self.at is None) == (self.every is None):
            which = "both" if self.at is not None else "neither"
            raise ValueError(f"set exactly one of `at` (a list of epochs) or `every` (N >= 1); {which} given")
        return self

    @field_validator("at")
    @classmethod
    def _some_epoch(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and len(value) == 0:
            raise ValueError("list at least one epoch")
        return value


class ParamGroupsChangedTrigger(_Config):
    """Search when the set of parameters in the optimizers' param groups changes."""

    kind: Literal["param_groups_changed"] = "param_groups_changed"


class TrainableParamsChangedTrigger(_Config):
    """Search when the number of trainable (``requires_grad``) parameters changes."""

    kind: Literal["trainable_params_changed"] = "trainable_params_changed"
    min_fraction: StrictFloat = Field(
        0.0,
        allow_inf_nan=False,
        description="Fire only when the trainable-parameter count changes by more than this fraction of the "
        "last count, 0 <= x < 1 (0.05: 5%).",
    )

    @field_validator("min_fraction")
    @classmethod
    def _a_fraction(cls, value: float) -> float:
        # a freeze can change the count by at most all of it (1.0), so 1 or more would never fire on one;
        # `5` is almost always 5% written as a percentage
        if not 0.0 <= value < 1.0:
            raise ValueError(
                f"min_fraction is a fraction of the trainable-parameter count, 0 <= x < 1 (0.05 for 5%), got {value}"
            )
        return value


class FtsPhaseTrigger(_Config):
    """Search when finetuning-scheduler moves to another phase (epoch- or early-stopping-driven)."""

    kind: Literal["fts_phase"] = "fts_phase"


class OomTrigger(_Config):
    """Recover a real step that runs out of memory (the same batch in micro-batches, nothing lost), then
    search again at the next epoch start, below the size that failed."""

    kind: Literal["oom"] = "oom"
    loss_reduction: Literal["mean", "sum", "token_mean"] = Field(
        "mean",
        description="How training_step's loss combines the batch, so that a step recovered in micro-batches "
        "makes the whole batch's update: mean (over samples) weights each micro-batch's loss by its share of "
        "the samples, token_mean (over labelled tokens, Hugging Face's token-classification, masked-LM and "
        "causal-LM losses) by its share of the items loss_items counts, sum adds them.",
    )
    loss_items: Union[StrictStr, None] = Field(
        None,
        description="token_mean: what the loss averages over. labels (default): entries of batch['labels'] that "
        "are not -100; shifted_labels: batch['labels'][..., 1:] that are not -100 (a causal LM's shifted loss); "
        "or a dotted path to fn(batch) -> int, e.g. 'mypkg.items.count'.",
    )

    check_exactness: StrictBool = Field(
        True,
        description="At fit start, before the first batch trains, compare its loss with its two halves' losses "
        "recombined as loss_reduction says (one extra forward of the batch and its halves, without gradients) "
        "and refuse the oom trigger when they differ: a sum loss left at mean, a causal LM counted without "
        "shifted_labels, an in-batch contrastive loss that no recovery can make exact. false: skip the check and "
        "accept recovered steps whose update may differ from the whole batch's.",
    )

    @field_validator("loss_items")
    @classmethod
    def _items(cls, value: str | None) -> str | None:
        if value is None or value in ("labels", "shifted_labels"):
            return value
        if not DOTTED_RE.match(value):
            raise ValueError(
                f"{value!r} is neither labels, shifted_labels nor a dotted path to a function; write "
                "'package.module.function' or 'package.module:function'"
            )
        resolve_dotted(value, "fn(batch) -> int")
        return value

    @model_validator(mode="after")
    def _items_need_token_mean(self) -> OomTrigger:
        # only a token-mean loss counts items: anything else would drop the field without a word
        if self.loss_items is not None and self.loss_reduction != "token_mean":
            written = "" if "loss_reduction" in self.model_fields_set else " (the default)"
            raise FieldConflict(
                "loss_items",
                f"loss_items ({self.loss_items!r}) counts what a token_mean loss averages over, but loss_reduction "
                f"is {self.loss_reduction!r}{written}, which does not use it; set `loss_reduction: token_mean` "
                "or remove loss_items",
            )
        return self


TriggerConfig = Annotated[
    Union[
        FitStartTrigger,
        EpochTrigger,
        ParamGroupsChangedTrigger,
        TrainableParamsChangedTrigger,
        FtsPhaseTrigger,
        OomTrigger,
    ],
    Field(discriminator="kind"),
]
TRIGGER_KINDS: tuple[str, ...] = (
    "fit_start",
    "epoch",
    "param_groups_changed",
    "trainable_params_changed",
    "fts_phase",
    "oom",
)


class ApplyConfig(_Config):
    """What else changes when the batch size changes."""

    accumulate: Literal["free", "keep_effective"] = Field(
        "free",
        description="free: leave gradient accumulation alone; keep_effective: adjust it so batch size x "
        "accumulation stays the effective batch size of the first tune.",
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="Scale learning rates by k or sqrt(k) when the effective batch size changes by k."
    )


class LRFindConfig(_Config):
    """The learning-rate range test ``ScheduledLRFinder`` runs when a trigger fires (see ``retune.lr.range_test``)."""

    min_lr: StrictFloat = Field(1e-7, gt=0.0, allow_inf_nan=False, description="First learning rate of the sweep.")
    max_lr: StrictFloat = Field(1.0, gt=0.0, allow_inf_nan=False, description="Last learning rate of the sweep.")
    mode: Literal["exponential", "linear"] = Field(
        "exponential", description="exponential: rates evenly spaced in log(lr); linear: evenly spaced in lr."
    )
    skip_begin: StrictInt = Field(10, ge=0, description="Points of the curve the suggestion ignores at its start.")
    skip_end: StrictInt = Field(1, ge=0, description="Points of the curve the suggestion ignores at its end.")
    steps: StrictInt = Field(100, ge=2, description="Training steps (one batch each) in one range test.")
    early_stop_threshold: Union[Annotated[StrictFloat, Field(gt=1.0, allow_inf_nan=False)], None] = Field(
        4.0,
        description="Stop the test once the smoothed loss exceeds this many times the larger of its lowest value "
        "and its value at the third step (a non-finite loss always stops it); null: run every step.",
    )
    smoothing: StrictFloat = Field(
        0.98,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="Exponential moving average factor for the loss (0: no smoothing).",
    )
    suggestion: Literal["valley", "steepest", "min_div10"] = Field(
        "valley",
        description="valley: halfway into the longest decreasing stretch of the smoothed loss (fastai); steepest: "
        "where it falls fastest in log(lr) (Lightning's method); min_div10: the rate at its minimum / 10.",
    )
    groups: Union[Literal["new", "all"], tuple[StrictInt, ...]] = Field(
        "new",
        description="Param groups a range test sets: new: the groups holding parameters that were added or unfrozen "
        "since the last epoch start (every group at fit start, and when none were); all; or a list of group "
        "indices, honoured at fit start too.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LRFindConfig:
        # on the final values, defaults included: `min_lr: 2.0` conflicts with the default max_lr 1.0 as surely
        # as with one written in the file. The error names a field the user wrote (they can change it).
        if self.max_lr <= self.min_lr:
            field = "max_lr" if "max_lr" in self.model_fields_set else "min_lr"
            raise FieldConflict(
                field,
                f"max_lr ({self._shown('max_lr')}) must be greater than min_lr ({self._shown('min_lr')})",
            )
        if self.steps < self.skip_begin + self.skip_end + 2:
            skips = [f for f in ("skip_begin", "skip_end") if f in self.model_fields_set]
            blamed = "steps" if "steps" in self.model_fields_set or not skips else max(skips, key=self._value)
            raise FieldConflict(
                blamed,
                f"steps ({self._shown('steps')}) must leave at least 2 points of the curve after skip_begin "
                f"({self._shown('skip_begin')}) and skip_end ({self._shown('skip_end')})",
            )
        return self

    def _value(self, field: str) -> int:
        return int(getattr(self, field))

    def _shown(self, field: str) -> str:
        value = getattr(self, field)
        return f"{value}" if field in self.model_fields_set else f"{value}, the default"

    @field_validator("groups", mode="before")
    @classmethod
    def _group_selection(cls, value: object) -> object:
        if isinstance(value, str):
            if value not in ("new", "all"):
                raise ValueError(f"{value!r} is not a group selection; write 'new', 'all' or a list of group indices")
            return value
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("list at least one group index, or write 'new' or 'all'")
            bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 0]
            if bad:
                raise ValueError(f"group indices are integers >= 0, got {bad[0]!r}")
            repeated = sorted({v for v in value if value.count(v) > 1})
            if repeated:
                raise ValueError(
                    f"group indices must not repeat ({', '.join(map(str, repeated))} listed twice), got {list(value)}; "
                    "list each group once"
                )
            return tuple(value)
        raise ValueError(f"expected 'new', 'all' or a list of group indices, got {value!r}")


class StageBatchArgNames(_Config):
    """Per-stage batch-size attributes, used where the model or datamodule has them."""

    train: StrictStr = Field("train_batch_size", min_length=1)
    val: StrictStr = Field("val_batch_size", min_length=1)
    test: StrictStr = Field("test_batch_size", min_length=1)
    predict: StrictStr = Field("predict_batch_size", min_length=1)


class RetuneSchedule(_Config):
    """A complete schedule: when to re-run the batch-size search, and how."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        title="retune schedule",
    )

    version: Literal[1] = Field(1, description="Format version.")
    batch_arg_name: StrictStr = Field(
        "batch_size",
        min_length=1,
        description="Attribute holding the batch size, looked up on the model, model.hparams, "
        "the datamodule and datamodule.hparams (Lightning's lookup).",
    )
    search: SearchConfig = SearchConfig()
    memory: MemoryConfig = MemoryConfig()
    triggers: tuple[TriggerConfig, ...] = Field(
        ..., description="When to search (at least one); several firing at one epoch start give one search."
    )
    apply: ApplyConfig = ApplyConfig()
    lr_find: LRFindConfig = Field(
        LRFindConfig(), description="The learning-rate range test run by ScheduledLRFinder at the same triggers."
    )
    stages: tuple[Stage, ...] = Field(
        ("train",),
        description="Which stages' batch sizes to tune (at least one): train and val at the triggers, "
        "test and predict when trainer.test/predict start (val also at trainer.validate).",
    )
    stage_batch_arg_names: StageBatchArgNames = Field(
        StageBatchArgNames(),
        description="Each stage's own batch-size attribute; where the model or datamodule lacks it, the stage "
        "uses batch_arg_name.",
    )

    @field_validator("triggers")
    @classmethod
    def _some_trigger(cls, value: tuple[object, ...]) -> tuple[object, ...]:
        if not value:
            raise ValueError(f"list at least one trigger; kinds: {', '.join(TRIGGER_KINDS)}")
        seen: list[tuple[int, dict[str, Any]]] = []
        first_oom: int | None = None
        for index, trigger in enumerate(value):
            settings = trigger.model_dump() if isinstance(trigger, BaseModel) else {}
            same = next((i for i, known in seen if known == settings), None)
            if settings and same is not None:
                raise FieldConflict(
                    index,
                    f"repeats triggers[{same}] (kind {settings['kind']}, the same settings): a trigger listed "
                    "twice adds nothing; remove one",
                )
            if getattr(trigger, "kind", None) == "oom":
                if first_oom is not None:
                    raise FieldConflict(
                        index,
                        f"a second oom trigger (the first is triggers[{first_oom}]): only the first recovers a step "
                        "that runs out of memory, so this one's settings would be ignored; keep one oom trigger",
                    )
                first_oom = index
            seen.append((index, settings))
        return value

    @field_validator("stages")
    @classmethod
    def _unique_stages(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("list at least one of train, val, test, predict")
        if len(set(value)) != len(value):
            raise ValueError(f"stages must not repeat, got {list(value)}")
        return value


__all__ = [
    "ApplyConfig",
    "DEFAULT_BUCKETS",
    "EpochTrigger",
    "FieldConflict",
    "FitStartTrigger",
    "FtsPhaseTrigger",
    "LRFindConfig",
    "MIN_BUDGET_FRACTION",
    "MemoryConfig",
    "Objective",
    "OomTrigger",
    "ParamGroupsChangedTrigger",
    "RetuneSchedule",
    "SearchConfig",
    "SearchMode",
    "Stage",
    "StageBatchArgNames",
    "StrictFloat",
    "TRIGGER_KINDS",
    "TrainableParamsChangedTrigger",
    "TriggerConfig",
    "parse_byte_size",
]
