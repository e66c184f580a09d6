"""Predicting an FSDP2 step on one rank (a one-rank gloo mesh, ``gloo_group``): the unsharded fake trace, the rank's
account of its shards, the tracker's count of the storages FSDP2 resizes in place, and mixed precision (traced in
the dtype FSDP2 computes in). Two ranks: tests/fsdp2/run_rank_peak.py (plain torch) and
tests/distributed/test_fsdp2.py (through Lightning, ``predict``).

No out-of-memory error is involved: every peak here is a real CPU tracker count or a trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from retune.distributed.fsdp2 import (
    ShardAccount,
    compute_dtypes,
    fsdp_modules,
    gradient_shards,
    hooks_removed,
    why_not_traced,
)
from retune.distributed.local_shards import local
from retune.memory import CpuPeakTracker, measure_peak, resident_bytes
from retune.prediction import StepTrace, trace_step
from retune.prediction.sharded import rank_peak
from retune.prediction.trace import OptimizerPhase, trace_update
from tests.helpers.dist_utils import run_rank_scripts

pytest.importorskip("torch.distributed.fsdp")


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def _shard(model: nn.Module, **kwargs: Any) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for index in (0, 2, 4):
        fully_shard(model[index], mesh=mesh, **kwargs)  # type: ignore[index]
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
    model, (x, y) = _STEP_MODEL[0], batch
    nn.functional.cross_entropy(model(x), y).backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


_STEP_MODEL: list[nn.Module] = []


@pytest.fixture
def stepping() -> Iterator[list[nn.Module]]:
    yield _STEP_MODEL
    _STEP_MODEL.clear()


def _batch(size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)


def _trace(
    model: nn.Module, optimizer: torch.optim.Optimizer, size: int, stepping: list[nn.Module], **kwargs: Any
) -> StepTrace:
    stepping[:] = [model]
    result = trace_step(model, [optimizer], _batch(), size, _step, steps=1, **kwargs)
    assert isinstance(result, StepTrace), result
    return result


def _real_step(model: nn.Module, optimizer: torch.optim.Optimizer, size: int, seed: int = 1) -> int:
    with measure_peak(torch.device("cpu"), model, [optimizer]) as reading:
        x, y = _batch(size, seed)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert reading.peak_bytes is not None
    return reading.peak_bytes


def test_an_fsdp2_step_is_traced_as_the_plain_module_it_wraps(gloo_group: Any, stepping: list[nn.Module]) -> None:
    """On one rank a shard is the whole tensor, so the unsharded trace of the sharded model is the trace of the
    same model never sharded, byte for byte, at every size: FSDP2's hooks stay out and the fakes are whole."""
    plain, sharded = _layers(), _shard(_layers())
    plain_opt = torch.optim.AdamW(plain.parameters())
    sharded_opt = torch.optim.AdamW(sharded.parameters())
    for model, optimizer in ((plain, plain_opt), (sharded, sharded_opt)):
        _real_step(model, optimizer, 4)  # the optimizer state exists: the steady state
    for size in (16, 256):
        ours, theirs = _trace(sharded, sharded_opt, size, stepping), _trace(plain, plain_opt, size, stepping)
        assert (ours.peak_bytes, ours.resident_bytes) == (theirs.peak_bytes, theirs.resident_bytes)
        assert ours.optimizer == theirs.optimizer


def test_a_trace_leaves_the_sharded_model_as_it_was(gloo_group: Any, stepping: list[nn.Module]) -> None:
    """No trace: the shards, the optimizer state, FSDP2's hook tables (in their order) are as before, and the next
    real step trains the same weights as a twin that was never traced."""
    model, twin = _shard(_layers()), _shard(_layers())
    optimizer, twin_opt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(twin.parameters())
    for m, o in ((model, optimizer), (twin, twin_opt)):
        _real_step(m, o, 4)
    hooks = [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in model.modules()]
    before = [local(p).clone() for p in model.parameters()]
    _trace(model, optimizer, 64, stepping)
    assert hooks == [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in model.modules()]
    assert all(torch.equal(a, local(p)) for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    _real_step(model, optimizer, 8, seed=5)
    _real_step(twin, twin_opt, 8, seed=5)
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(local(ours), local(theirs))
    assert type(next(iter(model.parameters()))).__name__ == "DTensor"


def test_fsdp2_hooks_are_taken_out_and_put_back_in_order_and_user_hooks_stay(gloo_group: Any) -> None:
    model = _shard(_layers())
    user = model[2].register_forward_pre_hook(lambda module, args: None)  # type: ignore[index]
    tables = [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
    with hooks_removed(model):
        assert [len(m._forward_hooks) for m in fsdp_modules(model)] == [0, 0, 0, 0]
        assert [list(m._forward_pre_hooks) for m in fsdp_modules(model)] == [[], [], [user.id], []]
        added = model[4].register_forward_hook(lambda module, args, out: None)  # type: ignore[index]
    assert list(model[4]._forward_hooks)[-1] == added.id  # type: ignore[index]  # added in the block: it stays
    added.remove()
    after = [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
    assert [(list(a), list(b)) for a, b in after] == [(list(a), list(b)) for a, b in tables]
    assert after == tables


def test_the_ranks_account_counts_its_shards_and_the_two_largest_gathered_groups(gloo_group: Any) -> None:
    model = _shard(_layers())
    optimizer = torch.optim.AdamW(model.parameters())
    _real_step(model, optimizer, 4)
    account = ShardAccount.of(model, [optimizer], resident_bytes(model, [optimizer]))
    group_bytes = sorted((sum(p.numel() for p in model[i].parameters()) * 4 for i in (0, 2, 4)), reverse=True)  # type: ignore[index]
    assert account.fraction == 1.0  # one rank: its shard is the whole tensor
    assert account.gathered == group_bytes[0] + group_bytes[1]
    assert account.gradients == sum(p.numel() for p in model.parameters()) * 4
    assert account.reducing == group_bytes[0]  # the largest group's whole gradients, in the dtype it reduces in
    fixed = account.resident + account.gradients + 1000 + account.gathered + account.reducing
    assert account.fixed(created_whole=1000) == fixed


def test_the_prediction_with_the_ranks_account_is_within_20_percent_over_the_measured_fsdp2_peak(
    gloo_group: Any, stepping: list[nn.Module]
) -> None:
    """What a search predicts for a rank (:func:`rank_peak`: the trace with the rank's account of its shards) against
    the CPU tracker's peak of a real FSDP2 step at the same size: +11.9% at 64 samples, +17.2% at 512. Tolerance:
    2% under, 20% over. The activations are traced exactly (the first test); the rest is estimated from above,
    on purpose: what FSDP2 has gathered at the compute peak (the two largest groups, 96% of this model's
    parameters in one group; the real peak holds only the last group) and what it allocates to reduce (the
    largest group's gradients, which it reduces late in backward, when the activations are freed). Over is safe
    (a smaller first probe); the verifying probes and the calibration correct the constant in a search. On 2
    ranks, where a rank's gradients and state are halves, the same account is 0-5% over (run_rank_peak.py)."""
    model = _shard(_layers())
    optimizer = torch.optim.AdamW(model.parameters())
    _real_step(model, optimizer, 4)
    account = ShardAccount.of(model, [optimizer], resident_bytes(model, [optimizer]))
    shards = gradient_shards(model)
    for size in (64, 512):
        traced = _trace(model, optimizer, size, stepping, reduced_gradients=shards)
        predicted = rank_peak(traced, account, sum(shards.values()))
        measured = _real_step(model, optimizer, size)
        assert -0.02 <= (predicted - measured) / measured <= 0.20, (size, predicted, measured)


def test_the_tracker_counts_fsdp2s_unsharded_parameters_the_same_on_every_step(gloo_group: Any) -> None:
    """FSDP2 allocates and frees each unsharded parameter by resizing its storage in place, which a dispatch mode
    does not see. Before the tracker read those storages' sizes, the first step (which creates them) measured
    1,181,752 bytes here and every later step 905,256; now every step measures the same, above the plain model's
    peak by about the gathered parameters."""
    plain, sharded = _layers(), _shard(_layers())
    plain_opt, sharded_opt = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(sharded.parameters(), lr=0.1)
    plain_peaks = [_real_step(plain, plain_opt, 32, seed) for seed in range(3)]
    sharded_peaks = [_real_step(sharded, sharded_opt, 32, seed) for seed in range(3)]
    assert len(set(plain_peaks)) == 1 and len(set(sharded_peaks)) == 1, (plain_peaks, sharded_peaks)
    whole = sum(p.numel() * p.element_size() for p in plain.parameters())
    assert 0.9 * whole <= sharded_peaks[0] - plain_peaks[0] <= 1.1 * whole


def test_a_storage_resized_in_place_is_counted_at_its_size_now() -> None:
    kept = torch.empty(0)
    storage = kept.untyped_storage()
    tracker = CpuPeakTracker(resized=lambda: {storage._cdata: storage.nbytes()})
    with tracker:
        storage.resize_(4000)  # outside the dispatcher: seen at the next operator
        a = torch.empty(250)  # 1,000 bytes
        storage.resize_(0)
        b = torch.empty(250)
    del a, b
    assert tracker.peak_bytes == 5000


def test_mixed_precision_fsdp2_is_traced_in_the_dtype_it_computes_in(gloo_group: Any) -> None:
    """Which parameters FSDP2's ``MixedPrecisionPolicy`` gathers and computes in another dtype than they are stored
    in: every floating-point one where ``param_dtype`` differs, none stored in it already; such a model is traced
    (``why_not_traced``: None)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert why_not_traced(_shard(_layers())) is None and compute_dtypes(_shard(_layers())) == {}
    model = _shard(_layers(), mp_policy=bf16)
    assert why_not_traced(model) is None
    assert compute_dtypes(model) == {id(p): torch.bfloat16 for p in model.parameters()}
    mixed = _layers()
    mixed[4].to(torch.bfloat16)  # type: ignore[index]  # one group already bf16: only the others are cast
    mixed = _shard(mixed, mp_policy=bf16)
    cast = {id(p) for i in (0, 2) for p in mixed[i].parameters()}  # type: ignore[index]
    assert set(compute_dtypes(mixed)) == cast
    stored = _shard(_layers().to(torch.bfloat16), mp_policy=bf16)  # stored in the policy's dtype: nothing is cast
    assert compute_dtypes(stored) == {}
    outputs = _shard(_layers(), mp_policy=MixedPrecisionPolicy(output_dtype=torch.bfloat16))
    assert why_not_traced(outputs) is None and compute_dtypes(outputs) == {}


def test_fsdp2_offloaded_to_the_host_is_traced_on_a_cpu_run_and_refused_on_a_device_run(gloo_group: Any) -> None:
    """``CPUOffloadPolicy`` keeps a group's shards, reduced gradients and optimizer state on the host: on a CPU run
    the host is the device and the step traces as any other; on a device run (the group's compute device is not
    the CPU: set on its records here, this machine has no GPU) the trace would not split the step between host and
    device, so the search says why and probes, naming the offloaded module."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from retune.distributed.fsdp2 import _group_params, _param_groups, _states

    model = _shard(_layers(), offload_policy=CPUOffloadPolicy(pin_memory=False))
    assert why_not_traced(model) is None
    records = [p for state in _states(model) for g in _param_groups(state) for p in _group_params(g)]
    assert records and all(p.offload_to_cpu for p in records)
    for record in _group_params(_param_groups(_states(model[2])[0])[0]):  # Linear "2"
        record.device = torch.device("cuda", 0)
    reason = why_not_traced(model)
    assert reason is not None and "CPUOffloadPolicy" in reason and "of 2 in host memory" in reason
    plain = _shard(_layers())
    assert why_not_traced(plain) is None


def test_a_mixed_precision_fsdp2_step_is_traced_as_the_plain_module_in_its_compute_dtype(
    gloo_group: Any, stepping: list[nn.Module]
) -> None:
    """With ``MixedPrecisionPolicy(param_dtype=bfloat16)`` on every group and ``output_dtype=float32`` on the root,
    on one rank, forward and backward are traced as the same model stored in bfloat16, its input cast to bfloat16
    and its output back to float32 (what FSDP2's hooks do, done by the policy's own casts), byte for byte at
    every size; the update is traced apart on the float32 shards (``trace_update``): the state it creates is
    float32 (AdamW: two moments per parameter)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1,))
    sharded = _layers()
    for index in (0, 2, 4):
        fully_shard(sharded[index], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))  # type: ignore[index]
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fully_shard(sharded, mesh=mesh, mp_policy=root)
    plain = _layers().to(torch.bfloat16)
    sharded_opt = torch.optim.AdamW(sharded.parameters())
    plain_opt = torch.optim.AdamW(plain.parameters())
    phase = trace_update(sharded, [sharded_opt])
    assert isinstance(phase, OptimizerPhase)
    assert phase.created_bytes >= 2 * 4 * sum(p.numel() for p in sharded.parameters())  # float32 moments
    dtypes = compute_dtypes(sharded)

    def plain_step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        x, y = batch
        nn.functional.cross_entropy(plain(x.to(torch.bfloat16)).float(), y).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    skipped = OptimizerPhase(0, 0)  # both skip the update: forward and backward are compared
    stepping[:] = [sharded]
    for size in (16, 256):
        ours = trace_step(
            sharded, [sharded_opt], _batch(), size, _step, steps=1, optimizer=skipped, compute_dtypes=dtypes
        )
        theirs = trace_step(plain, [plain_opt], _batch(), size, plain_step, steps=1, optimizer=skipped)
        assert isinstance(ours, StepTrace) and isinstance(theirs, StepTrace), (ours, theirs)
        assert (ours.compute_bytes, ours.resident_bytes) == (theirs.compute_bytes, theirs.resident_bytes)
    assert all(type(p).__name__ == "DTensor" and p.dtype == torch.float32 for p in sharded.parameters())


def test_groups_kept_gathered_after_forward_count_whole_in_the_account(gloo_group: Any) -> None:
    """A group not resharded after forward (``reshard_after_forward=False``) stays gathered into backward: counted
    whole, beside the two largest of the others; a group of several modules (``fully_shard([a, b])``) once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = _layers()
    fully_shard([model[0], model[4]], mesh=mesh)  # type: ignore[list-item]  # one group of two modules
    fully_shard(model[2], mesh=mesh, reshard_after_forward=False)  # type: ignore[index]
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    account = ShardAccount.of(model, [optimizer], resident_bytes(model, [optimizer]))
    kept = sum(p.numel() for p in model[2].parameters()) * 4  # type: ignore[index]
    grouped = sum(p.numel() for i in (0, 4) for p in model[i].parameters()) * 4  # type: ignore[index]
    assert account.gathered == kept + grouped  # the root holds no parameters of its own


@pytest.mark.parametrize(("precision", "world"), [("fp32", 2), ("bf16", 2), ("bf16", 4)])
def test_a_ranks_prediction_from_a_fresh_optimizer_is_within_1_under_and_8_percent_over_its_measured_peak(
    tmp_path: Path, precision: str, world: int
) -> None:
    """2 and 4 gloo ranks (tests/fsdp2/run_rank_peak.py): AdamW without state, each rank traces one step (as a
    search does at fit start: the update creates the state, a share of it on each rank) and predicts its steady
    peak, then measures it, at 2, 64, 256 and 1,024 samples; in float32, and with ``MixedPrecisionPolicy(
    param_dtype=bfloat16, reduce_dtype=float32)`` (forward and backward traced in bfloat16, the update apart).
    Measured here: 2 ranks float32 +4.5%, +2.2%, -0.0002%, +4.7%; bfloat16 +5.2%, +3.8%, +0.0%, +3.1%; 4 ranks
    bfloat16 +4.1%, +2.0%, -0.0%, +5.9% (there a bfloat16 gradient, 2 bytes per element whole, is recounted to
    its float32 quarter, 1 byte per element: on 2 ranks the two are equal). Before the gradients were counted
    as the rank's shards once reduced, float32 was +9.0%, +6.6%, +0.0% (the traced memory per sample half the
    measured one) and bfloat16 was not predicted at all."""
    script = Path(__file__).resolve().parents[1] / "fsdp2" / "run_rank_peak.py"
    code, output, out = run_rank_scripts({"peak": ["{out}", precision, str(world)]}, script, tmp_path, 150)["peak"]
    assert code == 0, output[-4000:]
    for rank in range(world):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["fraction"] == 1 / world
        assert result["cast"] == (10 if precision == "bf16" else 0)  # every parameter computed in bfloat16
        for size, measured in result["measured"].items():
            error = (result["predicted"][size] - measured) / measured
            assert -0.01 <= error <= 0.08, (rank, size, error)
