"""FSDP2 in one process: which strategies retune serves or refuses, and the snapshot of DTensor shards.

The snapshot tests shard a model with ``fully_shard`` on a one-rank mesh (the gloo_group fixture):
its parameters, gradients and Adam's moments are DTensors, as on every rank of a real run. The
2-rank runs live in tests/distributed/test_fsdp2.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from retune import RetuneError, ScheduledBatchSizeFinder
from retune.compat import strategies as sharded
from retune.distributed import fsdp2
from retune.distributed.local_shards import is_sharded, local
from retune.probing.snapshot import TrainingSnapshot
from tests.helpers.lightning_ns import LEGACY, pl
from tests.helpers.oracle import FineTuneModel

needs_model_parallel = pytest.mark.skipif(
    LEGACY or not hasattr(pl.strategies, "ModelParallelStrategy"), reason="ModelParallelStrategy needs Lightning 2.4+"
)


def _trainer(strategy: Any, world_size: int = 2) -> Any:
    return SimpleNamespace(strategy=strategy, world_size=world_size)


def _bare(cls: type) -> Any:
    """An instance without running ``__init__`` (DeepSpeed's needs the deepspeed package installed)."""
    return object.__new__(cls)


@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp1_is_refused_pointing_to_model_parallel(world_size: int) -> None:
    if not hasattr(pl.strategies, "FSDPStrategy"):
        pytest.skip("no FSDPStrategy in this Lightning")
    with pytest.raises(RetuneError, match=r"does not support FSDPStrategy.*ModelParallelStrategy"):
        sharded.check_strategy(_trainer(_bare(pl.strategies.FSDPStrategy), world_size))


@pytest.mark.parametrize("world_size", [1, 2])
def test_deepspeed_is_refused_not_mistaken_for_ddp(world_size: int) -> None:
    # DeepSpeedStrategy subclasses DDPStrategy: matched first, or its engine's state would be probed as DDP's
    trainer = _trainer(_bare(pl.strategies.DeepSpeedStrategy), world_size)
    assert sharded.strategy_kind(trainer) == "DeepSpeedStrategy"
    with pytest.raises(RetuneError, match=r"does not support DeepSpeedStrategy.*ModelParallelStrategy"):
        sharded.check_strategy(trainer)


def test_ddp_and_a_single_device_are_served() -> None:
    sharded.check_strategy(_trainer(_bare(pl.strategies.DDPStrategy), 2))
    sharded.check_strategy(_trainer(_bare(pl.strategies.SingleDeviceStrategy), 1))
    assert sharded.strategy_kind(_trainer(_bare(pl.strategies.DDPStrategy), 2)) == "ddp"


@needs_model_parallel
@pytest.mark.parametrize(("dp", "tp", "refused"), [(2, 1, False), (1, 2, True), ("auto", "auto", True)])
def test_tensor_parallelism_is_refused_at_setup(dp: Any, tp: Any, refused: bool) -> None:
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)  # not launched
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "fit_start"}]}, verbose=False)
    if not refused:
        sharded.check_strategy(trainer)
        return
    with pytest.raises(RetuneError, match=r"tensor_parallel_size=2.*tensor_parallel_size=1") as info:
        finder.setup(trainer, FineTuneModel(), "fit")
    if tp == "auto":
        assert "'auto'" in str(info.value)  # Lightning's default is tensor parallelism over every device


@needs_model_parallel
def test_the_oom_trigger_is_refused_at_setup_under_fsdp2_with_what_works_instead() -> None:
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)  # not launched
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "fit_start"}, {"kind": "oom"}]}, verbose=False)
    with pytest.raises(RetuneError, match="`oom` trigger is not supported under ModelParallelStrategy") as info:
        finder.setup(trainer, FineTuneModel(), "fit")
    assert "search.probe_samples: largest" in str(info.value) and "DDP" in str(info.value)
    with pytest.raises(RetuneError, match="`oom` trigger is not supported"):  # validate/test/predict too
        finder.setup(trainer, FineTuneModel(), "validate")


# -- DTensor shards in a snapshot (one rank) ---------------------------------------------------------


def _sharded_model(gloo_group: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[3], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int, batch: int = 16) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [local(p).clone() for p in model.parameters()]
    tensors += [local(p.grad).clone() for p in model.parameters() if p.grad is not None]
    tensors += [b.clone() for b in model.buffers()]
    tensors += [local(v).clone() for s in optimizer.state.values() for v in s.values()]
    return tensors


def test_a_snapshot_restores_sharded_parameters_gradients_and_optimizer_state_exactly(gloo_group: Any) -> None:
    model, optimizer = _sharded_model(gloo_group)
    _step(model, optimizer, seed=1)
    assert all(is_sharded(p) and is_sharded(p.grad) for p in model.parameters())
    assert all(is_sharded(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")
    before = _state(model, optimizer)
    params, grads = list(model.parameters()), [p.grad for p in model.parameters()]
    shards = [local(p) for p in params]

    snap = TrainingSnapshot.capture(model, optimizers=[optimizer])
    for trial in range(3):
        if trial:
            snap.reset()
        _step(model, optimizer, seed=10 + trial, batch=32)  # a probe: changes every sharded tensor
    snap.restore()

    after = _state(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "bit for bit"
    assert list(model.parameters()) == params and all(local(p) is s for p, s in zip(params, shards, strict=True))
    assert all(p.grad is g for p, g in zip(params, grads, strict=True)), "host gradients set aside, not copied"
    # and training goes on exactly as a model that never snapshotted
    twin, twin_opt = _sharded_model(gloo_group)
    _step(twin, twin_opt, seed=1)
    _step(model, optimizer, seed=2)
    _step(twin, twin_opt, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), _state(twin, twin_opt), strict=True))


def test_a_snapshot_counts_local_shard_bytes(gloo_group: Any) -> None:
    model, optimizer = _sharded_model(gloo_group)
    _step(model, optimizer, seed=1)
    snap = TrainingSnapshot.capture(model, optimizers=[optimizer])
    snap.restore()
    params = sum(local(p).numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    state = sum(
        local(v).numel() * local(v).element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    assert snap.nbytes == params + buffers + state  # the gradients were set aside without a copy


def test_after_an_out_of_memory_mid_forward_the_sharded_model_trains_as_if_it_never_happened(
    gloo_group: Any,
) -> None:
    model, optimizer = _sharded_model(gloo_group)
    twin, twin_opt = _sharded_model(gloo_group)
    _step(model, optimizer, seed=1)
    _step(twin, twin_opt, seed=1)
    snap = TrainingSnapshot.capture(model, optimizers=[optimizer])

    def fail(*_: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (oracle, mid-forward)")

    hook = model[3].register_forward_pre_hook(fail)  # after the first sharded layer was all-gathered
    with pytest.raises(torch.OutOfMemoryError):
        _step(model, optimizer, seed=5, batch=64)
    hook.remove()
    fsdp2.reset_after_failure(model)
    snap.restore()
    for seed in (2, 3):
        _step(model, optimizer, seed=seed)
        _step(twin, twin_opt, seed=seed)
    assert all(is_sharded(p) for p in model.parameters()), "every group resharded"
    assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), _state(twin, twin_opt), strict=True))


def test_sharded_gradients_kept_as_host_copies_come_back_as_the_same_dtensor_layout(
    gloo_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on a GPU a sharded gradient is copied to host memory (not held on the device during probes) and
    # handed back as a DTensor laid out like its parameter; forced here on CPU, where it would be held
    from retune.probing import snapshot

    monkeypatch.setattr(snapshot, "_grad_holdable", lambda grad: False)
    model, optimizer = _sharded_model(gloo_group)
    _step(model, optimizer, seed=1)
    before = _state(model, optimizer)
    grads = [p.grad for p in model.parameters()]
    snap = TrainingSnapshot.capture(model, optimizers=[optimizer])
    optimizer.zero_grad(set_to_none=True)  # the probe drops the gradients, then trains
    _step(model, optimizer, seed=7, batch=8)
    optimizer.zero_grad(set_to_none=True)  # and ends without any: restore makes new DTensor gradients
    snap.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, optimizer), strict=True))
    for p, old in zip(model.parameters(), grads, strict=True):
        assert is_sharded(p.grad) and p.grad.placements == old.placements and p.grad.shape == old.shape


@pytest.mark.parametrize(
    "name", ["DDPFullyShardedNativeStrategy", "DDPFullyShardedStrategy", "DDPShardedStrategy", "ColossalAIStrategy"]
)
def test_lightning_1_9_sharding_strategies_are_refused_not_mistaken_for_ddp(name: str) -> None:
    # several of them subclass DDPStrategy; matched as DDP, their sharded state would be probed as whole
    cls = getattr(pl.strategies, name, None)
    if cls is None:
        pytest.skip(f"no {name} in Lightning {pl.__version__}")
    trainer = _trainer(_bare(cls), 2)
    assert sharded.strategy_kind(trainer) not in ("ddp", "single")
    with pytest.raises(RetuneError, match=name):
        sharded.check_strategy(trainer)
