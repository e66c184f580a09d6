"""The snapshot a search takes before its probes, and the host copies it is made of.

The end-to-end guarantee (a run with retune trains bit for bit like a run without it) lives in
tests/callbacks/test_no_trace.py; these tests pin the pieces: one host block for all copies, gradients held by
reference instead of copied, host parameters and optimizer state held (the run continues on copies
and gets its own tensors back), what stays on the copy-back path (shared storage, views, layouts
a contiguous copy would change, parameters kept in optimizer state), and what ``reset()`` leaves
between two probes. tests/probing/test_prober.py checks that every trial starts from the captured state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from retune.probing.host_copy import host_copies
from retune.probing.snapshot import TrainingSnapshot
from tests.helpers.dist_utils import GlooGroup

MiB = 2**20


def _storage_ptrs(tensors: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_host_copies_are_equal_independent_and_laid_out_in_one_block() -> None:
    sources = [
        torch.randn(512, 512),  # 1 MiB: the set is large enough for one block
        torch.randn(64, 32).t(),  # not contiguous
        torch.tensor(3.5, dtype=torch.float64),  # zero-dimensional
        torch.zeros(0, 7),  # empty
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int16),
        torch.randn(3, dtype=torch.bfloat16),
    ]
    copies = host_copies(sources)
    filled = [c for c in copies if c.numel()]
    starts = [c.untyped_storage().data_ptr() for c in filled]
    span = max(p + c.untyped_storage().nbytes() for p, c in zip(starts, filled, strict=True)) - min(starts)
    assert span <= sum(-(-c.numel() * c.element_size() // 64) * 64 for c in filled), "one host allocation"
    # ... yet each copy is a tensor of its own, exactly its size, to anything that inspects storages
    assert len(_storage_ptrs(filled)) == len(filled)
    assert all(c.untyped_storage().nbytes() == c.numel() * c.element_size() for c in copies)
    assert not any(c._is_view() for c in copies)
    for source, copy in zip(sources, copies, strict=True):
        assert copy.dtype == source.dtype and copy.shape == source.shape
        assert torch.equal(copy, source)
        assert copy.is_contiguous()
    before = [c.clone() for c in copies]
    for source in sources:
        if source.numel():
            source.fill_(1) if source.dtype != torch.bool else source.fill_(False)
    for copy, kept in zip(copies, before, strict=True):
        assert torch.equal(copy, kept), "a copy must not change with its source"


def test_host_copies_outlive_their_siblings() -> None:
    # each copy keeps the block alive on its own: dropping the others must not free its memory
    sources = [torch.randn(256, 1024), torch.randn(256, 1024)]
    copies = host_copies(sources)
    second = copies[1]
    del copies
    torch.randn(4096, 1024)  # allocate over whatever could have been freed
    assert torch.equal(second, sources[1])


def test_small_sets_and_sparse_tensors_are_cloned_one_by_one() -> None:
    small = host_copies([torch.ones(3), torch.ones(4)])
    assert len(_storage_ptrs(small)) == 2
    sparse = torch.randn(600, 600).relu().to_sparse()
    dense = torch.randn(512, 512)
    copies = host_copies([sparse, dense])
    assert copies[0].is_sparse and torch.equal(copies[0].to_dense(), sparse.to_dense())
    assert torch.equal(copies[1], dense)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.ReLU())
        self.head = nn.Linear(512, 10)
        self.frozen = nn.Linear(512, 512).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.backbone(x)))


def _trained() -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = _Net()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        net(torch.randn(32, 256)).pow(2).mean().backward()
        optimizer.step()
    return net, optimizer


def _probe_step(net: _Net, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
    optimizer.zero_grad(set_to_none=set_to_none)
    net(torch.randn(64, 256)).pow(2).mean().backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 123.0


def _state(net: _Net, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in net.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()},
        "buffers": {n: b.clone() for n, b in net.named_buffers()},
        "optimizer": {
            id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in optimizer.state.items()
        },
        "lr": optimizer.param_groups[0]["lr"],
        "rng": torch.get_rng_state(),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in ("params", "buffers"):
        assert a[name].keys() == b[name].keys()
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), f"{name} {key}"
    for key in a["grads"]:
        left, right = a["grads"][key], b["grads"][key]
        assert (left is None) == (right is None), f"grad {key}"
        assert left is None or torch.equal(left, right), f"grad {key}"
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for pid in a["optimizer"]:
        for key, value in a["optimizer"][pid].items():
            other = b["optimizer"][pid][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert a["lr"] == b["lr"]
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.parametrize("set_to_none", [True, False], ids=["zero_grad_to_none", "zero_grad_in_place"])
def test_probes_between_capture_and_restore_leave_no_trace(set_to_none: bool) -> None:
    net, optimizer = _trained()
    before = _state(net, optimizer)
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    state_tensors = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    for _ in range(2):  # two probes, each followed by the between-probes restore
        net.train()
        _probe_step(net, optimizer, set_to_none)
        snap.reset()
        assert all(p.grad is None for p in net.parameters()), "between probes the gradients are empty"
    snap.restore()
    _assert_same(before, _state(net, optimizer))
    # host gradients come back as the very tensors the parameters held, never copied
    for name, param in net.named_parameters():
        if name in grads:
            assert param.grad is grads[name]
    # optimizer-state tensors were written back in place
    now = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert all(a is b for a, b in zip(state_tensors, now, strict=True))


def test_host_gradients_are_held_not_copied() -> None:
    net, optimizer = _trained()
    trainable = [p for p in net.parameters() if p.requires_grad]
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    assert all(p.grad is None for p in trainable), "capture takes host gradients off their parameters"
    param_bytes = sum(p.numel() * p.element_size() for p in trainable)
    buffer_bytes = sum(b.numel() * b.element_size() for b in net.buffers())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    state_bytes = sum(v.numel() * v.element_size() for v in state)
    assert snap.nbytes == param_bytes + buffer_bytes + state_bytes  # no gradient bytes copied
    snap.restore()
    assert all(p.grad is not None for p in trainable)


def test_a_capture_that_fails_leaves_the_gradients_on_their_parameters() -> None:
    net, optimizer = _trained()
    grads = [p.grad for p in net.parameters()]

    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("cannot save this")

        def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover - never reached
            pass

    ptrs = [p.data_ptr() for p in net.parameters()]
    state = [v for s in optimizer.state.values() for v in s.values()]
    with pytest.raises(RuntimeError, match="cannot save this"):
        TrainingSnapshot.capture(net, optimizers=[optimizer], stateful=[Broken()])
    assert all(p.grad is g for p, g in zip(net.parameters(), grads, strict=True))
    assert [p.data_ptr() for p in net.parameters()] == ptrs, "the run was not moved onto copies"
    assert all(a is b for a, b in zip(state, [v for s in optimizer.state.values() for v in s.values()], strict=True))


def test_frozen_parameters_are_not_copied() -> None:
    net, optimizer = _trained()
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    captured = {id(entry.param) for entry in snap.params}
    assert id(net.frozen.weight) not in captured and id(net.frozen.bias) not in captured
    assert id(net.head.weight) in captured


def test_gradient_views_are_copied_not_held(gloo_group: GlooGroup) -> None:
    # DDP's gradient_as_bucket_view makes every .grad a view into the reducer's flat bucket, which the
    # next synchronised backward writes into: such a gradient must be copied, not set aside.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = gloo_group.ddp(net, gradient_as_bucket_view=True)  # the fixture frees it before the group
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):  # DDP rebuilds its buckets after the first step
        optimizer.zero_grad(set_to_none=True)
        ddp(torch.randn(8, 64)).sum().backward()
        optimizer.step()
    ddp(torch.randn(8, 64)).sum().backward()  # gradients of a step not yet taken
    assert all(p.grad is not None and p.grad._is_view() for p in net.parameters())
    before = [p.grad.clone() for p in net.parameters()]
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    optimizer.zero_grad(set_to_none=True)
    ddp(torch.randn(32, 64) * 10).pow(2).sum().backward()  # writes the bucket
    optimizer.step()
    snap.reset()
    snap.restore()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, net.parameters(), strict=True))


def test_copied_gradients_come_back_in_the_parameter_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # device gradients are copied to a contiguous host block; the restored one must be channels_last
    # again where the parameter is (as on a GPU, simulated by not holding host gradients)
    import retune.probing.snapshot as snapshot

    monkeypatch.setattr(snapshot, "_host_resident", lambda tensor: False)
    conv = nn.Conv2d(256, 256, 3).to(memory_format=torch.channels_last)
    conv(torch.randn(2, 256, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    assert conv.weight.grad is not None
    expected = conv.weight.grad.clone()
    snap = TrainingSnapshot.capture(conv)
    conv.weight.grad = None
    snap.restore()
    assert torch.equal(conv.weight.grad, expected)
    assert conv.weight.grad.stride() == conv.weight.stride()


def test_host_parameters_and_optimizer_state_are_held_and_handed_back() -> None:
    # On the CPU the probes run on copies and the run's own tensors are set aside untouched, so the
    # final restore copies nothing: it hands back the very storage each parameter started with.
    net, optimizer = _trained()
    trainable = [p for p in net.parameters() if p.requires_grad]
    ptrs = {id(p): p.data_ptr() for p in net.parameters()}
    values = {id(p): p.detach().clone() for p in trainable}
    state = {id(p): dict(s) for p, s in optimizer.state.items()}
    state_values = {(id(p), k): v.clone() for p, s in optimizer.state.items() for k, v in s.items()}
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    assert snap.held_bytes > 0
    assert all(p.data_ptr() != ptrs[id(p)] for p in trainable), "trainable parameters run on copies"
    assert all(p.data_ptr() == ptrs[id(p)] for p in net.frozen.parameters()), "frozen ones are not touched"
    originals = {(pid, k): v for pid, s in state.items() for k, v in s.items()}
    for p, entries in optimizer.state.items():
        assert all(v is not originals[(id(p), k)] for k, v in entries.items()), "optimizer state runs on copies"
    for _ in range(3):
        _probe_step(net, optimizer, set_to_none=True)
        snap.reset()
        for p in trainable:
            assert torch.equal(p, values[id(p)]), "a reset starts the next probe from the captured values"
    _probe_step(net, optimizer, set_to_none=True)
    for key, value in originals.items():
        assert torch.equal(value, state_values[key]), "no probe wrote into a set-aside original"
    snap.restore()
    assert {id(p): p.data_ptr() for p in net.parameters()} == ptrs
    assert all(torch.equal(p, values[id(p)]) for p in trainable)
    for p, entries in optimizer.state.items():
        assert all(v is state[id(p)][k] for k, v in entries.items())
    snap.restore()  # a second restore changes nothing
    assert {id(p): p.data_ptr() for p in net.parameters()} == ptrs


class _Shared(nn.Module):
    """Parameters whose memory is shared or laid out in a way a contiguous copy would not keep."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.b.weight = nn.Parameter(self.a.weight.data)  # tied through the storage, not the object
        flat = torch.zeros(2 * 64)
        self.c = nn.Parameter(flat[:64])  # a view into a larger buffer
        self.d = nn.Parameter(flat[64:])
        self.conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(self.a(x)) + self.c + self.d
        image = x.view(-1, 8, 4, 2).repeat(1, 1, 2, 2).contiguous(memory_format=torch.channels_last)
        return y.sum() + self.conv(image).sum()


def test_shared_or_strided_parameters_stay_in_place() -> None:
    torch.manual_seed(0)
    net = _Shared()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        net(torch.randn(4, 64)).backward()
        optimizer.step()
    in_place = [net.a.weight, net.b.weight, net.c, net.d, net.conv.weight]
    ptrs = [p.data_ptr() for p in in_place]
    before = _state_of(net)
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    assert [p.data_ptr() for p in in_place] == ptrs, "these parameters are copied and written back in place"
    assert net.a.bias.data_ptr() != before["ptr a.bias"], "a parameter with memory of its own is held"
    assert net.conv.weight.is_contiguous(memory_format=torch.channels_last)
    _ = net(torch.randn(4, 64)).backward()
    optimizer.step()
    assert net.a.weight.data_ptr() == net.b.weight.data_ptr(), "the tie holds during probes"
    snap.reset()
    snap.restore()
    assert [p.data_ptr() for p in in_place] == ptrs
    after = _state_of(net)
    for name, value in before.items():
        if not name.startswith("ptr"):
            assert torch.equal(value, after[name]), name


def _state_of(net: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {name: p.detach().clone() for name, p in net.named_parameters(remove_duplicate=False)}
    out.update({f"ptr {name}": p.data_ptr() for name, p in net.named_parameters(remove_duplicate=False)})
    return out


def test_the_cpu_tracker_sees_the_same_resident_state_during_probes() -> None:
    # the held copies share one allocation with the snapshot's backups, but each has a storage of its
    # own, and the CPU peak tracker counts storages: it must see the run's state, not the whole block
    from retune.memory import resident_bytes

    net, optimizer = _trained()
    before = resident_bytes(net, [optimizer])
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    assert snap.held_bytes > 0
    assert resident_bytes(net, [optimizer]) == before
    snap.restore()
    assert resident_bytes(net, [optimizer]) == before


@pytest.mark.parametrize("held", [True, False], ids=["held", "copied"])
def test_a_probe_that_repoints_parameter_data_is_undone(held: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # max-norm constraints and clamps often write ``p.data = p.data.clamp(...)``: a new storage, which
    # the put-back must replace with the captured one, whether the parameter is held or copied
    import retune.probing.snapshot as snapshot

    if not held:  # as on a GPU, where every parameter is copied and written back in place
        monkeypatch.setattr(snapshot, "_host_resident", lambda tensor: False)
    net, optimizer = _trained()
    trainable = [p for p in net.parameters() if p.requires_grad]
    values = [p.detach().clone() for p in trainable]
    ptrs = [p.data_ptr() for p in trainable]
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    for _ in range(2):
        _probe_step(net, optimizer, set_to_none=True)
        for p in trainable:
            p.data = p.data.clamp(-0.01, 0.01)
        snap.reset()
        assert all(torch.equal(p, v) for p, v in zip(trainable, values, strict=True))
    for p in trainable:
        p.data = p.data.clamp(-0.01, 0.01)
    snap.restore()
    assert all(torch.equal(p, v) for p, v in zip(trainable, values, strict=True))
    assert [p.data_ptr() for p in trainable] == ptrs


class _KeepsParameters(torch.optim.SGD):
    """An optimizer whose state refers to parameters: its own, and one outside the module."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.outside = nn.Parameter(torch.randn(4, 4))

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["ref"] = p
                self.state[p]["outside"] = self.outside
        with torch.no_grad():
            self.outside.add_(1.0)
        return loss


def test_optimizer_state_that_refers_to_parameters_gets_the_parameters_back() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = _KeepsParameters(net.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        net(torch.randn(8, 256)).sum().backward()
        optimizer.step()
    outside = optimizer.outside.detach().clone()
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    for p, entries in optimizer.state.items():
        assert entries["ref"] is p and entries["outside"] is optimizer.outside, "parameters are never swapped out"
    optimizer.zero_grad()
    net(torch.randn(8, 256)).sum().backward()
    optimizer.step()
    snap.reset()
    snap.restore()
    for p, entries in optimizer.state.items():
        assert entries["ref"] is p and isinstance(entries["ref"], nn.Parameter) and p.requires_grad
        assert entries["outside"] is optimizer.outside
    assert torch.equal(optimizer.outside, outside), "a parameter kept only in the state is restored in place"


def test_a_depthwise_channels_last_weight_is_copied_not_held() -> None:
    # (C, 1, k, k) in channels_last has strides (9, 1, 3, 1), which is_contiguous() accepts; a contiguous
    # copy has (9, 9, 3, 1), so holding it would make the probes run on another layout
    conv = nn.Conv2d(8, 8, 3, groups=8).to(memory_format=torch.channels_last)
    assert conv.weight.is_contiguous() and conv.weight.stride() == (9, 1, 3, 1)
    ptr, stride = conv.weight.data_ptr(), conv.weight.stride()
    snap = TrainingSnapshot.capture(conv)
    assert conv.weight.data_ptr() == ptr and conv.weight.stride() == stride
    snap.restore()
    assert conv.weight.data_ptr() == ptr and conv.weight.stride() == stride


def test_the_state_of_an_optimizer_wrapped_by_zero_is_kept(gloo_group: GlooGroup) -> None:
    # ZeroRedundancyOptimizer keeps the real state in its inner ``optim``; its own ``state`` is empty
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    zero = gloo_group.own(ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1))
    for _ in range(2):
        zero.zero_grad()
        net(torch.randn(8, 64)).sum().backward()
        zero.step()
    inner = zero.optim
    before = {(id(p), k): v.clone() for p, s in inner.state.items() for k, v in s.items()}
    assert before and not zero.state
    snap = TrainingSnapshot.capture(net, optimizers=[zero])
    zero.zero_grad()
    net(torch.randn(8, 64)).sum().backward()
    zero.step()
    snap.restore()
    after = {(id(p), k): v for p, s in inner.state.items() for k, v in s.items()}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_a_compiled_module_runs_on_held_copies_without_recompiling() -> None:
    # torch.compile guards on its inputs' metadata: the held copies must look like the originals (shape,
    # strides, dtype, a storage of their own), or every search would cost a recompile (aot_eager: the
    # guards and the traced graph are the real ones, without compiling kernels)
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    compiled = torch.compile(net, backend="aot_eager")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        compiled(torch.randn(8, 512)).sum().backward()
        optimizer.step()

    for _ in range(2):
        step()
    graphs = counters["stats"]["unique_graphs"]
    values = [p.detach().clone() for p in net.parameters()]
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    assert snap.held_bytes > 0
    for _ in range(2):
        step()
        snap.reset()
    step()
    snap.restore()
    assert all(torch.equal(v, p) for v, p in zip(values, net.parameters(), strict=True))
    step()  # the run goes on, compiled, on its own tensors
    assert counters["stats"]["unique_graphs"] == graphs, "no recompilation on the copies or after"
    torch._dynamo.reset()


class _Wrapper(torch.optim.Optimizer):
    """A SAM-style wrapper: its update is an inner optimizer's (``base_optimizer``), whose momentum is the state."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        self.base_optimizer = torch.optim.SGD(self.param_groups, lr=0.1, momentum=0.9)
        self.param_groups = self.base_optimizer.param_groups

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.base_optimizer.step()


def test_an_optimizer_a_wrapper_holds_and_a_modules_own_generator_are_put_back() -> None:
    """Found by review: the probes' steps moved a SAM-style wrapper's inner momentum and a generator the module
    keeps for its noise, and both stayed moved: the run trained other weights than one that never searched."""
    net = _Net()
    net.noise = torch.Generator().manual_seed(3)  # type: ignore[assignment]
    optimizer = _Wrapper(net.parameters())
    net(torch.randn(8, 256)).pow(2).mean().backward()
    optimizer.step()
    inner = optimizer.base_optimizer
    momentum = {id(p): s["momentum_buffer"].clone() for p, s in inner.state.items()}
    generator_state = net.noise.get_state()  # type: ignore[attr-defined]
    snap = TrainingSnapshot.capture(net, optimizers=[optimizer])
    optimizer.zero_grad()
    net(torch.randn(8, 256, generator=net.noise)).pow(2).mean().backward()  # type: ignore[attr-defined]
    optimizer.step()
    snap.restore()
    assert all(torch.equal(s["momentum_buffer"], momentum[id(p)]) for p, s in inner.state.items())
    assert torch.equal(net.noise.get_state(), generator_state)  # type: ignore[attr-defined]
