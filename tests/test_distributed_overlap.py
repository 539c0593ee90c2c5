"""The gradient all-reduce overlapped with the last micro-batch's backward (``overlap="on"``,
experimental), on gloo ranks (CPU).

- exact: the overlapped steps equal one process's full-batch steps in fp64 (DDP and a plain module, 2
  and 4 ranks), and so do the steps of the default protocol (overlap='off'); negative control:
  buckets sent before the gradients are final (armed at the first micro-batch, the check after the
  backward switched off) are caught by the same comparison; with the check on, the same mistake falls
  back to the default reduction, exactly, with a warning, and switches overlap off;
- the protocol: the collectives each rank issues, in order, with overlap off (the cut's exchange, the
  flag, the gradients, the scalars) and on (the cut's exchange, the buckets, then the flag with the
  scalars in an exchange of its own, in every precision);
- a randomized OOM injection: many steps, OOMs in the forward, loss or backward of the last
  micro-batch (and the first backward) of overlapped attempts, on either rank or both: no hang
  (every run bounded by a timeout), no collective mismatch, final parameters equal to the fault-free
  full-batch run, every sample in exactly one step (ids audited).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoaccum
from _audit import IdAudit
from _collectives import recording_all_reduces
from _spawn import results, spawn
from autoaccum.plan.data import GlobalBatches
from autoaccum.distributed import DistributedSync, unwrap_model, wrap_model
from test_distributed import Injector

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo"),
              pytest.mark.slow]  # several processes each

TARGET, MICRO, SEED = 16, 4, 11
BUCKET_BYTES = 200  # a few buckets for this small net (fp64): some leave during the backward, some after
FP64 = {"rtol": 1e-10, "atol": 1e-12}
ROW_FIELDS = 6  # the cut's exchange: samples, micro-steps, vote, items, counted, thrash
SCALARS = 4  # the overlapped flag's scalars: loss sum, item count, kinds of loss
COUNTS = 4  # the overlapped flag's counts before the presence bits: OOM, error, late, twice


class OverlapNet(torch.nn.Module):
    """A small MLP in fp64. ``extra`` is used only for samples flagged in column 0 (so not in every last
    micro-batch, nor on every rank), ``never`` is never used; both are registered first, so that the
    buckets (in reverse parameter order) holding the layers' gradients leave during the backward.
    ``fail_forward`` raises an OOM in the middle of the next forward (once)."""

    def __init__(self) -> None:
        super().__init__()
        self.never = torch.nn.Parameter(torch.ones(2))
        self.extra = torch.nn.Parameter(torch.full((3,), 0.5))
        self.inp = torch.nn.Linear(6, 16)
        self.inject = Injector()
        self.out = torch.nn.Linear(16, 3)
        self.fail_forward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.fail_forward:
            self.fail_forward = False
            raise torch.OutOfMemoryError("injected: out of memory in forward")
        y = self.out(torch.tanh(self.inject(h)))
        flagged = x[:, 0] > 1.5
        if bool(flagged.any()):
            y = y + flagged[:, None].to(y.dtype) * self.extra
        return y


def make_net() -> OverlapNet:
    torch.manual_seed(SEED)
    return OverlapNet().double()


class MisorderedNet(torch.nn.Module):
    """Layers registered in the reverse of their use: ``head`` (used last) before ``body``. In reverse
    parameter order, the buckets' order, the body's parameters come before the head's, while a backward
    makes the head's gradients first. With MISORDERED_BUCKET_BYTES the first bucket holds
    [body.bias, body.weight, head.bias, head.weight]: the parameter watched at first (the bucket's
    last, head.weight) is final before the body's, which the last micro-batch's backward still adds to.
    ``scale`` (registered first) is the last bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))
        self.head = torch.nn.Linear(16, 3)
        self.body = torch.nn.Linear(6, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x))) * self.scale


MISORDERED_BUCKET_BYTES = 1000  # fp64: body.bias 128 + body.weight 768 + head.bias 24 < 1000 <= + head.weight 384


def make_misordered() -> MisorderedNet:
    torch.manual_seed(SEED)
    return MisorderedNet().double()


class SharedNet(torch.nn.Module):
    """``shared`` used in two reentrant checkpointed regions: its gradient is accumulated twice in every
    backward (each region's backward is one of its own). It sits in the first bucket with ``inp``
    (SHARED_BUCKET_BYTES), whose weight, the bucket's last parameter and so the one watched, is final
    after both: the bucket leaves once the shared gradient is final. ``scale`` is the last bucket.
    ``accumulations`` counts the shared weight's accumulations (a hook set by the test's run)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))
        self.inp = torch.nn.Linear(6, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 3)
        self.accumulations = 0

    def _region(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        h = checkpoint(self._region, h, use_reentrant=True)
        h = checkpoint(self._region, h, use_reentrant=True)
        return self.out(h) * self.scale


SHARED_BUCKET_BYTES = 3400  # fp64: every layer's parameters (3480 bytes) close the first bucket; scale is the last


def make_shared() -> SharedNet:
    torch.manual_seed(SEED)
    return SharedNet().double()


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    x[:, 0] = torch.where(torch.rand(n, generator=g) < 0.15, 2.0, 0.0)
    return x, torch.randint(0, 3, (n,), generator=g), torch.arange(n)


def mean_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y, _ = batch
    return F.cross_entropy(model(x), y)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in unwrap_model(model).named_parameters()}


def reference(steps: int, n: int, make: Any = None) -> dict[str, torch.Tensor]:
    """One process, one full-batch SGD step per global batch, fp64: the ground truth (``make()``'s net,
    :func:`make_net`'s by default)."""
    model = (make or make_net)()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for _, rb in zip(range(steps), GlobalBatches(make_data(n), TARGET, seed=SEED).epoch(0)):
        opt.zero_grad(set_to_none=True)
        mean_loss(model, rb.batch).backward()
        opt.step()
    return _params(model)


def _guard(kind: str, make: Any = None, bucket_bytes: int = BUCKET_BYTES,
           **options: Any) -> tuple[Any, torch.nn.Module, autoaccum.OOMGuard, DistributedSync]:
    net = (make or make_net)()
    model = wrap_model(net) if kind == "ddp" else net
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sync = DistributedSync(model, bucket_bytes=bucket_bytes)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "autoaccum: overlap='on' is experimental")
        guard = autoaccum.OOMGuard(model, opt, sync=sync, **options)
    return net, model, guard, sync


# -- exact ----------------------------------------------------------------------------------------------
EXACT_STEPS = 5


def _run(kind: str, overlap: str, rank: int, world_size: int, arm_first: bool = False, make: Any = None,
         bucket_bytes: int = BUCKET_BYTES, setup: Any = None) -> dict[str, Any]:
    net, model, guard, sync = _guard(kind, make, bucket_bytes, target_batch=TARGET, micro_batch=MICRO,
                                     overlap=overlap)
    if setup is not None:
        setup(net)
    if arm_first:  # the mistake: send each bucket as soon as its gradients appear in the FIRST micro-batch
        start = sync.overlapped

        def armed_at_once(params: Any) -> Any:
            arm = start(params)
            arm()  # before the first micro-batch (arming again before the last one does nothing)
            return arm
        sync.overlapped = armed_at_once  # type: ignore[method-assign]
    overlapped, early, late, losses = [], [], [], []
    batches = GlobalBatches(make_data(TARGET * EXACT_STEPS), TARGET, seed=SEED, rank=rank, world_size=world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rb in batches.epoch(0):
            stats = guard.step(rb.batch, mean_loss)
            overlapped.append(stats.overlapped)
            losses.append(stats.loss)
            early.append(sync._overlap.early if sync._overlap is not None else 0)
            late.append(sync._overlap.late if sync._overlap is not None else False)
    names = {id(p): n for n, p in net.named_parameters()}
    return {"params": _params(model), "overlapped": overlapped, "early": early, "late": late, "losses": losses,
            "never_grad": getattr(net, "never", None) is not None and net.never.grad,
            "accumulations": getattr(net, "accumulations", None),
            "warnings": [str(w.message) for w in caught],
            # which parameters ever carried a post-accumulate-grad hook (the dictionary stays once made)
            "hooked": sorted(n for n, p in net.named_parameters() if p._post_accumulate_grad_hooks is not None),
            "watched": [] if sync._overlap is None else [sorted(names[id(p)] for p in w) for w in sync._overlap.watched]}


def exact_runs(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("ddp", "plain"):
        for overlap in ("on", "off"):
            out[f"{kind}/{overlap}"] = _run(kind, overlap, rank, world_size)
    out["arm_first/checked"] = _run("ddp", "on", rank, world_size, arm_first=True)
    def rewrite_out_weight(net: OverlapNet) -> None:
        # a user's hook on inp.weight (final after out.weight, whose bucket has left by then) that writes
        # out.weight's gradient in place, values unchanged: its version moves after its own hook fired
        def hook(_p: torch.Tensor) -> None:
            net.out.weight.grad.mul_(1.0)

        net.inp.weight.register_post_accumulate_grad_hook(hook)

    out["watched_written"] = _run("ddp", "on", rank, world_size, setup=rewrite_out_weight)

    def count_shared(net: SharedNet) -> None:
        def hook(_p: torch.Tensor) -> None:
            net.accumulations += 1

        net.shared.weight.register_post_accumulate_grad_hook(hook)

    out["shared"] = _run("ddp", "on", rank, world_size, make=make_shared, bucket_bytes=SHARED_BUCKET_BYTES,
                         setup=count_shared)
    for kind in ("ddp", "plain"):  # a bucket's watched parameter final before the others: learned
        out[f"misordered/{kind}"] = _run(kind, "on", rank, world_size, make=make_misordered,
                                         bucket_bytes=MISORDERED_BUCKET_BYTES)
    # negative controls: the same mistakes with the check after the backward switched off (gradients
    # changed since their bucket left, a second accumulation among them, go unseen)
    from autoaccum.distributed import overlap as overlap_module

    cls = overlap_module._OverlappedReduce
    late_params = cls._late_params
    cls._late_params = lambda self: []  # type: ignore[method-assign]
    try:
        out["arm_first/unchecked"] = _run("ddp", "on", rank, world_size, arm_first=True)
        out["misordered/unchecked"] = _run("ddp", "on", rank, world_size, make=make_misordered,
                                           bucket_bytes=MISORDERED_BUCKET_BYTES)
    finally:
        cls._late_params = late_params  # type: ignore[method-assign]
    return out


def _ranks_results(tmp_path_factory: pytest.TempPathFactory, name: str, fn: Any) -> list[dict[str, Any]]:
    """``fn`` on two spawned ranks, once for the module's tests: what each rank returned."""
    tmp_path = tmp_path_factory.mktemp(name)
    codes, _ = spawn(fn, tmp_path)
    return results(tmp_path, codes)


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _ranks_results(tmp_path_factory, "overlap_exact", exact_runs)


@pytest.mark.parametrize("kind", ["ddp", "plain"])
def test_overlapped_steps_equal_full_batch_steps_fp64(kind: str, exact: list[dict[str, Any]]) -> None:
    """overlap='on' overlaps every step; buckets leave during the backward; the parameters equal one
    process's full-batch steps (fp64, 1e-10), as the default protocol's do, and are identical on both
    ranks; a parameter no rank used has no gradient (as in one process)."""
    want = reference(EXACT_STEPS, TARGET * EXACT_STEPS)
    for rank, r in enumerate(exact):
        on, off = r[f"{kind}/on"], r[f"{kind}/off"]
        assert on["overlapped"] == [True] * EXACT_STEPS and off["overlapped"] == [False] * EXACT_STEPS
        # really overlapped: the layers' two buckets sent inside the backward; the last bucket (extra,
        # never) waits for `never`, which no backward reaches, and goes after the backward
        assert on["early"] == [2] * EXACT_STEPS, on["early"]
        assert on["late"] == [False] * EXACT_STEPS, on["late"]  # each bucket's last parameter was its last final
        # a hook only on each bucket's last parameter
        assert on["hooked"] == ["inp.weight", "never", "out.weight"], on["hooked"]
        assert on["watched"] == [["out.weight"], ["inp.weight"], ["never"]], on["watched"]
        assert on["never_grad"] is None and not [w for w in on["warnings"] if "overlapped" in w]
        for name, p in want.items():
            torch.testing.assert_close(on["params"][name], p, **FP64, msg=f"overlapped rank {rank} {name}")
            torch.testing.assert_close(off["params"][name], p, **FP64, msg=f"off rank {rank} {name}")
    for name in want:
        assert torch.equal(exact[0][f"{kind}/on"]["params"][name], exact[1][f"{kind}/on"]["params"][name])
    # the step's loss, summed over ranks in the overlapped step's flag exchange, equals the default's (summed
    # after the gradients) and is the same on both ranks
    on_losses = [r[f"{kind}/on"]["losses"] for r in exact]
    assert on_losses[0] == on_losses[1]
    torch.testing.assert_close(torch.tensor(on_losses[0]), torch.tensor(exact[0][f"{kind}/off"]["losses"]), **FP64)
    assert not torch.equal(want["inp.weight"], make_net().inp.weight)  # the steps moved the weights


def test_buckets_sent_before_the_gradients_are_final_are_caught(exact: list[dict[str, Any]]) -> None:
    """Negative control: buckets sent in the first micro-batch's backward, the check off, miss the
    later micro-batches: the comparison above fails for them. With the check on (the real code), the
    second accumulation is seen on every rank: that step is reduced the default way (exact), a warning says
    so, and the later steps are not overlapped."""
    want = reference(EXACT_STEPS, TARGET * EXACT_STEPS)
    for r in exact:
        wrong = r["arm_first/unchecked"]
        assert wrong["overlapped"] == [True] * EXACT_STEPS
        assert not torch.allclose(wrong["params"]["out.weight"], want["out.weight"], rtol=1e-3, atol=1e-6)
        checked = r["arm_first/checked"]
        assert checked["overlapped"] == [True] + [False] * (EXACT_STEPS - 1)
        assert any("no longer overlapped" in w for w in checked["warnings"]), checked["warnings"]
        for name, p in want.items():
            torch.testing.assert_close(checked["params"][name], p, **FP64, msg=name)


@pytest.mark.parametrize("kind", ["ddp", "plain"])
def test_a_bucket_sent_before_an_unwatched_gradient_was_final_is_caught_and_learned(
        kind: str, exact: list[dict[str, Any]]) -> None:
    """Only each bucket's last parameter is watched at first (a hook), on the assumption that a backward
    makes gradients in the reverse of the parameters' order. MisorderedNet breaks it: its first bucket
    leaves once head.weight is final, before the body's gradients of the last micro-batch are added.
    After the backward the body's gradients are seen to have changed since (their version counters):
    every rank drops that step's sums and reduces it the default way (exact), and the body's parameters are
    watched from then on, so every later step overlaps with its bucket sent during the backward and
    nothing late. No warning: it is not a fault. Negative control: with that check off, the same
    buckets give wrong weights."""
    want = reference(EXACT_STEPS, TARGET * EXACT_STEPS, make_misordered)
    for rank, r in enumerate(exact):
        run = r[f"misordered/{kind}"]
        # both buckets leave during the backward: the layers', then `scale`'s (final first, sent in order)
        assert run["overlapped"] == [True] * EXACT_STEPS and run["early"] == [2] * EXACT_STEPS, run
        assert run["late"] == [True] + [False] * (EXACT_STEPS - 1), run["late"]
        assert run["watched"] == [["body.bias", "body.weight", "head.weight"], ["scale"]], run["watched"]
        assert not [w for w in run["warnings"] if "overlapped" in w], run["warnings"]
        for name, p in want.items():
            torch.testing.assert_close(run["params"][name], p, **FP64, msg=f"rank {rank} {name}")
        wrong = r["misordered/unchecked"]
        assert wrong["late"] == [False] * EXACT_STEPS
        assert not torch.allclose(wrong["params"]["body.weight"], want["body.weight"], rtol=1e-3, atol=1e-6)


def test_a_gradient_accumulated_twice_before_its_bucket_leaves_keeps_overlap_on(
        exact: list[dict[str, Any]]) -> None:
    """A weight shared by two reentrant checkpointed regions is accumulated twice in every backward, both
    times before its bucket's watched parameter (the first layer's weight) is final: the bucket leaves
    with the final gradient, nothing is late, overlap stays on without a warning, every step sends the
    bucket during the backward, and the weights equal one process's full-batch steps (fp64). (Before, a
    second accumulation of any parameter switched overlap off.)"""
    want = reference(EXACT_STEPS, TARGET * EXACT_STEPS, make_shared)
    for rank, r in enumerate(exact):
        run = r["shared"]
        # two accumulations per backward: 2 micro-batches per rank and step (TARGET / 2 ranks / MICRO)
        assert run["accumulations"] == 2 * 2 * EXACT_STEPS, run["accumulations"]
        assert run["overlapped"] == [True] * EXACT_STEPS and run["early"] == [2] * EXACT_STEPS, run
        assert run["late"] == [False] * EXACT_STEPS and run["watched"] == [["inp.weight"], ["scale"]], run
        assert not [w for w in run["warnings"] if "overlapped" in w], run["warnings"]
        for name, p in want.items():
            torch.testing.assert_close(run["params"][name], p, **FP64, msg=f"rank {rank} {name}")


def test_a_watched_gradient_written_after_its_hook_switches_overlap_off(exact: list[dict[str, Any]]) -> None:
    """A watched parameter's gradient that changes after its hook fired cannot be watched: a user's hook
    on a later parameter writes out.weight's gradient in place (values unchanged, version moved). The
    first step is seen on every rank and reduced the default way (exact), overlap is switched off with a
    warning, and the later steps run the default protocol. (Learning it instead, as for an unwatched
    parameter, would send and drop the buckets of every step without end.)"""
    want = reference(EXACT_STEPS, TARGET * EXACT_STEPS)
    for r in exact:
        run = r["watched_written"]
        assert run["overlapped"] == [True] + [False] * (EXACT_STEPS - 1), run["overlapped"]
        assert run["late"][0] is True
        assert any("written by a later hook" in w for w in run["warnings"]), run["warnings"]
        for name, p in want.items():
            torch.testing.assert_close(run["params"][name], p, **FP64, msg=name)


# -- the flag's exchange: in every precision, after the buckets -----------------------------------------
def _dtype_run(dtype: torch.dtype, overlap: str, rank: int, world_size: int) -> dict[str, Any]:
    """A DDP guard on the net in ``dtype``: the parameters, each step's loss, and the all-reduces of the
    last step (elements, dtype, asynchronous)."""
    torch.manual_seed(SEED)
    net = OverlapNet().to(dtype)
    model = wrap_model(net)
    sync = DistributedSync(model, bucket_bytes=BUCKET_BYTES)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "autoaccum: overlap='on' is experimental")
        guard = autoaccum.OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), sync=sync,
                                   target_batch=TARGET, micro_batch=MICRO, overlap=overlap)
    x, y, ids = make_data(TARGET * EXACT_STEPS)
    batches = GlobalBatches((x.to(dtype), y, ids), TARGET, seed=SEED, rank=rank, world_size=world_size)
    losses, overlapped, calls = [], [], []
    for rb in batches.epoch(0):
        calls.clear()
        with recording_all_reduces(calls):
            stats = guard.step(rb.batch, mean_loss)
        losses.append(stats.loss)
        overlapped.append(stats.overlapped)
    buckets = [sum(p.numel() for p in b) for b in sync._overlap.buckets] if sync._overlap is not None else []
    return {"params": _params(model), "losses": losses, "overlapped": overlapped, "calls": list(calls),
            "buckets": buckets, "num_params": len(guard.params)}


def dtype_runs(rank: int, world_size: int) -> dict[str, Any]:
    from autoaccum.distributed import overlap as overlap_module

    out = {f"{dtype}/{overlap}": _dtype_run(dtype, overlap, rank, world_size)
           for dtype in (torch.float32, torch.bfloat16) for overlap in ("on", "off")}
    # negative control: the flag's scalars exchanged rounded to float32 (as a bucket of that dtype holds them)
    cls = overlap_module._OverlappedReduce
    exchange = cls._exchange_flag
    cls._exchange_flag = lambda self, flags, scalars: exchange(  # type: ignore[method-assign]
        self, flags, torch.tensor(list(scalars), dtype=torch.float32).tolist())
    try:
        out["torch.float32/rounded"] = _dtype_run(torch.float32, "on", rank, world_size)
    finally:
        cls._exchange_flag = exchange  # type: ignore[method-assign]
    return out


@pytest.fixture(scope="module")
def dtypes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _ranks_results(tmp_path_factory, "overlap_dtypes", dtype_runs)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_the_flag_goes_after_every_bucket_in_float64_in_every_precision(dtype: str,
                                                                       dtypes: list[dict[str, Any]]) -> None:
    """fp32 and bf16: the cut's exchange, then every bucket (sent ahead, as they are), then the flag, the
    presence bits and the float64 loss sums in one float64 exchange once every bucket is done. The step's
    loss equals the default protocol's (a float64 all-reduce) exactly, on both ranks, and the weights
    equal the default's (fp32: rtol 1e-5; bf16: 1e-2). Negative control (fp32): the scalars exchanged
    as float32 give other losses."""
    for r in dtypes:
        on, off = r[f"{dtype}/on"], r[f"{dtype}/off"]
        assert on["overlapped"] == [True] * EXACT_STEPS and off["overlapped"] == [False] * EXACT_STEPS
        p = on["num_params"]
        assert on["calls"] == [(2 * ROW_FIELDS, "torch.int64", False)] + \
            [(n, dtype, True) for n in on["buckets"]] + [(COUNTS + p + SCALARS, "torch.float64", False)], on["calls"]
        assert on["losses"] == off["losses"], (on["losses"], off["losses"])  # bit for bit
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == "torch.float32" else {"rtol": 1e-2, "atol": 1e-3}
        for name, value in off["params"].items():
            torch.testing.assert_close(on["params"][name], value, **tolerance, msg=name)
        if dtype == "torch.float32":
            rounded = r["torch.float32/rounded"]["losses"]
            assert rounded != off["losses"], "float32 scalars kept the float64 sums: the check cannot tell"
            torch.testing.assert_close(torch.tensor(rounded), torch.tensor(off["losses"]), rtol=1e-6, atol=0.0)
    assert dtypes[0][f"{dtype}/on"]["losses"] == dtypes[1][f"{dtype}/on"]["losses"]


def layout_run(rank: int, world_size: int) -> dict[str, Any]:
    """A plain module with one transposed (non-contiguous) weight: the gradients ``guard.accumulate``
    leaves after an overlapped step."""
    net = make_net()
    net.inp.weight = torch.nn.Parameter(net.inp.weight.detach().t().contiguous().t())  # strides (1, 16)
    sync = DistributedSync(net, bucket_bytes=BUCKET_BYTES)
    guard = autoaccum.OOMGuard(net, torch.optim.SGD(net.parameters(), lr=0.2), sync=sync, target_batch=TARGET,
                               micro_batch=MICRO, overlap="on")
    rb = next(iter(GlobalBatches(make_data(TARGET), TARGET, seed=SEED, rank=rank, world_size=world_size).epoch(0)))
    result = guard.accumulate(rb.batch, mean_loss)
    flats = sync._overlap.flats  # type: ignore[union-attr]

    def in_a_flat(g: torch.Tensor) -> bool:
        return any(f.data_ptr() <= g.data_ptr() < f.data_ptr() + f.numel() * f.element_size() for f in flats)

    return {"overlapped": result.overlapped,
            "grads": {n: None if q.grad is None else q.grad.clone() for n, q in net.named_parameters()},
            "strides": {n: (q.stride(), None if q.grad is None else q.grad.stride()) for n, q in net.named_parameters()},
            "views": {n: q.grad is not None and in_a_flat(q.grad) for n, q in net.named_parameters()}}


def test_overlapped_sums_are_views_of_the_buckets_and_keep_a_gradient_layout(tmp_path: Path) -> None:
    """After an overlapped step the summed gradients are handed over as views of the flat buffers (no
    copy, as DDP's gradient_as_bucket_view); a gradient whose strides differ from a flat view's (a
    transposed weight) keeps its own layout and gets the sum copied. Both equal the full-batch
    gradient of one process (fp64)."""
    codes, _ = spawn(layout_run, tmp_path)
    out = results(tmp_path, codes)
    net = make_net()
    net.inp.weight = torch.nn.Parameter(net.inp.weight.detach().t().contiguous().t())
    mean_loss(net, make_data(TARGET)).backward()
    for r in out:
        assert r["overlapped"]
        param_strides, grad_strides = r["strides"]["inp.weight"]
        assert param_strides == (1, 16) and grad_strides == (1, 16), r["strides"]["inp.weight"]
        assert not r["views"]["inp.weight"] and r["views"]["out.weight"] and r["views"]["inp.bias"], r["views"]
        assert r["grads"]["never"] is None
        for name, q in net.named_parameters():
            if q.grad is not None:
                torch.testing.assert_close(r["grads"][name], q.grad, **FP64, msg=name)


# -- real models: the watched parameters' order ------------------------------------------------------------
def _hf_models() -> dict[str, Any]:
    """Small GPT-2 and BERT (no dropout: the runs with and without overlap draw nothing at random)."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    return {
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "bert": lambda: BertForMaskedLM(BertConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                                   intermediate_size=128, vocab_size=512, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0)),
    }


HF_STEPS = 5


def hf_runs(rank: int, world_size: int) -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    out: dict[str, Any] = {}
    ids = torch.randint(0, 512, (16, 32), generator=torch.Generator().manual_seed(rank))
    for name, make in _hf_models().items():
        for overlap in ("on", "off"):
            torch.manual_seed(0)
            net = make()
            model = wrap_model(net)
            sync = DistributedSync(model, bucket_bytes=60_000)  # many buckets for these small models
            guard = autoaccum.OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), sync=sync,
                                       target_batch=32, micro_batch=4, overlap=overlap)
            late, early = [], []
            for _ in range(HF_STEPS):
                guard.step(ids, lambda m, b: m(input_ids=b, labels=b).loss)
                late.append(sync._overlap.late if sync._overlap is not None else False)
                early.append(sync._overlap.early if sync._overlap is not None else 0)
            o = sync._overlap
            out[f"{name}/{overlap}"] = {
                "params": _params(model), "late": late, "early": early,
                "buckets": 0 if o is None else len(o.buckets), "disabled": None if o is None else o.disabled,
                "hooked": sum(p._post_accumulate_grad_hooks is not None for p in net.parameters()),
                "tensors": sum(1 for _ in net.parameters())}
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    return _ranks_results(tmp_path_factory, "overlap_hf", hf_runs)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_real_models_overlap_with_one_hook_per_bucket_and_learn_the_order_in_one_step(
        name: str, hf: list[dict[str, Any]]) -> None:
    """GPT-2 and BERT in DDP on 2 gloo ranks, with small buckets (many sent during the backward): every
    step sends every bucket during the backward; a bucket sent too early (the first watched
    parameter guessed wrong) happens at most in the first step, which is reduced the default way, and never
    after; overlap stays on; at most one hook per bucket plus what was learned, far fewer than the
    parameters; the weights equal the default protocol's (overlap='off', itself held to the full-batch step
    elsewhere) within float32 rounding."""
    for r in hf:
        on, off = r[f"{name}/on"], r[f"{name}/off"]
        assert on["buckets"] > 4 and on["early"] == [on["buckets"]] * HF_STEPS, on
        assert not any(on["late"][1:]), on["late"]
        assert on["disabled"] is None and off["early"] == [0] * HF_STEPS
        assert on["hooked"] <= on["buckets"] + 2 < on["tensors"], on
        for key, value in off["params"].items():
            torch.testing.assert_close(on["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert all(torch.equal(hf[0][f"{name}/on"]["params"][k], hf[1][f"{name}/on"]["params"][k])
               for k in hf[0][f"{name}/on"]["params"])
    torch.manual_seed(0)
    start = dict(_hf_models()[name]().named_parameters())
    moved = [k for k, v in hf[0][f"{name}/on"]["params"].items() if not torch.equal(v, start[k])]
    assert len(moved) > len(start) // 2, moved  # the steps trained the model


# -- the protocol: the collectives of each form, in order ---------------------------------------------------
PROTOCOL_STEPS = 3


def protocol_run(rank: int, world_size: int) -> dict[str, Any]:
    """Every all-reduce each guard issues, per step: (elements, dtype, asynchronous)."""
    out: dict[str, Any] = {}
    for overlap in ("off", "on"):
        _, model, guard, sync = _guard("ddp", target_batch=TARGET, micro_batch=MICRO, overlap=overlap)
        per_step, calls = [], []
        batches = GlobalBatches(make_data(TARGET * PROTOCOL_STEPS), TARGET, seed=SEED, rank=rank, world_size=world_size)
        for rb in batches.epoch(0):
            calls.clear()
            with recording_all_reduces(calls):
                guard.step(rb.batch, mean_loss)
            per_step.append(list(calls))
        out[overlap] = {"calls": per_step, "num_params": len(guard.params), "params": _params(model),
                        "buckets": [] if sync._overlap is None else [sum(p.numel() for p in b)
                                                                     for b in sync._overlap.buckets]}
    return out


def test_each_form_issues_its_collectives_in_order(tmp_path: Path) -> None:
    """overlap='off' (the default): the cut's exchange, the flag, which gradients exist, the gradients in
    synchronous buckets, the step's scalars; nothing is sent ahead. overlap='on': the cut's exchange,
    every bucket sent ahead, then one float64 flag exchange (counts, presence bits, scalars). Both forms
    train the same weights (fp64)."""
    out = results(tmp_path, spawn(protocol_run, tmp_path)[0])
    want = reference(PROTOCOL_STEPS, TARGET * PROTOCOL_STEPS)
    for r in out:
        gather = (2 * ROW_FIELDS, "torch.int64", False)
        p = r["off"]["num_params"]
        for calls in r["off"]["calls"]:
            assert calls[:3] == [gather, (1, "torch.int64", False), (p, "torch.int32", False)], calls
            assert calls[-1] == (SCALARS, "torch.float64", False), calls
            assert calls[3:-1] and all(c[1] == "torch.float64" and not c[2] for c in calls[3:-1]), calls
            # the gradients of the parameters some rank used: all but `never` (2), and `extra` (3) where unused
            total = sum(c[0] for c in calls[3:-1])
            assert sum(r["on"]["buckets"]) - 5 <= total <= sum(r["on"]["buckets"]) - 2, calls
        for calls in r["on"]["calls"]:
            assert calls == [gather] + [(n, "torch.float64", True) for n in r["on"]["buckets"]] + \
                [(COUNTS + p + SCALARS, "torch.float64", False)], calls
        for form in ("off", "on"):
            for name, value in want.items():
                torch.testing.assert_close(r[form]["params"][name], value, **FP64, msg=f"{form} {name}")


def four_rank_run(rank: int, world_size: int) -> dict[str, Any]:
    return {overlap: _run(kind, overlap, rank, world_size) for kind in ("ddp",) for overlap in ("off", "on")}


@pytest.mark.slow
def test_four_ranks_overlapped_or_not_equal_full_batch_steps_fp64(tmp_path: Path) -> None:
    out = results(tmp_path, spawn(four_rank_run, tmp_path, world_size=4)[0])
    want = reference(EXACT_STEPS, TARGET * EXACT_STEPS)
    for rank, r in enumerate(out):
        assert r["on"]["overlapped"] == [True] * EXACT_STEPS and r["off"]["overlapped"] == [False] * EXACT_STEPS
        for form in ("off", "on"):
            for name, value in want.items():
                torch.testing.assert_close(r[form]["params"][name], value, **FP64, msg=f"rank {rank} {form} {name}")


# -- randomized OOM injection ---------------------------------------------------------------------------
PHASES = ("forward", "loss", "backward", "first backward")
INJECT_STEPS = 28


def injection_schedule(seed: int = 2026) -> list[tuple[str | None, str | None]]:
    """Per step: what fails on rank 0 and on rank 1 (None: nothing) in the first, overlapped attempt."""
    rng = random.Random(seed)
    combos: list[tuple[str | None, str | None]] = [(p, None) for p in PHASES] + [(None, p) for p in PHASES]
    combos += [(rng.choice(PHASES), rng.choice(PHASES)) for _ in range(6)]  # both ranks at once
    combos += [(None, None)] * (INJECT_STEPS - len(combos))
    rng.shuffle(combos)
    return combos


def injected_run(rank: int, world_size: int, schedule: list[tuple[str | None, str | None]]) -> dict[str, Any]:
    net, model, guard, sync = _guard("ddp", target_batch=TARGET, micro_batch=MICRO, overlap="on")
    audit = IdAudit(torch.nn.ModuleList([net.inp, net.out]))  # the layers every sample reaches (not extra, never)
    audit.watch(guard.optimizer)
    step_fn = guard.optimizer.step

    def audited_step(*args: Any, **kwargs: Any) -> Any:
        audit.step()
        return step_fn(*args, **kwargs)

    guard.optimizer.step = audited_step  # type: ignore[method-assign]
    plan: dict[str, Any] = {"fail": None, "at": 0, "calls": 0}

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y, ids = batch
        audit.forward(ids.tolist())
        plan["calls"] += 1
        fail = plan["fail"] if plan["calls"] == plan["at"] else None
        if fail == "forward":
            net.fail_forward = True
        elif fail in ("backward", "first backward"):
            net.inject.armed = 1  # this micro-batch's backward raises, mid-model
        logits = m(x)
        if fail == "loss":
            raise torch.OutOfMemoryError("injected: out of memory in the loss")
        return F.cross_entropy(logits, y)

    steps = []
    batches = GlobalBatches(make_data(TARGET * INJECT_STEPS), TARGET, seed=SEED, rank=rank, world_size=world_size)
    for rb, fails in zip(batches.epoch(0), schedule):
        # every step starts at micro 4 (2 micro-steps), so that every injection strikes an overlapped attempt
        guard.plan = autoaccum.Plan.for_target(TARGET, MICRO, world_size)
        fail = fails[rank]
        accum = guard.plan.accum_steps
        plan.update(fail=fail, calls=0, at=1 if fail == "first backward" else accum)
        stats = guard.step(rb.batch, loss_fn)
        steps.append({"attempts": stats.attempts, "overlapped": stats.overlapped, "early": sync._overlap.early,
                      "micro_steps": stats.micro_steps,
                      "changes": [(c.reason, c.where, c.old.micro_batch, c.new.micro_batch) for c in stats.changes],
                      "ids": sorted(rb.batch[2].tolist())})
    return {"params": _params(model), "steps": steps, "audit": audit.check(), "audited": audit.steps,
            "ooms": guard.ooms}


def test_randomized_oom_injection_in_overlapped_steps(tmp_path: Path) -> None:
    """28 steps with overlap='on'; in 14 of them an OOM strikes the first (overlapped) attempt on one
    rank or both, in the forward, the loss or the backward of the last micro-batch, or the first
    micro-batch's backward -- where the other rank's buckets (and, in a last backward, its own) are
    already in flight. Every rank issues the remaining buckets in order, then the flag; every rank
    replays (not overlapped) at half the micro-batch, with the same samples."""
    schedule = injection_schedule()
    codes, seconds = spawn(injected_run, tmp_path, schedule=schedule)  # bounded by the timeout: a hang fails
    out = results(tmp_path, codes)
    want = reference(INJECT_STEPS, TARGET * INJECT_STEPS)
    struck = 0
    for rank, r in enumerate(out):
        assert r["audit"] == {"steps": INJECT_STEPS, "repeated": 0, "inconsistent": 0}, r["audit"]
        for step, (s, audited) in enumerate(zip(r["steps"], r["audited"])):
            assert audited == s["ids"], (rank, step)  # exactly this rank's share of the global batch, once
            fails = schedule[step]
            injected = any(f is not None for f in fails)
            assert s["attempts"] == (2 if injected else 1), (rank, step, s)
            assert s["overlapped"] == (not injected), (rank, step, s)  # a replay is not overlapped
            assert s["micro_steps"] == (4 if injected else 2), (rank, step, s)  # the replay at micro 2
            if injected:
                struck += 1
                mine = fails[rank]
                where = {"forward": "forward/loss", "loss": "forward/loss", "backward": "backward",
                         "first backward": "backward", None: "another rank"}[mine]
                assert s["changes"][0][:2] == ("oom", where), (rank, step, s["changes"])
                if mine == "backward":  # the OOM struck with this rank's own first buckets in flight
                    assert s["early"] > 0, (rank, step, s)
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, **FP64, msg=f"rank {rank} {name}")
    assert struck == 2 * 14, struck  # every injection struck an overlapped attempt, on both ranks' records
    for name in want:
        assert torch.equal(out[0]["params"][name], out[1]["params"][name]), name


def unaligned_run(rank: int, world_size: int) -> None:
    """The mistake the order rule prevents: after an OOM in its overlapped last backward, rank 1 goes
    straight to the flag exchange without sending the buckets it has not sent yet."""
    from autoaccum.distributed import overlap as overlap_module

    cls = overlap_module._OverlappedReduce
    launch = cls._launch

    def launch_only_from_the_backward(self: Any, index: int, *, copy: bool) -> None:
        if copy or rank == 0:
            launch(self, index, copy=copy)
        else:
            self._next = len(self.buckets)  # skipped: the failing rank's remaining buckets are never sent

    cls._launch = launch_only_from_the_backward  # type: ignore[method-assign]
    net, _, guard, _ = _guard("ddp", target_batch=TARGET, micro_batch=MICRO, overlap="on")
    batches = GlobalBatches(make_data(TARGET * 2), TARGET, seed=SEED, rank=rank, world_size=world_size)
    for step, rb in enumerate(batches.epoch(0)):
        calls = 0

        def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if rank == 1 and step == 1 and calls == 2:
                net.inject.armed = 1  # the last micro-batch's backward of step 2
            return mean_loss(m, batch)

        guard.step(rb.batch, loss_fn)


def test_negative_control_unaligned_buckets_break_the_ranks(tmp_path: Path) -> None:
    """Without the remaining buckets before the flag, rank 1's flag exchange meets rank 0's next
    bucket all-reduce: the run does not end well (an error or a hang, bounded here)."""
    codes, _ = spawn(unaligned_run, tmp_path, timeout_s=40, allow_hang=True)
    assert codes != [0, 0], "the unaligned protocol survived: the injection is not where the hazard is"


# -- in one process -----------------------------------------------------------------------------------
def test_bad_overlap_value_is_refused_and_one_process_never_overlaps() -> None:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="overlap.*sometimes.*off.*on"):
        autoaccum.OOMGuard(net, opt, target_batch=TARGET, micro_batch=MICRO, overlap="sometimes")  # type: ignore[arg-type]
    for retired in ("yes", "auto"):  # "auto" chose the overlap by memory; the default is now "off"
        with pytest.raises(ValueError, match="overlap"):
            autoaccum.fit(net, make_data(TARGET), target_batch=TARGET, optimizer=opt, overlap=retired, progress=False)
    guard = autoaccum.OOMGuard(net, opt, target_batch=TARGET, micro_batch=MICRO, overlap="on")
    stats = guard.step(make_data(TARGET), mean_loss)
    assert not stats.overlapped and guard.overlapped_steps == 0  # one process: nothing to all-reduce
