"""Training-state snapshots (autoaccum.state): what capture copies comes back bit for bit; on CUDA the
copies are page-locked (queued, one wait), pageable where pinning fails, and their memory goes back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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


@pytest.mark.gpu
def test_cuda_snapshot_is_page_locked_and_exact():
    changed, after, snapshot = _roundtrip("cuda")
    assert {k.split("/")[0] for k in changed} == {"t", "g", "o"}, changed
    assert after == []
    assert all(t.is_pinned() for t in snapshot.tensors.values())
    assert all(g is None or g.is_pinned() for g in snapshot.grads.values())


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
