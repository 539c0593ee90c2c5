"""The cut's exchange (``autoaccum.distributed.sync``): one all-reduce per attempt, waited for before any
micro-batch runs.

- the decision, as a pure function: the terms every rank runs with, items counted on some ranks only
  (or no item at all) an error, the thrashing ranks named;
- on two gloo ranks: a last batch whose shares differ (rank 0 full, rank 1 partial)
  is weighted by the samples of every rank, exactly as one process's full-batch steps in fp64, with one
  waited-for exchange per attempt (an OOM replay: one more), also with an OOM in the partial step.
  Negative control: each rank taking its own share for every rank's trains on wrong weights;
- a model that runs a collective in its own forward stays exact: no rank runs a forward another skips;
- a loss that counts items on one rank only raises the same ``TaskError`` on both ranks, with no hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _spawn import errors, results, spawn
from helpers import needs_gloo

import autoaccum
from autoaccum.distributed import DistributedSync, unwrap_model, wrap_model
from autoaccum.distributed import sync as cut_agreement
from autoaccum.distributed.sync import CutTerms, decide

FP64 = {"rtol": 1e-10, "atol": 1e-12}
TARGET, MICRO, SEED = 12, 2, 5
ROW_FIELDS = 5  # samples, micro-steps, items, counted, thrash


# -- the decision ---------------------------------------------------------------------------------------
def _row(n: int, steps: int, items: int | None = None, thrash: bool = False) -> tuple[int, ...]:
    return (n, steps, items or 0, int(items is not None), int(thrash))


def test_the_terms_add_every_ranks_samples_and_take_the_most_micro_steps() -> None:
    agreed = decide((_row(6, 3), _row(4, 2)))  # rank 1: a partial share
    assert agreed == cut_agreement.Agreed(CutTerms(10, 3, None), error=None)


def test_the_ranks_whose_allocator_thrashed_are_named_and_change_nothing_else() -> None:
    calm = decide((_row(6, 3), _row(6, 3)))
    said = decide((_row(6, 3), _row(6, 3, thrash=True)))
    assert calm.thrashing == () and said.thrashing == (1,)
    assert (said.terms, said.error) == (calm.terms, calm.error)
    assert decide((_row(6, 3, thrash=True), _row(4, 2, thrash=True))).thrashing == (0, 1)


def test_items_counted_on_some_ranks_only_or_none_at_all_is_an_error() -> None:
    mixed = decide((_row(6, 3, items=40), _row(6, 3)))
    assert isinstance(mixed.error, autoaccum.TaskError) and "some ranks" in str(mixed.error)
    empty = decide((_row(6, 3, items=0), _row(6, 3, items=0)))
    assert isinstance(empty.error, autoaccum.TaskError) and "no item" in str(empty.error)
    assert decide((_row(6, 3, items=40), _row(6, 3, items=2))).terms.num_items == 42


# -- two ranks --------------------------------------------------------------------------------------------
def make_net() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def mean_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _shares(n: int, world_size: int) -> list[slice]:
    """Rank shares of a global batch of ``n``, as GlobalBatches cuts them (the first ranks one more)."""
    base, extra = divmod(n, world_size)
    bounds = [0]
    for r in range(world_size):
        bounds.append(bounds[-1] + base + (r < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


# global batches: 2 full, then a last one of 8
SIZES = (TARGET, TARGET, 8)


def reference(sizes: tuple[int, ...] = SIZES) -> dict[str, torch.Tensor]:
    """One process, one full-batch SGD step per global batch, fp64."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    x, y = make_data(sum(sizes))
    start = 0
    for size in sizes:
        opt.zero_grad(set_to_none=True)
        mean_loss(model, (x[start:start + size], y[start:start + size])).backward()
        opt.step()
        start += size
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class ForwardCollective(torch.nn.Module):
    """The identity, with an all-reduce of the batch's mean in every training forward (as a
    synchronised norm of one's own would run): a collective inside the accumulation window."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            mean = x.detach().mean(0)
            dist.all_reduce(mean)
        return x


def mixed_partial_run(rank: int, world_size: int, kind: str, check: bool = True,
                      forward_collective: bool = False, oom_last: bool = False,
                      bucket_bytes: int | None = None) -> dict[str, Any]:
    """The last batch is partial: rank 0 holds a full share of it (6), rank 1 the rest. ``check=False``:
    each rank takes its own row for every rank's (the weights' denominator is then wrong on the
    partial step). ``oom_last``: rank 0's first micro-batch of the last batch runs out of memory
    (once). ``bucket_bytes``: the sync's bucket size (small: several buckets). ``forward_collective``:
    an all-reduce in every forward; the last batch is then 11 (shares 6 and 5: three micro-steps with
    a forward on both ranks, as a forward collective needs -- an empty micro-step runs no forward)."""
    sizes = (TARGET, TARGET, 11) if forward_collective else SIZES
    net = make_net()
    if forward_collective:
        net.append(ForwardCollective())  # last: no parameter, the names stay the reference's
    model = wrap_model(net) if kind == "ddp" else net
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    sync = DistributedSync(model, **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
    guard = autoaccum.OOMGuard(model, opt, target_batch=TARGET, micro_batch=MICRO, sync=sync)
    calls: list[bool] = []
    original, gather = dist.all_reduce, sync.gather

    def recording(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if tensor.dtype == torch.int64 and tensor.numel() == ROW_FIELDS * world_size:
            calls.append(async_op)  # the cut's exchange: never sent ahead
        return original(tensor, *args, async_op=async_op, **kwargs)

    def own_row_only(values: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        gather(values)  # the exchange still runs (every rank issues it), its answer ignored
        return (tuple(values),) * world_size

    x, y = make_data(sum(sizes))
    armed = {"oom": False}

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        if armed["oom"]:
            armed["oom"] = False
            raise torch.OutOfMemoryError("injected: out of memory in the loss")
        return mean_loss(m, batch)

    dist.all_reduce = recording  # type: ignore[assignment]
    if not check:
        sync.gather = own_row_only  # type: ignore[method-assign]
    attempts, exchanges, losses = [], [], []
    try:
        start = 0
        for size in sizes:
            # the last batch: rank 0 holds its full share (6), rank 1 the rest
            mine = _shares(size, world_size)[rank] if size == TARGET else [slice(0, 6), slice(6, size)][rank]
            part = (x[start:start + size][mine], y[start:start + size][mine])
            calls.clear()
            armed["oom"] = oom_last and rank == 0 and size < TARGET
            stats = guard.step(part, loss_fn, partial=size < TARGET)
            attempts.append(stats.attempts)
            exchanges.append(list(calls))
            losses.append(stats.loss)
            start += size
    finally:
        dist.all_reduce = original  # type: ignore[assignment]
    return {"params": {n: p.detach().clone() for n, p in unwrap_model(model).named_parameters()},
            "attempts": attempts, "exchanges": exchanges, "losses": losses, "ooms": guard.ooms}


pytestmark_dist = needs_gloo


@pytestmark_dist
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "bucket_bytes"), [("ddp", None), ("plain", None), ("plain", 64)])
def test_uneven_shares_are_weighted_by_every_ranks_samples(kind: str, bucket_bytes: int | None,
                                                          tmp_path: Path) -> None:
    out = results(tmp_path, spawn(mixed_partial_run, tmp_path, kind=kind, bucket_bytes=bucket_bytes)[0])
    want = reference()
    for rank, r in enumerate(out):
        assert r["exchanges"] == [[False]] * 3, r["exchanges"]  # one exchange a step, waited for
        assert r["attempts"] == [1, 1, 1], r
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, **FP64, msg=f"rank {rank} {name}")
    assert out[0]["losses"] == out[1]["losses"]


@pytestmark_dist
@pytest.mark.slow
def test_an_oom_in_the_partial_step_is_replayed_exactly_on_every_rank(tmp_path: Path) -> None:
    out = results(tmp_path, spawn(mixed_partial_run, tmp_path, kind="ddp", oom_last=True)[0])
    want = reference()
    for rank, r in enumerate(out):
        assert r["exchanges"] == [[False], [False], [False, False]], r["exchanges"]  # the replay's own exchange
        assert r["attempts"] == [1, 1, 2] and r["ooms"] == 1, (r["attempts"], r["ooms"])
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, **FP64, msg=f"rank {rank} {name}")


@pytestmark_dist
@pytest.mark.slow
def test_negative_control_each_rank_taking_its_own_share_for_all_trains_on_wrong_weights(tmp_path: Path) -> None:
    out = results(tmp_path, spawn(mixed_partial_run, tmp_path, kind="ddp", check=False)[0])
    want = reference()
    for r in out:
        assert r["attempts"] == [1, 1, 1]
        assert not torch.allclose(r["params"]["2.weight"], want["2.weight"], rtol=1e-6, atol=1e-9)


@pytestmark_dist
@pytest.mark.slow
def test_a_model_that_synchronises_in_forward_stays_exact(tmp_path: Path) -> None:
    """Every rank waits for the exchange before its micro-batches, so every rank runs the same forwards
    (and their collectives) in the same order, with a partial last batch."""
    out = results(tmp_path, spawn(mixed_partial_run, tmp_path, kind="ddp", forward_collective=True)[0])
    want = reference((TARGET, TARGET, 11))
    for rank, r in enumerate(out):
        assert r["exchanges"] == [[False]] * 3 and r["attempts"] == [1, 1, 1], r
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, **FP64, msg=f"rank {rank} {name}")


class CountsOnRankZero:
    """A loss whose ``count_items`` counts on rank 0 only (the mistake the exchange catches)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def count_items(self, model: torch.nn.Module, batch: Any) -> int | None:
        return len(batch[1]) if self.rank == 0 else None

    def __call__(self, model: torch.nn.Module, batch: Any, num_items_in_batch: int | None = None) -> torch.Tensor:
        loss = F.cross_entropy(model(batch[0]), batch[1], reduction="sum")
        return loss / num_items_in_batch if num_items_in_batch is not None else loss / len(batch[1])


def items_on_one_rank_run(rank: int, world_size: int) -> None:
    model = wrap_model(make_net())
    guard = autoaccum.OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=TARGET,
                               micro_batch=MICRO, sync=DistributedSync(model))
    x, y = make_data(TARGET)
    mine = _shares(TARGET, world_size)[rank]
    before = [p.detach().clone() for p in model.parameters()]
    try:
        guard.step((x[mine], y[mine]), CountsOnRankZero(rank))
    except autoaccum.TaskError:
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was stepped
        assert all(p.grad is None for p in model.parameters())
        raise


@pytestmark_dist
@pytest.mark.slow
def test_items_counted_on_one_rank_only_is_the_same_error_on_both_ranks(tmp_path: Path) -> None:
    codes, _ = spawn(items_on_one_rank_run, tmp_path)
    errs = errors(tmp_path)
    assert all(e is not None and e.startswith("TaskError") and "some ranks" in e for e in errs), errs
    assert codes == [1, 1], codes  # both ranks raised; neither hung
