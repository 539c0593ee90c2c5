"""autoaccum.plan.cut: every rank runs the same number of micro-steps, and the shares cover the target.

Ranks that run different numbers of micro-steps deadlock FSDP's collectives (DESIGN.md, Scale), so
the count is checked over targets 1..512, world sizes 1..8 and micro-batches 1..64, by both rules
that produce it: the plan (``Plan.micro_sizes``) and the cutter the guard uses
(``step_micro_sizes``). The same case on real ranks, with FSDP2: ``tests/distributed/test_distributed.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoaccum.plan.cut import step_micro_sizes
from autoaccum.plan.plan import Plan

#: (rank_sizes, rank, micro_batch) -> that rank's micro-batch sizes in one step
CutSizes = Callable[[Sequence[int], int, int], Sequence[int]]


def old_guard_cut(rank_sizes: Sequence[int], rank: int, micro_batch: int) -> list[int]:
    """The guard's cutter before ``autoaccum.plan.cut``: each rank cut its own share, blind to the others'."""
    n = rank_sizes[rank]
    return [min(micro_batch, n - i) for i in range(0, n, micro_batch)]


def check_cut(cut: CutSizes, target: int, world: int, micro: int) -> list[tuple[int, ...]]:
    """Every rank's sizes under ``cut``: one count on all ranks, each micro-batch <= micro, sums = shares = target."""
    plan = Plan.for_target(target, micro, world)
    rank_sizes = [plan.rank_batch(r) for r in range(world)]
    # what the guard gives its cutter: every rank's count, and the plan's micro-batch
    sizes = [tuple(cut(rank_sizes, r, plan.micro_batch)) for r in range(world)]
    case = f"target {target}, world {world}, micro {micro}: {sizes}"
    assert len({len(s) for s in sizes}) == 1, f"ranks run different numbers of micro-steps; {case}"
    assert all(0 <= size <= micro for s in sizes for size in s), case
    assert [sum(s) for s in sizes] == rank_sizes, case
    assert sum(rank_sizes) == target, case
    return sizes


def check_same_micro_steps(target: int, world: int, micro: int) -> None:
    """The cutter and the plan agree: the same sizes on every rank, ``accum_steps`` of them."""
    plan = Plan.for_target(target, micro, world)
    by_cut = check_cut(step_micro_sizes, target, world, micro)
    by_plan = [plan.micro_sizes(r) for r in range(world)]
    assert by_cut == by_plan, (target, world, micro)
    assert len(by_plan[0]) == plan.accum_steps


def test_every_rank_runs_the_same_micro_steps_exhaustive_up_to_target_128():
    # every combination up to target 128 (about 2 s); the whole range up to 512 exhaustively takes
    # about 9 s on the 2-core test machine, so above 128 the property test below samples it
    for target in range(1, 129):
        for world in range(1, min(8, target) + 1):  # target < world is rejected (tests/plan/test_plan.py)
            for micro in range(1, 65):
                check_same_micro_steps(target, world, micro)


@settings(max_examples=1500, deadline=None)
@given(target=st.integers(1, 512), world=st.integers(1, 8), micro=st.integers(1, 64))
def test_every_rank_runs_the_same_micro_steps(target, world, micro):
    if world <= target:
        check_same_micro_steps(target, world, micro)


def test_negative_control_the_old_per_rank_cut_gives_ranks_different_counts():
    # target 9 on 2 ranks: shares 5 and 4; micro 1: rank 0 runs 5 micro-steps, rank 1 only 4 (the
    # FSDP deadlock); the cutter gives rank 1 a fifth, empty micro-step
    assert [len(s) for s in (old_guard_cut([5, 4], r, 1) for r in range(2))] == [5, 4]
    with pytest.raises(AssertionError, match="different numbers of micro-steps"):
        check_cut(old_guard_cut, 9, 2, 1)
    assert check_cut(step_micro_sizes, 9, 2, 1) == [(1, 1, 1, 1, 1), (1, 1, 1, 1, 0)]
    # where the shares are equal, the old cut passed: only the count check tells the two apart
    assert check_cut(old_guard_cut, 8, 2, 1) == check_cut(step_micro_sizes, 8, 2, 1)
