"""autoaccum.distributed on two gloo ranks (CPU), against single-process full-batch references.

Every multi-process test spawns two processes and bounds them with a timeout, so that a hang fails instead of
blocking the run. Each spawn costs seconds, so one spawned run makes many checks: the parent
compares what each rank recorded with what one process computes on the same global batches.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _spawn import TIMEOUT_S, errors, results, spawn
from helpers import needs_gloo

import autoaccum
import autoaccum.distributed
from autoaccum.distributed import DistributedSync, unwrap_model, wrap_model
from autoaccum.plan.cut import SampleCut
from autoaccum.plan.data import GlobalBatches

pytestmark = [needs_gloo,
              pytest.mark.slow]  # several processes each

TARGET, MICRO, SEED = 16, 4, 7
N_SAMPLES = 16 * 5 + 1  # five full global batches, then one of a single sample: rank 1's share is empty
RTOL, ATOL = 1e-5, 1e-6


# -- the model, the data, the injected OOM ------------------------------------------------------------
class _InjectFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, owner: Injector) -> torch.Tensor:
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        owner = ctx.owner
        if owner.armed is not None:
            owner.armed -= 1
            if owner.armed == 0:
                owner.armed = None
                raise torch.OutOfMemoryError("injected: out of memory in backward")
        return grad, None


class Injector(torch.nn.Module):
    """Raises torch.OutOfMemoryError in the ``armed``-th backward from now (once), in mid-model."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InjectFn.apply(x, self)


class Net(torch.nn.Module):
    """A small MLP; ``extra`` is used only for samples flagged in column 0; ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.inject = Injector()
        self.out = torch.nn.Linear(16, 3)
        self.extra = torch.nn.Parameter(torch.full((3,), 0.5))
        self.never = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inject(self.inp(x)))
        y = self.out(h)
        flagged = x[:, 0] > 1.5
        if bool(flagged.any()):
            y = y + flagged[:, None].float() * self.extra
        return y


def make_net() -> Net:
    torch.manual_seed(SEED)
    return Net()


def make_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(N_SAMPLES, 6, generator=g)
    x[:, 0] = torch.where(torch.rand(N_SAMPLES, generator=g) < 0.1, 2.0, 0.0)  # a few flagged samples
    y = torch.randint(0, 3, (N_SAMPLES,), generator=g)
    tokens = torch.randint(1, 6, (N_SAMPLES,), generator=g)  # token-level loss: items per sample
    return x, y, tokens


def mean_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y, _ = batch
    return F.cross_entropy(model(x), y)


def token_loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # each sample counts as `tokens` items: loss_sum = sum_i tokens_i * ce_i, num_items = sum_i tokens_i
    x, y, tokens = batch
    ce = F.cross_entropy(model(x), y, reduction="none")
    return (ce * tokens).sum(), tokens.sum()


class RecordingSGD(torch.optim.SGD):
    """SGD that records the gradients it steps on."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.seen: list[dict[int, torch.Tensor | None]] = []

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.seen.append({i: None if p.grad is None else _full(p.grad).clone()
                          for i, p in enumerate(self.param_groups[0]["params"])})
        return super().step(closure)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 shard) gathered to the full tensor; a plain tensor as it is."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t.detach()).cpu()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model = unwrap_model(model)
    return {n: _full(p).clone() for n, p in model.named_parameters()}


# step schedule of the suite: (loss, OOM on rank 1 at this backward call of the step, or None)
SCHEDULE = [
    ("mean", None),
    ("mean", None),
    ("token", None),
    ("mean", 1),  # first backward of the step: a non-final micro-batch
    ("mean", "last"),  # the last micro-batch's backward: where the gloo hazard struck
    ("mean", None),  # the partial last batch: one sample, rank 1's share empty
]


def reference() -> tuple[dict[str, torch.Tensor], list[dict[int, torch.Tensor | None]], list[float], int]:
    """One process, one full-batch step per global batch: the ground truth."""
    model = make_net()
    opt = RecordingSGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, tokens = [], 0
    for rb, (kind, _) in zip(GlobalBatches(make_data(), TARGET, seed=SEED).epoch(0), SCHEDULE):
        opt.zero_grad(set_to_none=True)
        if kind == "mean":
            loss = mean_loss(model, rb.batch)
        else:
            loss_sum, items = token_loss(model, rb.batch)
            loss = loss_sum / items
            tokens = int(items)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return _params(model), opt.seen, losses, tokens


# -- the suite, run on each rank ----------------------------------------------------------------------
def suite(rank: int, world_size: int, kind: str, device: str = "cpu") -> dict[str, Any]:
    net = make_net().to(device)
    if kind == "ddp":
        model = wrap_model(net)
    elif kind == "fsdp2":
        model = net = sharded()
    else:
        model = net
    opt = RecordingSGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = DistributedSync(model)
    guard = autoaccum.OOMGuard(model, opt, target_batch=TARGET, micro_batch=MICRO, sync=sync)
    window_grads: list[torch.Tensor] = []
    flagged: list[list[int]] = []  # per attempt: samples that use `extra`, per micro-batch

    def spy(loss_fn: Any) -> Any:
        def wrapped(m: torch.nn.Module, batch: Any) -> Any:
            g = net.inp.weight.grad  # under FSDP2, the unsharded parameter's gradient inside the window
            if g is not None:  # micro-batches after the first: what the earlier backwards left, unsynced
                window_grads.append(_full(g).clone())
            else:  # the first micro-batch of an attempt
                flagged.append([])
            flagged[-1].append(int((batch[0][:, 0] > 1.5).sum()))
            return loss_fn(m, batch)
        return wrapped

    steps = []
    batches = GlobalBatches(make_data(), TARGET, seed=SEED, rank=rank, world_size=world_size).epoch(0)
    for rb, (loss_kind, oom_at) in zip(batches, SCHEDULE):
        if rank == 1 and oom_at is not None:
            net.inject.armed = guard.plan.accum_steps if oom_at == "last" else oom_at
        fn = mean_loss if loss_kind == "mean" else token_loss
        flagged.clear()
        stats = guard.step(rb.batch, spy(fn), partial=rb.partial)
        steps.append({"loss": stats.loss, "num_items": stats.num_items, "num_samples": stats.num_samples,
                      "attempts": stats.attempts, "n": len(rb.batch[0]), "tokens": int(rb.batch[2].sum()),
                      "flagged": flagged[-1] if flagged else [],
                      "changes": [(c.reason, c.old.micro_batch, c.new.micro_batch) for c in stats.changes]})
    return {"params": _params(model), "seen": opt.seen, "steps": steps, "window_grads": window_grads,
            "plan": guard.plan.to_dict(), "kind": kind}


def local_first_micro_grad(rank: int) -> torch.Tensor:
    """What rank ``rank`` holds in ``inp.weight.grad`` after its first micro-batch's backward, unsynced."""
    model = make_net()
    rb = next(iter(GlobalBatches(make_data(), TARGET, seed=SEED, rank=rank, world_size=2).epoch(0)))
    micro = tuple(t[:MICRO] for t in rb.batch)
    (mean_loss(model, micro) * (MICRO / TARGET)).backward()
    return model.inp.weight.grad


def _check_suite(out: list[dict[str, Any]]) -> None:
    ref_params, ref_seen, ref_losses, ref_tokens = reference()
    names = list(ref_params)
    for rank, r in enumerate(out):
        # the exact sequence of plans: the OOM on rank 1 shrank both ranks, at the same steps
        assert [s["changes"] for s in r["steps"]] == [[], [], [], [("oom", 4, 2)], [("oom", 2, 1)], []], rank
        assert [s["attempts"] for s in r["steps"]] == [1, 1, 1, 2, 2, 1]
        assert [s["num_samples"] for s in r["steps"]] == [16] * 5 + [1]
        assert r["plan"]["micro_batch"] == 1
        # accumulated on two ranks == one full-batch step, every step: the gradient the optimizer saw
        assert len(r["seen"]) == len(ref_seen) == 6
        for step, (got, want) in enumerate(zip(r["seen"], ref_seen)):
            for i, g in want.items():
                if g is None:  # unused on every rank: no gradient, as in one process (the optimizer skips it)
                    assert got[i] is None, (rank, step, names[i])
                else:
                    torch.testing.assert_close(got[i], g, rtol=RTOL, atol=ATOL,
                                               msg=f"rank {rank} step {step} {names[i]}")
        assert [s["loss"] for s in r["steps"]] == pytest.approx(ref_losses, rel=1e-5)
        # token-level step: normalised by the global token count
        assert r["steps"][2]["num_items"] == ref_tokens
        for name, p in ref_params.items():
            torch.testing.assert_close(r["params"][name], p, rtol=RTOL, atol=ATOL, msg=f"rank {rank} {name}")
        # inside the window the gradient is this rank's own micro-batch, not synced (first step)
        torch.testing.assert_close(r["window_grads"][0], local_first_micro_grad(rank), rtol=RTOL, atol=ATOL)
    assert not torch.allclose(out[0]["window_grads"][0], out[1]["window_grads"][0])
    # both ranks hold the same parameters, bit for bit
    for name in ref_params:
        assert torch.equal(out[0]["params"][name], out[1]["params"][name]), name
    # the token-level step had different token counts on the two ranks
    assert out[0]["steps"][2]["tokens"] != out[1]["steps"][2]["tokens"]
    assert out[0]["steps"][2]["tokens"] + out[1]["steps"][2]["tokens"] == ref_tokens
    # `extra` was used in some micro-batches only, and in some step on one rank only
    flags = [[s["flagged"] for s in r["steps"]] for r in out]
    assert any(0 in f and any(f) for steps in flags for f in steps), flags
    assert any(sum(a) == 0 < sum(b) or sum(b) == 0 < sum(a) for a, b in zip(*flags)), flags
    # the partial last batch: rank 0 had the one sample, rank 1 an empty share
    assert [r["steps"][5]["n"] for r in out] == [1, 0]


KINDS = ("ddp", "plain", "fsdp2")


def fsdp2_supported() -> bool:
    """FSDP2 under autoaccum needs FSDPModule.reset_iter_state and friends (torch >= 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    return all(hasattr(FSDPModule, name) for name in
               ("reset_iter_state", "set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params"))


def suites(rank: int, world_size: int) -> dict[str, Any]:
    """Every kind of model, one after another, in one spawned run; then the plan agreement."""
    out: dict[str, Any] = {kind: suite(rank, world_size, kind) for kind in KINDS
                           if kind != "fsdp2" or fsdp2_supported()}
    # rank 1 proposes a smaller micro-batch: both take it; a rank without a plan takes the others'
    mine = autoaccum.Plan.for_target(TARGET, 8 if rank == 0 else 2, world_size)
    out["plan_min"] = autoaccum.distributed.broadcast_plan(mine).to_dict()
    out["plan_rank0"] = autoaccum.distributed.broadcast_plan(mine if rank == 0 else None).to_dict()
    try:
        autoaccum.distributed.broadcast_plan(autoaccum.Plan.for_target(TARGET + rank * 2, 4, world_size))
        out["plan_mismatch"] = None
    except ValueError as exc:
        out["plan_mismatch"] = str(exc)
    # wrapping: DDP once, never twice; FSDP2 and DDP models come back as they are
    ddp = wrap_model(make_net())
    out["wrap_twice"] = wrap_model(ddp) is ddp and isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    return out


@pytest.fixture(scope="module")
def suite_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("suites")
    codes, _ = spawn(suites, tmp_path)
    return {"out": results(tmp_path, codes)}


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_equal_one_full_batch_step(kind: str, suite_runs: dict[str, Any]) -> None:
    """DDP, a plain module and FSDP2 (fully_shard runs on CPU/gloo in torch 2.13): two ranks, micro-batches
    under no_sync, OOMs on rank 1 in a non-final and in the final backward, a token-level step, a
    parameter used in some micro-batches only and one never used, an empty share in the last step."""
    if kind == "fsdp2" and not fsdp2_supported():
        pytest.skip("FSDP2 under autoaccum needs torch >= 2.13 (FSDPModule.reset_iter_state); "
                    f"this is {torch.__version__}")
    _check_suite([r[kind] for r in suite_runs["out"]])


def cuda_suite(rank: int, world_size: int) -> dict[str, Any]:
    return {kind: suite(rank, world_size, kind, device="cuda") for kind in ("ddp", "plain")}


@pytest.mark.gpu
def test_two_ranks_on_cuda_equal_one_full_batch_step(tmp_path: Path) -> None:
    """The same suite with the model on CUDA (both ranks on the one GPU, gloo moving CUDA tensors):
    the exchange tensors follow the backend, the gradients stay on the device."""
    codes, _ = spawn(cuda_suite, tmp_path)
    out = results(tmp_path, codes)
    for kind in ("ddp", "plain"):
        _check_suite([r[kind] for r in out])


def test_plans_agree_smallest_micro_batch_wins(suite_runs: dict[str, Any]) -> None:
    for r in suite_runs["out"]:
        assert r["plan_min"] == {"micro_batch": 2, "accum_steps": 4, "world_size": 2, "target_batch": TARGET,
                                 "min_micro_batch": 1}
        assert r["plan_rank0"] == {"micro_batch": 8, "accum_steps": 1, "world_size": 2, "target_batch": TARGET,
                                   "min_micro_batch": 1}
        assert r["plan_mismatch"] is not None and "target_batch 16..18" in r["plan_mismatch"]
        assert r["wrap_twice"]


# -- uneven shares under FSDP2: every rank the same number of micro-steps -----------------------------
UNEVEN_TARGET, UNEVEN_STEPS = 9, 3  # shares 5 and 4 at micro-batch 1: rank 1 ends each step with an empty micro-step
FP64 = {"rtol": 1e-12, "atol": 1e-12}


def uneven_batches(rank: int = 0, world_size: int = 1) -> Any:
    """The first global batches of 9 samples, in fp64: this rank's share of each."""
    data = tuple(t.double() if t.is_floating_point() else t for t in make_data())
    batches = GlobalBatches(data, UNEVEN_TARGET, seed=SEED, rank=rank, world_size=world_size).epoch(0)
    return itertools.islice(batches, UNEVEN_STEPS)


def uneven_fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 at micro-batch 1 on shares of 5 and 4: per step, the sizes the cutter produced and the forwards run."""
    model = sharded(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cut_sizes: list[list[int]] = []  # per attempt: the micro-batch sizes the guard took from the cutter
    forwards: list[int] = []  # per step: loss_fn calls

    class CountingCut(SampleCut):
        def __call__(self, batch: Any, num_samples: int, plan: autoaccum.Plan, steps: int) -> Any:
            cut_sizes.append([])
            for micro in super().__call__(batch, num_samples, plan, steps):
                cut_sizes[-1].append(micro.num_samples)
                yield micro

    counting_cut = CountingCut()

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        forwards[-1] += 1
        return mean_loss(m, batch)

    guard = autoaccum.OOMGuard(model, opt, target_batch=UNEVEN_TARGET, micro_batch=1, cut=counting_cut,
                               sync=DistributedSync(model))
    for rb in uneven_batches(rank, world_size):
        forwards.append(0)
        guard.step(rb.batch, loss_fn)
    return {"params": _params(model), "cut_sizes": cut_sizes, "forwards": forwards, "plan": guard.plan.to_dict()}


def uneven_reference() -> dict[str, torch.Tensor]:
    """One process, fp64, one full-batch step of 9 samples per global batch."""
    model = make_net().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for rb in uneven_batches():
        opt.zero_grad(set_to_none=True)
        mean_loss(model, rb.batch).backward()
        opt.step()
    return _params(model)


def test_fsdp2_uneven_shares_run_the_same_micro_steps_on_every_rank(tmp_path: Path) -> None:
    """Target 9 on two ranks at micro-batch 1 (the negative control of tests/plan/test_cut.py, on real ranks):
    rank 0 cuts its 5 samples into 5 micro-steps, rank 1 its 4 into 4 and one empty one (which runs no
    forward); the parameters equal one process's full-batch steps in fp64. The counts are what tell
    the cutters apart here: the window holds no FSDP2 collective, so with the old per-rank cut (5 and
    4 micro-steps) this run still ends, with the same parameters."""
    if not fsdp2_supported():
        pytest.skip("FSDP2 under autoaccum needs torch >= 2.13 (FSDPModule.reset_iter_state); "
                    f"this is {torch.__version__}")
    codes, _ = spawn(uneven_fsdp2, tmp_path)  # bounded by TIMEOUT_S: a hang fails
    out = results(tmp_path, codes)
    assert [r["cut_sizes"] for r in out] == [[[1, 1, 1, 1, 1]] * UNEVEN_STEPS, [[1, 1, 1, 1, 0]] * UNEVEN_STEPS]
    assert [len(s) for s in out[0]["cut_sizes"]] == [len(s) for s in out[1]["cut_sizes"]] == [5] * UNEVEN_STEPS
    assert [r["forwards"] for r in out] == [[5] * UNEVEN_STEPS, [4] * UNEVEN_STEPS]  # an empty micro-step runs none
    assert all(r["plan"] == {"micro_batch": 1, "accum_steps": 5, "world_size": 2, "target_batch": UNEVEN_TARGET,
                             "min_micro_batch": 1} for r in out)
    want = uneven_reference()
    for rank, r in enumerate(out):
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, **FP64, msg=f"rank {rank} {name}")
    assert not torch.equal(want["inp.weight"], make_net().double().inp.weight)  # the steps moved the weights


def fail_on_rank_zero(rank: int, world_size: int) -> None:
    model = wrap_model(make_net())
    guard = autoaccum.OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=TARGET,
                               micro_batch=MICRO, sync=DistributedSync(model))
    calls = 0

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if rank == 0 and calls == 4:  # step 2, its last micro-batch
            raise ValueError("bad sample on rank 0")
        return mean_loss(m, batch)

    for rb in GlobalBatches(make_data(), TARGET, seed=SEED, rank=rank, world_size=world_size).epoch(0):
        guard.step(rb.batch, loss_fn, partial=rb.partial)


def test_value_error_on_one_rank_ends_every_rank(tmp_path: Path) -> None:
    codes, _ = spawn(fail_on_rank_zero, tmp_path, timeout_s=60)
    assert all(code not in (0, None) for code in codes), codes  # None: hung past the timeout
    ends = [e.splitlines()[0] for e in errors(tmp_path)]  # type: ignore[union-attr]
    assert ends == ["ValueError", "AutoAccumError"]  # rank 0 its own error, rank 1 the domain error


def naive_sync_in_last_backward(rank: int, world_size: int) -> None:
    """The design the hazard comes from: DDP syncs in the last micro-batch's backward, the OOM flag
    is exchanged after it. Rank 1 runs out of memory in that backward."""
    torch.manual_seed(SEED)
    inject = Injector()
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 16), inject, torch.nn.Tanh(), torch.nn.Linear(16, 3)))
    x, y, _ = make_data()
    x, y = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
    inject.armed = 2 if rank == 1 else None
    status = 0
    try:
        for i in range(2):
            with model.no_sync() if i == 0 else contextlib.nullcontext():
                F.cross_entropy(model(x[i * 4:(i + 1) * 4]), y[i * 4:(i + 1) * 4]).backward()
    except torch.OutOfMemoryError:
        status = 1
    flag = torch.tensor([status])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)


def test_negative_control_naive_sync_dies_where_ours_shrinks(tmp_path: Path) -> None:
    """The suite puts an OOM in the final backward and both ranks shrink; the naive design, with the
    same injection, loses both processes on this gloo build (rank 1 aborts, rank 0 loses its peer)."""
    codes, _ = spawn(naive_sync_in_last_backward, tmp_path, timeout_s=45, allow_hang=True)
    assert codes != [0, 0], "the naive design survived: the injection is not where the hazard is"


# -- in one process -----------------------------------------------------------------------------------
def test_without_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert not autoaccum.distributed.is_distributed()
    assert autoaccum.distributed.world_info() == autoaccum.distributed.WorldInfo(0, 1, 0, None)
    assert autoaccum.distributed.is_rank_zero()
    assert autoaccum.distributed.init_from_env() is False  # no torchrun variables: nothing to do
    plan = autoaccum.Plan.for_target(16, 4)
    assert autoaccum.distributed.broadcast_plan(plan) is plan
    with pytest.raises(RuntimeError, match="process group"):
        DistributedSync(make_net())
    with pytest.raises(RuntimeError, match="process group"):
        wrap_model(make_net())
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert autoaccum.distributed.world_info() == autoaccum.distributed.WorldInfo(3, 4, 1, None)
    assert not autoaccum.distributed.is_rank_zero()


def test_buckets_split_by_dtype_and_size() -> None:
    params = [torch.nn.Parameter(torch.zeros(n, dtype=d)) for n, d in
              [(4, torch.float32), (4, torch.float32), (8, torch.float32), (2, torch.float64), (1, torch.float32)]]
    buckets = list(autoaccum.distributed.ddp._buckets(params, bucket_bytes=32))
    assert [[p.numel() for p in b] for b in buckets] == [[4, 4], [8], [2], [1]]


# -- fit under torch.distributed -----------------------------------------------------------------------
def _fit(model: torch.nn.Module, **kwargs: Any) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return autoaccum.fit(model, make_data(), target_batch=TARGET, loss_fn=mean_loss, optimizer=opt,
                         progress=False, seed=SEED, **kwargs)


def fit_two_ranks(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    """fit unchanged under a process group: probed plan agreed, DDP, resume from rank 0's checkpoint."""
    model = make_net()
    reported: list[dict[str, Any]] = []  # report_to and callbacks: rank 0 only
    callback = type("Callback", (), {"on_step": lambda self, m: reported.append(m),
                                     "on_end": lambda self, r: reported.append({"end": True})})()
    whole = _fit(model, epochs=1, report_to=reported.append, callbacks=[callback])
    out = {"params": _params(model), "plan": whole.plan.to_dict(), "steps": whole.optimizer_steps,
           "samples": whole.samples_seen, "losses": list(whole.losses), "reported": len(reported)}
    first = make_net()
    _fit(first, max_steps=3, checkpoint_dir=checkpoint_dir, plan=autoaccum.Plan.for_target(TARGET, 2, world_size))
    dist.barrier()  # rank 0 wrote the checkpoint; every rank reads it
    resumed = make_net()
    again = _fit(resumed, epochs=1, checkpoint_dir=checkpoint_dir, resume=True)
    out.update(resumed=_params(resumed), resumed_source=again.plan_source, resumed_steps=again.optimizer_steps)
    # FSDP2: fit takes the sharded model as it is (a plan is needed: it does not probe sharded models);
    # the checkpoint holds the full state, gathered to rank 0, and every rank loads its shards back
    if not fsdp2_supported():
        return out
    plan = autoaccum.Plan.for_target(TARGET, 4, world_size)
    out["fsdp2_probe_error"] = None
    try:
        _fit(sharded(), epochs=1)
    except ValueError as exc:
        out["fsdp2_probe_error"] = str(exc)
    fsdp_dir = str(Path(checkpoint_dir) / "fsdp2")
    _fit(sharded(), max_steps=4, plan=plan, checkpoint_dir=fsdp_dir)
    dist.barrier()
    model = sharded()
    _fit(model, epochs=1, plan=plan, checkpoint_dir=fsdp_dir, resume=True)
    out["fsdp2_resumed"] = _params(model)
    return out


def sharded(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    net = make_net().to(dtype)
    fully_shard(net.inp)
    fully_shard(net.out)
    return fully_shard(net)


def test_fit_on_two_ranks_equals_fit_in_one_process(tmp_path: Path) -> None:
    codes, _ = spawn(fit_two_ranks, tmp_path, checkpoint_dir=str(tmp_path / "ckpt"))
    out = results(tmp_path, codes)
    model = make_net()
    one = _fit(model, epochs=1)
    want = _params(model)
    assert out[0]["plan"] == out[1]["plan"] and out[0]["plan"]["world_size"] == 2
    assert [r["reported"] for r in out] == [2 * 6 + 1, 0]  # each step to the callable and the callback, one end
    for r in out:
        assert r["steps"] == one.optimizer_steps == 6 and r["samples"] == one.samples_seen == N_SAMPLES
        assert r["losses"] == pytest.approx(list(one.losses), rel=1e-5)
        assert r["resumed_source"] == "checkpoint" and r["resumed_steps"] == 6
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, rtol=RTOL, atol=ATOL, msg=name)
            torch.testing.assert_close(r["resumed"][name], p, rtol=RTOL, atol=ATOL, msg=f"resumed {name}")
            if fsdp2_supported():
                torch.testing.assert_close(r["fsdp2_resumed"][name], p, rtol=RTOL, atol=ATOL, msg=f"FSDP2 {name}")
        if fsdp2_supported():
            assert "cannot probe an FSDP2" in r["fsdp2_probe_error"]


def test_example_under_torchrun() -> None:
    """examples/ddp.py, launched the way the README says (torchrun, 2 processes, gloo on CPU)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(root / "examples" / "ddp.py")], cwd=root, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ranks, identical weights on every rank: True" in proc.stdout
    assert " per rank x 2 ranks (" in proc.stdout and " micro-batches each) · 32 steps" in proc.stdout
    assert proc.stderr.count("autoaccum fit done") == 1  # fit's log lines come from rank 0 only


def buffers_after_steps(rank: int, world_size: int, broadcast: bool) -> dict[str, Any]:
    """A DDP model with BatchNorm (buffers) under the guard, each rank on data of its own: the running
    statistics after two steps, and rank 0's own statistics from the same data in one process."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    model = torch.nn.parallel.DistributedDataParallel(net, broadcast_buffers=broadcast)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = autoaccum.OOMGuard(model, opt, target_batch=16, micro_batch=4, sync=DistributedSync(model))
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x, y = torch.randn(8, 4, generator=g) * (rank + 1), torch.randint(0, 2, (8,), generator=g)
        guard.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    return {"mean": net[1].running_mean.clone(), "var": net[1].running_var.clone(),
            "batches": int(net[1].num_batches_tracked)}


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast_buffers", "negative_control"])
def test_ddp_buffers_follow_rank_zero_after_each_step(tmp_path: Path, broadcast: bool) -> None:
    """DDP(broadcast_buffers=True), DDP's default: after each guarded step every rank holds rank 0's
    buffers (the guard broadcasts them, as DDP does before a synchronised forward; its micro-batches
    run under no_sync). Negative control: with broadcast_buffers=False each rank keeps its own,
    which differ here (the ranks' data differ)."""
    first, second = results(tmp_path, spawn(buffers_after_steps, tmp_path, broadcast=broadcast)[0])
    assert first["batches"] == second["batches"] == 4  # 2 micro-batches a step on each rank, 2 steps
    same = torch.equal(first["mean"], second["mean"]) and torch.equal(first["var"], second["var"])
    assert same is broadcast, (first, second)
