"""Training-state snapshots (autoaccum.state): what capture copies comes back bit for bit; on CUDA the
copies are page-locked (queued, one wait), pageable where pinning fails, and their memory goes back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autoaccum
from autoaccum import state


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4)).to(device)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, device: str, steps: int = 2) -> None:
    for _ in range(steps):
        loss = model(torch.randn(16, 32, device=device)).square().mean()
        loss.backward()
        optimizer.step()
    loss = model(torch.randn(16, 32, device=device)).square().mean()
    loss.backward()  # gradients held, as in the middle of an accumulation


def _everything(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"t/{n}": t.detach().cpu().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    out.update({f"g/{n}": p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None})
    for i, s in enumerate(optimizer.state.values()):
        out.update({f"o/{i}/{k}": v.detach().cpu().clone() for k, v in s.items() if torch.is_tensor(v)})
    return out


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _roundtrip(device: str) -> tuple[list[str], list[str], state.TrainingSnapshot]:
    """Train, snapshot, train on (everything changes), restore: (what changed before the restore, what
    differs after it, the snapshot)."""
    model = _model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, device)
    before = _everything(model, optimizer)
    snapshot = state.capture(model, optimizer)
    _train(model, optimizer, device)
    changed = _differences(before, _everything(model, optimizer))
    state.restore(snapshot, model, optimizer)
    return changed, _differences(before, _everything(model, optimizer)), snapshot


def test_restore_brings_back_params_buffers_grads_and_optimizer_state_bit_for_bit():
    changed, after, snapshot = _roundtrip("cpu")
    kinds = {k.split("/")[0] for k in changed}
    assert kinds == {"t", "g", "o"}, changed  # negative control: training on changed all of them
    assert after == []
    assert not any(t.is_pinned() for t in snapshot.tensors.values())  # host tensors: plain copies


def test_release_pinned_memory_without_cuda_is_a_no_op():
    state.release_pinned_memory()


def test_room_to_pin_counts_blocks_rounded_up_to_powers_of_two(monkeypatch):
    available = SimpleNamespace(available=400 * 2**20)
    monkeypatch.setattr(state.psutil, "virtual_memory", lambda: available)
    exact = [torch.empty(2**24, dtype=torch.float32)]  # 64 MiB: a block of 64 MiB
    over = [torch.empty(2**24 + 1, dtype=torch.float32)]  # 4 bytes more: a block of 128 MiB
    assert state._room_to_pin(exact * 1) and not state._room_to_pin(over)  # 100 MiB of room (a quarter)
    available.available = 512 * 2**20
    assert state._room_to_pin(over) and not state._room_to_pin(over * 2)


def test_an_estimate_copies_nothing_but_the_generators(monkeypatch):
    """probe(estimate=True) runs on fake copies: the real model is not snapshot (no host copy of its weights)."""
    from tests._probe_models import mlp, mlp_batch, mlp_loss

    def refuse(*args, **kwargs):
        raise AssertionError("an estimate captured the model")

    monkeypatch.setattr(state, "capture", refuse)
    report = autoaccum.probe(model=mlp(), loss_fn=mlp_loss, make_batch=mlp_batch(), target_batch=64, estimate=True)
    assert report.is_estimate
    with pytest.raises(AssertionError, match="captured"):  # the control: a measured probe snapshots the model
        autoaccum.probe(model=mlp(), loss_fn=mlp_loss, make_batch=mlp_batch(), target_batch=64, budget="64MiB")


@pytest.mark.gpu
def test_cuda_snapshot_is_page_locked_and_exact():
    changed, after, snapshot = _roundtrip("cuda")
    assert {k.split("/")[0] for k in changed} == {"t", "g", "o"}, changed
    assert after == []
    assert all(t.is_pinned() for t in snapshot.tensors.values())
    assert all(g is None or g.is_pinned() for g in snapshot.grads.values())


@pytest.mark.gpu
def test_cuda_snapshot_is_whole_when_capture_returns():
    """The copies are queued behind the stream's work: capture waits for them (without the wait the host would
    read the page-locked blocks before the copy behind a 0.5 s kernel has landed)."""
    model = nn.Linear(256, 256).cuda()
    with torch.no_grad():
        model.weight.fill_(1.0)
        torch.cuda.synchronize()
        torch.cuda._sleep(10**9)  # about half a second of one kernel
        model.weight.fill_(2.0)  # queued behind it, as the snapshot's copy is
    snapshot = state.capture(model)
    assert snapshot.tensors["param:weight"].is_pinned()
    assert torch.equal(snapshot.tensors["param:weight"], torch.full((256, 256), 2.0))


@pytest.mark.gpu
def test_cuda_snapshot_is_pageable_when_asked_or_without_room(monkeypatch):
    model = nn.Linear(64, 64).cuda()
    assert not any(t.is_pinned() for t in state.capture(model, pinned=False).tensors.values())
    monkeypatch.setattr(state, "PINNED_SHARE", 0.0)
    saved = state.capture(model)
    assert not any(t.is_pinned() for t in saved.tensors.values())
    with torch.no_grad():
        model.weight.add_(1.0)
    state.restore(saved, model)
    assert torch.equal(model.weight.cpu(), saved.tensors["param:weight"])


@pytest.mark.gpu
def test_cuda_snapshot_falls_back_to_pageable_copies_when_pinning_fails(monkeypatch):
    real = torch.empty_like

    def no_pinning(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (pinned host memory, simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", no_pinning)
    changed, after, snapshot = _roundtrip("cuda")
    assert changed and after == []
    assert not any(t.is_pinned() for t in snapshot.tensors.values())


@pytest.mark.gpu
def test_released_snapshot_gives_its_page_locked_memory_back():
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        pytest.skip("torch.cuda.host_memory_stats is missing in this torch")
    def held() -> int:  # page-locked bytes the allocator owns, in use or cached
        found = [v for k, v in stats().items() if k in ("allocated_bytes.current", "reserved_bytes.current")]
        assert found, sorted(stats())
        return max(found)

    model = nn.Linear(1024, 1024).cuda()  # 4 MiB of weights
    state.release_pinned_memory()
    start = held()
    snapshot = state.capture(model)
    assert held() - start >= 4 * 2**20
    del snapshot
    assert held() - start >= 4 * 2**20  # freed blocks stay cached: the negative control
    state.release_pinned_memory()
    assert held() - start < 4 * 2**20


# -- the weights' copy on their device (the probe's warm-up) ------------------------------------------

def _tied(device: str) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)).to(device)
    net[1].weight = net[0].weight  # tied: one parameter, two names
    return net


def _weights_copy_roundtrip(device: str) -> None:
    model = _tied(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = {n: p.detach().cpu().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    copy = state.WeightsCopy(model)
    assert copy.held and len(copy.copies) == 1 and all(c.device == p.device
                                                       for c, p in zip(copy.copies, copy.parameters))
    assert state.WeightsCopy.nbytes(model) == 16 * 8 * 4  # the tied weight once
    assert not copy.written()
    model(torch.arange(4, device=device)).square().mean().backward()
    assert not copy.written()  # a forward and backward leave the weights alone
    optimizer.step()
    assert copy.written()
    assert any(not torch.equal(p.detach().cpu(), before[n]) for n, p in model.named_parameters())  # it changed them
    copy.put_back()
    assert not copy.held
    assert all(torch.equal(p.detach().cpu(), before[n]) for n, p in model.named_parameters(remove_duplicate=False))
    assert model[1].weight is model[0].weight  # put back in place: still tied
    copy.put_back()  # again: nothing


def test_weights_copy_puts_the_parameters_back_bit_for_bit_and_sees_in_place_writes():
    _weights_copy_roundtrip("cpu")


def test_snapshot_without_parameters_leaves_them_as_they_are():
    model = _model("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optimizer, "cpu")
    before = _everything(model, optimizer)
    snapshot = state.capture(model, optimizer, parameters=False)
    assert not snapshot.parameters and not any(n.startswith("param:") for n in snapshot.tensors)
    _train(model, optimizer, "cpu")
    state.restore(snapshot, model, optimizer)
    after = _differences(before, _everything(model, optimizer))
    parameter_names = {f"t/{n}" for n, _ in model.named_parameters()}
    assert after and set(after) == parameter_names  # the buffers, gradients and optimizer came back; weights not


def test_weights_copy_is_refused_for_tensor_subclasses():
    class Sub(torch.Tensor):
        pass

    model = nn.Linear(4, 4)
    assert state.WeightsCopy.usable(model)
    model.weight = nn.Parameter(model.weight.detach().as_subclass(Sub))
    assert not state.WeightsCopy.usable(model)


@pytest.mark.gpu
def test_cuda_weights_copy_stays_on_the_device_and_is_exact():
    _weights_copy_roundtrip("cuda")


def test_weights_copy_holds_frozen_parameters_too_and_sees_data_assignments_and_nan_bits():
    """A frozen parameter gets no gradient, but a forward may write it (``nn.Embedding(max_norm=...)``): it is
    copied and put back like the rest. ``p.data = ...`` (no version bump) is seen by its new storage, and the
    value check compares bits: an unchanged NaN is unchanged, a -0.0 written over 0.0 is a change."""
    model = nn.Sequential(nn.Embedding(8, 4, max_norm=1.0), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    with torch.no_grad():
        model[0].weight.mul_(10.0)
        model[1].bias[0] = float("nan")
        model[1].bias[1] = 0.0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    copy = state.WeightsCopy(model)
    assert len(copy.copies) == 3 and state.WeightsCopy.nbytes(model) == (8 * 4 + 4 * 2 + 2) * 4
    assert not copy.differs()  # the NaN equals its own bits
    model(torch.arange(4))  # max_norm renormalises the rows it looks up, in place
    assert copy.written() == "0.weight" and copy.differs()
    copy.put_back()
    assert all(torch.equal(p.view(torch.uint8), before[n].view(torch.uint8)) for n, p in model.named_parameters())
    model[1].weight.data = model[1].weight.data.clone()  # the same values, new storage, no version bump
    assert copy.written() == "1.weight"
    again = state.WeightsCopy(model)
    with torch.no_grad():
        model[1].bias.data[1] = -0.0  # through .data: no version bump; equal by value, not by bits
    assert again.written() is None and again.differs()
