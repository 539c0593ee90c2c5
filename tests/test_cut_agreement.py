"""The cut's exchange (``autoaccum.cut_agreement``): one all-reduce per attempt, waited on before the
last micro-batch where a rank can tell its answer alone (a *guess*).

- the decision, as a pure function: a wrong guess voids the attempt on every rank; items counted on
  some ranks only, or no item at all, is an error; a void attempt never overlaps;
- on two gloo ranks: full steps are guessed (the exchange is sent asynchronously) and exact; a rank
  that guesses while the other rank's share is partial (``partial`` passed differently on the two
  ranks) voids the attempt, and the replay is exact, equal to one process's full-batch steps in
  fp64 (a voided attempt is counted apart, not as an OOM replay). Negative control: with the check for
  a wrong guess switched off, the same run trains on wrong weights (the comparison fails); a loss
  that counts items on one rank only raises the same ``TaskError`` on both ranks, with no hang;
- a model that synchronises in forward (``forward_collectives=True``; ``SyncBatchNorm`` and DDP's
  first buffer broadcast are detected) never guesses: the same mixed-partial run waits for every
  answer first and stays exact, where guessing would run forwards (and their collectives) that the
  other rank skips;
- a failed wait of the exchange sent ahead raises that error again when read again.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoaccum
from _spawn import errors, results, spawn
from autoaccum import cut_agreement
from autoaccum.cut import SampleCut, TokenCut
from autoaccum.cut_agreement import CutTerms, _decide, full_step_terms
from autoaccum.distributed import DistributedSync, unwrap_model, wrap_model
from autoaccum.plan import Plan
from autoaccum.sync import CUT_FIELDS

FP64 = {"rtol": 1e-10, "atol": 1e-12}
TARGET, MICRO, SEED = 12, 2, 5


# -- the decision ---------------------------------------------------------------------------------------
def _row(n: int, steps: int, vote: int = 1, items: int | None = None,
         guess: CutTerms | None = None, sat_out: bool = False, thrash: bool = False) -> tuple[int, ...]:
    return (n, steps, vote, items or 0, int(items is not None), guess.num_samples if guess else 0,
            guess.steps if guess else 0, int(sat_out), int(thrash))


def test_full_step_terms_are_what_every_rank_runs() -> None:
    plan = Plan.for_target(13, 2, world_size=2)  # shares 7 and 6: 4 micro-steps on both
    assert full_step_terms(SampleCut(), plan, 2) == CutTerms(13, 4, None)
    assert full_step_terms(TokenCut(), plan, 2) is None  # a token cut depends on the data


def test_a_right_guess_stands_and_overlaps_where_every_rank_voted() -> None:
    guess = CutTerms(12, 3, None)
    agreed = _decide((_row(6, 3, guess=guess), _row(6, 3, guess=guess)))
    assert agreed == cut_agreement.Agreed(guess, overlap=True, void=False, error=None)
    assert not _decide((_row(6, 3, guess=guess), _row(6, 3, vote=0, guess=guess))).overlap


def test_a_wrong_guess_voids_the_attempt_on_every_rank_and_never_overlaps() -> None:
    guess = CutTerms(12, 3, None)
    agreed = _decide((_row(6, 3, guess=guess), _row(4, 2)))  # rank 1: a partial share
    assert agreed.void and not agreed.overlap and agreed.error is None
    assert agreed.terms == CutTerms(10, 3, None)
    # nobody guessed: the same answer stands (the ranks waited for it)
    assert not _decide((_row(6, 3), _row(4, 2))).void
    # ranks whose plans differ (a sync that does not agree on plans) guess differently: the rows
    # say which guess was wrong, the same on every rank
    assert _decide((_row(6, 3, guess=guess), _row(6, 2, guess=CutTerms(12, 2, None)))).void
    # a rank that sat a chained attempt out voids it, even where every guess was right
    assert _decide((_row(6, 3, guess=guess), _row(6, 3, guess=guess, sat_out=True))).void
    assert not _decide((_row(6, 3, guess=guess), _row(6, 3, guess=guess, sat_out=True))).overlap


def test_the_ranks_whose_allocator_thrashed_are_named_and_change_nothing_else() -> None:
    guess = CutTerms(12, 3, None)
    calm = _decide((_row(6, 3, guess=guess), _row(6, 3, guess=guess)))
    said = _decide((_row(6, 3, guess=guess), _row(6, 3, guess=guess, thrash=True)))
    assert calm.thrashing == () and said.thrashing == (1,)
    assert (said.terms, said.overlap, said.void, said.error) == (calm.terms, calm.overlap, calm.void, calm.error)
    assert _decide((_row(6, 3, thrash=True), _row(4, 2, thrash=True))).thrashing == (0, 1)


def test_items_counted_on_some_ranks_only_or_none_at_all_is_an_error() -> None:
    mixed = _decide((_row(6, 3, items=40), _row(6, 3)))
    assert isinstance(mixed.error, autoaccum.TaskError) and "some ranks" in str(mixed.error)
    assert not mixed.overlap
    empty = _decide((_row(6, 3, items=0), _row(6, 3, items=0)))
    assert isinstance(empty.error, autoaccum.TaskError) and "no item" in str(empty.error)
    assert _decide((_row(6, 3, items=40), _row(6, 3, items=2))).terms.num_items == 42


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


def mixed_partial_run(rank: int, world_size: int, kind: str, check: bool,
                      forward_collective: bool = False, chain: bool = True, oom_last: bool = False,
                      bucket_bytes: int | None = None) -> dict[str, Any]:
    """The last batch is partial; rank 0's share of it is full and it passes partial=False (so it
    guesses), rank 1 passes partial=True. ``check=False``: the check for a wrong guess switched off.
    ``chain=False``: no step is chained (every step has its exchange: the guessing path itself).
    ``oom_last``: rank 0's first micro-batch of the last batch runs out of memory (once).
    ``bucket_bytes``: the sync's bucket size (small: several buckets, sent from the last backward).
    ``forward_collective``: an all-reduce in every forward, declared to ``DistributedSync``; the last
    batch is then 11 (shares 6 and 5: three micro-steps with a forward on both ranks, as a forward
    collective needs -- an empty micro-step runs no forward)."""
    sizes = (TARGET, TARGET, 11) if forward_collective else SIZES
    net = make_net()
    if forward_collective:
        net.append(ForwardCollective())  # last: no parameter, the names stay the reference's
    model = wrap_model(net) if kind == "ddp" else net
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    sync = DistributedSync(model, forward_collectives=forward_collective,
                           **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
    guard = autoaccum.OOMGuard(model, opt, target_batch=TARGET, micro_batch=MICRO, sync=sync)
    calls: list[bool] = []
    original, decide = dist.all_reduce, cut_agreement._decide

    def recording(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if tensor.dtype == torch.int64 and tensor.numel() == CUT_FIELDS * world_size:
            calls.append(async_op)  # the cut's exchange: sent asynchronously where this rank guessed
        return original(tensor, *args, async_op=async_op, **kwargs)

    def unchecked(rows: Any) -> Any:  # a guess is taken at its word: never void
        agreed = decide(rows)
        guessed = [r for r in rows if r[5]]
        terms = CutTerms(guessed[0][5], guessed[0][6], None) if guessed else agreed.terms
        return cut_agreement.Agreed(terms, agreed.overlap, False, agreed.error)

    x, y = make_data(sum(sizes))
    armed = {"oom": False}

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        if armed["oom"]:
            armed["oom"] = False
            raise torch.OutOfMemoryError("injected: out of memory in the loss")
        return mean_loss(m, batch)

    dist.all_reduce = recording  # type: ignore[assignment]
    if not check:
        cut_agreement._decide = unchecked  # type: ignore[assignment]
    attempts, exchanges, losses, voided = [], [], [], []
    try:
        start = 0
        for size in sizes:
            # the last batch: rank 0 holds its full share (6), rank 1 the rest
            mine = _shares(size, world_size)[rank] if size == TARGET else [slice(0, 6), slice(6, size)][rank]
            part = (x[start:start + size][mine], y[start:start + size][mine])
            partial = size < TARGET and rank == 1
            calls.clear()
            if not chain:
                guard._chain = False  # what the last step's flag agreed, overruled alike on both ranks
            armed["oom"] = oom_last and rank == 0 and size < TARGET
            stats = guard.step(part, loss_fn, partial=partial)
            attempts.append(stats.attempts)
            voided.append(guard.voided_attempts)
            exchanges.append(list(calls))
            losses.append(stats.loss)
            start += size
    finally:
        dist.all_reduce = original  # type: ignore[assignment]
        cut_agreement._decide = decide  # type: ignore[assignment]
    return {"params": {n: p.detach().clone() for n, p in unwrap_model(model).named_parameters()},
            "attempts": attempts, "exchanges": exchanges, "losses": losses, "voided": voided,
            "quiet": sync.quiet_window, "ooms": guard.ooms}


pytestmark_dist = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                     reason="needs torch.distributed with gloo")


@pytestmark_dist
@pytest.mark.parametrize("kind", ["ddp", "plain"])
def test_a_wrong_guess_is_replayed_exactly_on_every_rank(kind: str, tmp_path: Path) -> None:
    out = results(tmp_path, spawn(mixed_partial_run, tmp_path, kind=kind, check=True, chain=False)[0])
    want = reference()
    for rank, r in enumerate(out):
        # full steps: guessed by both ranks (asynchronous exchange), one attempt each
        assert r["exchanges"][:2] == [[True], [True]], r["exchanges"]
        # the partial step: rank 0 guessed, rank 1 waited; the answer voided the attempt on both ranks,
        # and the replay waited for its answer first
        assert r["exchanges"][2] == ([True, False] if rank == 0 else [False, False]), r["exchanges"]
        # the void is counted apart: not an OOM replay (attempts), which would hold the overlap back
        assert r["attempts"] == [1, 1, 1] and r["voided"] == [0, 0, 1], (r["attempts"], r["voided"])
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, **FP64, msg=f"rank {rank} {name}")
    assert out[0]["losses"] == out[1]["losses"]


@pytestmark_dist
@pytest.mark.parametrize(("kind", "bucket_bytes"), [("ddp", None), ("plain", None), ("ddp", 64)])
def test_a_chained_step_a_rank_cannot_guess_is_sat_out_and_run_again(kind: str, bucket_bytes: int | None,
                                                                     tmp_path: Path) -> None:
    """Chained (the default): the first step's exchange is sent ahead, the second has none (its rows
    ride in its flag), and in the third, which rank 1 cannot guess (its share is partial), rank 1
    sits out: the attempt is void on both ranks and run again, waiting for the exchange first. With
    64-byte buckets (one per parameter) rank 0 sends its first buckets from its last backward while
    rank 1, running nothing, sends zeros in all of them at once: the same collectives in order."""
    out = results(tmp_path, spawn(mixed_partial_run, tmp_path, kind=kind, check=True, bucket_bytes=bucket_bytes)[0])
    want = reference()
    for rank, r in enumerate(out):
        assert r["exchanges"] == [[True], [], [False]], r["exchanges"]
        assert r["attempts"] == [1, 1, 1] and r["voided"] == [0, 0, 1], (r["attempts"], r["voided"])
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, **FP64, msg=f"rank {rank} {name}")
    assert out[0]["losses"] == out[1]["losses"]


@pytestmark_dist
def test_an_oom_in_a_chained_attempt_another_rank_sat_out_is_an_oom_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 sits the chained last step out (partial share) while rank 0 runs out of memory in it:
    the attempt is void and failed at once. The OOM is what every rank acts on (a shrink and a replay,
    waiting for the exchange), not a rerun at the same size that would run out of memory again."""
    out = results(tmp_path, spawn(mixed_partial_run, tmp_path, kind="ddp", check=True, oom_last=True)[0])
    want = reference()
    for rank, r in enumerate(out):
        assert r["exchanges"] == [[True], [], [False]], r["exchanges"]
        assert r["attempts"] == [1, 1, 2] and r["voided"] == [0, 0, 0] and r["ooms"] == 1, \
            (r["attempts"], r["voided"], r["ooms"])
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, **FP64, msg=f"rank {rank} {name}")


@pytestmark_dist
def test_negative_control_an_unchecked_wrong_guess_trains_on_wrong_weights(tmp_path: Path) -> None:
    out = results(tmp_path, spawn(mixed_partial_run, tmp_path, kind="ddp", check=False, chain=False)[0])
    want = reference()
    for r in out:
        assert r["attempts"] == [1, 1, 1] and r["voided"] == [0, 0, 0]
        assert not torch.allclose(r["params"]["2.weight"], want["2.weight"], rtol=1e-6, atol=1e-9)


@pytestmark_dist
def test_a_model_that_synchronises_in_forward_never_guesses(tmp_path: Path) -> None:
    # Without the declaration the same run breaks: rank 0 guesses, runs two forwards (two all-reduces)
    # that rank 1, waiting, does not, and gloo fails with a mismatched collective (checked by hand on
    # 2026-11-25; not a test here, as a broken collective costs a process group's timeout)
    out = results(tmp_path, spawn(mixed_partial_run, tmp_path, kind="ddp", check=True, forward_collective=True)[0])
    want = reference((TARGET, TARGET, 11))
    for rank, r in enumerate(out):
        assert not r["quiet"]
        # every exchange waited for (never sent ahead), so no rank runs a forward the other skips
        assert r["exchanges"] == [[False], [False], [False]], r["exchanges"]
        assert r["attempts"] == [1, 1, 1] and r["voided"] == [0, 0, 0], (r["attempts"], r["voided"])
        for name, p in want.items():
            torch.testing.assert_close(r["params"][name], p, **FP64, msg=f"rank {rank} {name}")


def quiet_window_run(rank: int, world_size: int) -> dict[str, bool]:
    """``quiet_window`` for DDP models with buffers (broadcast before the first synchronised forward)."""
    torch.manual_seed(0)
    bn = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)).double()
    model = wrap_model(bn)  # broadcast_buffers=True, DDP's default
    sync = DistributedSync(model)
    fresh = sync.quiet_window
    guard = autoaccum.OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=TARGET,
                               micro_batch=MICRO, sync=sync)
    x, y = make_data(TARGET)
    guard.step((x[_shares(TARGET, world_size)[rank]], y[_shares(TARGET, world_size)[rank]]), mean_loss)
    after = sync.quiet_window
    plain = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8))
    unbroadcast = DistributedSync(wrap_model(plain, broadcast_buffers=False)).quiet_window
    with pytest.warns(UserWarning, match="SyncBatchNorm"):
        sync_bn = DistributedSync(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.SyncBatchNorm(8)))
    return {"fresh": fresh, "after": after, "unbroadcast": unbroadcast, "sync_bn": sync_bn.quiet_window,
            "declared": DistributedSync(make_net(), forward_collectives=True).quiet_window,
            "plain": DistributedSync(make_net()).quiet_window}


@pytestmark_dist
def test_quiet_window_sees_collectives_in_forward(tmp_path: Path) -> None:
    for r in results(tmp_path, spawn(quiet_window_run, tmp_path)[0]):
        # DDP broadcasts buffers in the forward after a synchronised one (and the first ever); the guard's
        # forwards run under no_sync, so from its first step on the window is quiet
        assert r == {"fresh": False, "after": True, "unbroadcast": True, "sync_bn": False, "declared": False,
                     "plain": True}, r


def test_a_failed_wait_is_raised_again_when_read_again() -> None:
    from autoaccum.distributed.process_group import _PendingAllReduce

    class Broken:
        def wait(self) -> None:
            raise RuntimeError("gloo: connection closed by peer")

    pending = object.__new__(_PendingAllReduce)  # the state __init__ leaves, with a work whose wait fails
    pending._origin, pending._tensor = torch.device("cpu"), torch.zeros(2)
    pending._stack, pending._work, pending._result, pending._error = contextlib.ExitStack(), Broken(), None, None
    for _ in range(2):
        with pytest.raises(RuntimeError, match="connection closed by peer"):
            pending.result()


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
def test_items_counted_on_one_rank_only_is_the_same_error_on_both_ranks(tmp_path: Path) -> None:
    codes, _ = spawn(items_on_one_rank_run, tmp_path)
    errs = errors(tmp_path)
    assert all(e is not None and e.startswith("TaskError") and "some ranks" in e for e in errs), errs
    assert codes == [1, 1], codes  # both ranks raised; neither hung
