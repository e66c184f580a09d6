"""Predicting an FSDP2 step on one rank (a one-rank gloo mesh, ``gloo_group``): the unsharded fake trace, the rank's
account of its shards, the tracker's count of the storages FSDP2 resizes in place, and the mixed-precision
fallback. Two ranks through Lightning: tests/distributed/test_fsdp2.py (``predict``).

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

from retune.distributed.fsdp2 import ShardAccount, fsdp_modules, hooks_removed, why_not_traced
from retune.distributed.local_shards import local
from retune.memory import CpuPeakTracker, measure_peak, resident_bytes
from retune.prediction import StepTrace, trace_step
from retune.prediction.sharded import rank_peak
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


def _trace(model: nn.Module, optimizer: torch.optim.Optimizer, size: int, stepping: list[nn.Module]) -> StepTrace:
    stepping[:] = [model]
    result = trace_step(model, [optimizer], _batch(), size, _step, steps=1)
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
    assert account.fixed(created_whole=1000) == account.resident + account.gradients + 1000 + account.gathered


def test_the_prediction_with_the_ranks_account_is_within_10_percent_of_the_measured_fsdp2_peak(
    gloo_group: Any, stepping: list[nn.Module]
) -> None:
    """What a search predicts for a rank (:func:`rank_peak`: the trace with the rank's account of its shards) against
    the CPU tracker's peak of a real FSDP2 step at the same size: at 64 samples the peak is the update's (-0.2%
    here), at 512 the backward's (+8.3%). Tolerance: 2% under, 10% over. The activations are traced exactly (the
    first test); what FSDP2 has gathered at the compute peak is estimated from above (the two largest groups,
    96% of this model's parameters in one group; the real peak holds only the last group). Over is safe (a
    smaller first probe); the verifying probes and the calibration correct the constant in a search."""
    model = _shard(_layers())
    optimizer = torch.optim.AdamW(model.parameters())
    _real_step(model, optimizer, 4)
    account = ShardAccount.of(model, [optimizer], resident_bytes(model, [optimizer]))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    for size in (64, 512):
        predicted = rank_peak(_trace(model, optimizer, size, stepping), account, grads)
        measured = _real_step(model, optimizer, size)
        assert -0.02 <= (predicted - measured) / measured <= 0.10, (size, predicted, measured)


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


def test_mixed_precision_fsdp2_is_not_traced_and_says_why(gloo_group: Any) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert why_not_traced(_shard(_layers())) is None
    model = _shard(_layers(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    reason = why_not_traced(model)
    assert reason is not None and "MixedPrecisionPolicy" in reason and "param_dtype=torch.bfloat16" in reason
    outputs = _shard(_layers(), mp_policy=MixedPrecisionPolicy(output_dtype=torch.bfloat16))
    assert "output_dtype=torch.bfloat16" in (why_not_traced(outputs) or "")
    mixed = _layers()
    mixed[4].to(torch.bfloat16)  # type: ignore[index]  # one group already bf16: only the others are cast
    assert "param_dtype" in (
        why_not_traced(_shard(mixed, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))) or ""
    )
    stored = _layers().to(torch.bfloat16)  # every parameter stored in the policy's dtype: nothing is cast
    assert why_not_traced(_shard(stored, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))) is None


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


def test_a_ranks_prediction_from_a_fresh_optimizer_is_within_10_percent_over_its_measured_peak(
    tmp_path: Path,
) -> None:
    """2 gloo ranks (tests/fsdp2/run_rank_peak.py): AdamW without state, each rank traces one step (as a search
    does at fit start: the update creates the state, half of it on each rank) and predicts its steady peak, then
    measures it. The state is counted once, as the rank's half (before, it was counted whole and again as the
    rank's half: +81% on the reviewer's model), and every prediction is over by 0-10% (measured here: +9.0% at 2
    samples, +6.6% at 64, +0.0% at 256: the gradients counted whole stand in for FSDP2's reduce buffers)."""
    script = Path(__file__).resolve().parents[1] / "fsdp2" / "run_rank_peak.py"
    code, output, out = run_rank_scripts({"peak": ["{out}"]}, script, tmp_path, 120)["peak"]
    assert code == 0, output[-4000:]
    for rank in (0, 1):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["fraction"] == 0.5
        for size, measured in result["measured"].items():
            error = (result["predicted"][size] - measured) / measured
            assert 0 <= error <= 0.10, (rank, size, error)
