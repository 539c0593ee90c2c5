"""The overlapped all-reduce (``overlap="on"``) on each backend it can meet: gloo (CPU) and NCCL (CUDA).

The two-rank tests (``test_distributed_overlap``, gloo) hold the protocol and the sums; what they cannot
show is that NCCL takes the same calls, since they run on CPU, and one GPU cannot host two NCCL ranks.
Here one process is a world of one on each backend:

- driving one overlapped attempt the way the guard does (``prepare_overlap``, ``overlapped``, ``arm``
  before the last backward, ``agree_step``, ``reduce_gradients``). In a world of one the sum of a
  bucket is the bucket itself, so the reduced gradients must equal the plain accumulated ones bit for
  bit; the step's scalars come back unchanged; every bucket went out sent ahead (the early ones from
  inside the backward), then the flag in an exchange of its own, waited for at once;
- the guard itself, overlap off and on, against one process's full-batch steps.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _collectives import recording_all_reduces
from autoaccum.distributed import DistributedSync

BACKENDS = [
    pytest.param("gloo", "cpu", id="gloo-cpu",
                 marks=pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")),
    pytest.param("nccl", "cuda", id="nccl-cuda",
                 marks=[pytest.mark.gpu,
                        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
                        pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(), reason="no NCCL")]),
]
MICRO, STEPS = 4, 3
BUCKET_BYTES = 256  # three buckets for this net (fp32 and bf16): the first two leave during the last backward


def _net(dtype: torch.dtype, device: str) -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4)).to(device=device, dtype=dtype)


def _accumulate(net: torch.nn.Module, xs: list[torch.Tensor], arm: Any = None) -> None:
    for i, x in enumerate(xs):
        if arm is not None and i == len(xs) - 1:
            arm()
        (net(x).square().mean() / len(xs)).backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_overlapped_buckets_then_the_flag_on_each_backend(tmp_path: Path, backend: str, device: str,
                                                                         dtype: torch.dtype) -> None:
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    calls: list[tuple[Any, ...]] = []
    try:
        net, reference = _net(dtype, device), _net(dtype, device)
        sync = DistributedSync(net, bucket_bytes=BUCKET_BYTES)
        params = list(net.parameters())
        generator = torch.Generator().manual_seed(6)
        for step in range(STEPS):
            xs = [torch.randn(MICRO, 12, generator=generator).to(device=device, dtype=dtype) for _ in range(3)]
            for p in params + list(reference.parameters()):
                p.grad = None
            _accumulate(reference, xs)
            assert sync.prepare_overlap(params)
            calls.clear()
            scalars = (1.5 + step, 12.0, 1.0, 0.0)
            with recording_all_reduces(calls, describe=lambda t: (t.device.type,)):
                arm = sync.overlapped(params)
                _accumulate(net, xs, arm)
                agreement = sync.agree_step(0, scalars)
                sync.reduce_gradients(params)
            overlap = sync._overlap
            assert overlap is not None and not overlap.active
            assert agreement.status == 0 and not overlap.late, f"step {step}: the attempt was not agreed OK"
            assert agreement.sums == pytest.approx(scalars, abs=0), f"step {step}: the scalars changed in a world of one"
            buckets = len(overlap.buckets)
            assert buckets >= 3, f"only {buckets} buckets: the test needs some that leave during the backward"
            assert overlap.early >= 1, f"step {step}: no bucket left during the backward: nothing was overlapped"
            # every bucket sent ahead, on the model's device; then the flag's own exchange (waited on at
            # once, on the backend's device: the CPU for gloo, the current GPU for NCCL)
            expected = [(torch.device(device).type, True)] * buckets + [(torch.device(device).type, False)]
            assert calls == expected, f"step {step}: all-reduces {calls}, expected {expected}"
            for (name, p), q in zip(net.named_parameters(), reference.parameters()):
                assert p.grad is not None and torch.equal(p.grad, q.grad), f"step {step}: {name}'s summed gradient differs"
            with torch.no_grad():  # a step, so that the next attempt starts from other weights on both
                for p, q in zip(params, reference.parameters()):
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend,device", BACKENDS[:1])
def test_negative_control_a_bucket_armed_too_early_differs_from_the_plain_gradients(tmp_path: Path, backend: str,
                                                                                    device: str) -> None:
    """Armed at the first micro-batch with the lateness check off, the early buckets leave before the
    gradients are final: the comparison above must see it (so its equality is not vacuous)."""
    from autoaccum.distributed import overlap as overlap_module

    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    real_late = overlap_module._OverlappedReduce._late_params
    overlap_module._OverlappedReduce._late_params = lambda self: []  # type: ignore[method-assign]
    try:
        net, reference = _net(torch.float32, device), _net(torch.float32, device)
        sync = DistributedSync(net, bucket_bytes=BUCKET_BYTES)
        params = list(net.parameters())
        xs = [torch.randn(MICRO, 12, generator=torch.Generator().manual_seed(6)) for _ in range(3)]
        _accumulate(reference, xs)
        assert sync.prepare_overlap(params)
        arm = sync.overlapped(params)
        arm()  # at the first micro-batch, not the last
        _accumulate(net, xs)
        sync.agree_step(0, (0.0, 0.0, 0.0, 0.0))
        sync.reduce_gradients(params)
        differs = [name for (name, p), q in zip(net.named_parameters(), reference.parameters())
                   if not torch.equal(p.grad, q.grad)]
        assert differs, "buckets sent after the first backward gave the final gradients: the test cannot tell"
    finally:
        overlap_module._OverlappedReduce._late_params = real_late  # type: ignore[method-assign]
        dist.destroy_process_group()


def _guard_steps(backend: str, device: str, overlap: str) -> tuple[list[bool], dict[str, torch.Tensor]]:
    import warnings

    import autoaccum

    net = _net(torch.float64 if device == "cpu" else torch.float32, device)
    sync = DistributedSync(net, bucket_bytes=BUCKET_BYTES)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "autoaccum: overlap='on' is experimental")
        guard = autoaccum.OOMGuard(net, torch.optim.SGD(net.parameters(), lr=0.1), target_batch=12,
                                   micro_batch=MICRO, sync=sync, overlap=overlap)
    dtype = next(net.parameters()).dtype
    generator = torch.Generator().manual_seed(7)
    overlapped = []
    for _ in range(STEPS):
        x = torch.randn(12, 12, generator=generator).to(device=device, dtype=dtype)
        overlapped.append(guard.step(x, lambda m, b: m(b).square().mean()).overlapped)
    return overlapped, {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_the_guard_in_a_world_of_one_overlapped_or_not_equals_full_batch_steps(tmp_path: Path, backend: str,
                                                                              device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        runs = {overlap: _guard_steps(backend, device, overlap) for overlap in ("off", "on")}
    finally:
        dist.destroy_process_group()
    reference = _net(torch.float64 if device == "cpu" else torch.float32, device)
    dtype = next(reference.parameters()).dtype
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        x = torch.randn(12, 12, generator=generator).to(device=device, dtype=dtype)
        opt.zero_grad()
        reference(x).square().mean().backward()
        opt.step()
    tolerance = {"rtol": 1e-10, "atol": 1e-12} if device == "cpu" else {"rtol": 1e-5, "atol": 1e-6}
    assert runs["off"][0] == [False] * STEPS and runs["on"][0] == [True] * STEPS
    for overlap, (_, params) in runs.items():
        for name, q in reference.named_parameters():
            torch.testing.assert_close(params[name], q.detach(), **tolerance, msg=f"{overlap} {name}")
