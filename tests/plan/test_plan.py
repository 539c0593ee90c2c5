"""autoaccum.plan: the target global batch is covered exactly (invariant 1)."""

import dataclasses
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoaccum.plan.plan import Plan, TokenBudget


def check_covers_target(plan: Plan, requested_micro: int) -> None:
    """Every property of an exact plan, checked on every rank."""
    assert 1 <= plan.micro_batch <= requested_micro
    total = 0
    shares = []
    for rank in range(plan.world_size):
        sizes = plan.micro_sizes(rank)
        assert len(sizes) == plan.accum_steps
        assert all(0 <= s <= plan.micro_batch for s in sizes)
        assert sum(sizes) == plan.rank_batch(rank)
        # spread evenly: the non-empty micro-batches differ by at most one (larger first), empty ones last
        filled = [s for s in sizes if s > 0]
        assert list(sizes) == filled + [0] * (len(sizes) - len(filled))
        assert filled == sorted(filled, reverse=True) and (not filled or filled[0] - filled[-1] <= 1)
        shares.append(plan.rank_batch(rank))
        total += sum(sizes)
    assert total == plan.target_batch
    assert max(shares) - min(shares) <= 1  # the target split as evenly as it goes
    assert plan.micro_sizes(0)[-1] >= 1  # rank 0 (the largest share) never runs an empty micro-step
    assert max(plan.micro_sizes(0)) == plan.micro_batch  # the plan names the largest micro-batch it cuts
    # the fewest micro-steps for this micro-batch: one fewer would not hold rank 0's share
    assert (plan.accum_steps - 1) * plan.micro_batch < plan.rank_batch(0) <= plan.accum_steps * plan.micro_batch


def check_plan_family(target: int, world: int, micro: int) -> None:
    plan = Plan.for_target(target, micro, world)
    assert (plan.target_batch, plan.world_size) == (target, world)
    check_covers_target(plan, micro)

    assert Plan.balanced(target, micro, world) == plan  # every plan is balanced now

    if plan.micro_batch > 1:
        halved = plan.halved()
        assert halved.target_batch == target and halved.world_size == world
        assert halved.micro_batch <= plan.micro_batch // 2
        check_covers_target(halved, plan.micro_batch // 2)


@settings(max_examples=600, deadline=None)
@given(target=st.integers(1, 1024), world=st.integers(1, 8), micro=st.integers(1, 1100))
def test_plans_cover_the_target_exactly(target, world, micro):
    if target < world:
        with pytest.raises(ValueError, match="smaller than world_size"):
            Plan.for_target(target, micro, world)
        return
    check_plan_family(target, world, micro)


def test_plans_cover_the_target_exactly_exhaustive_small():
    for target in range(1, 65):
        for world in range(1, 9):
            if target < world:
                continue
            for micro in range(1, 70):
                check_plan_family(target, world, micro)


def test_plans_cover_the_target_exactly_for_every_target_and_world_at_edge_micro_sizes():
    for target in range(1, 1025):
        for world in range(1, min(8, target) + 1):
            share = math.ceil(target / world)
            for micro in {share, share + 1, max(1, share - 1), max(1, share // 2), max(1, share // 3) + 1}:
                check_plan_family(target, world, micro)


def test_halving_down_to_one_keeps_the_target():
    plan = Plan.for_target(1000, 1000, 8)
    micros = [plan.micro_batch]
    while plan.micro_batch > 1:
        plan = plan.halved()
        micros.append(plan.micro_batch)
        assert sum(sum(plan.micro_sizes(r)) for r in range(8)) == 1000
    # each halving, then balanced over the micro-steps it takes: 125 -> 62 needs 3 steps -> 42 each
    assert micros == [125, 42, 21, 10, 5, 2, 1]
    with pytest.raises(ValueError, match="micro-batch of 1 cannot be halved"):
        plan.halved()


def test_known_plans():
    plan = Plan.for_target(256, 48)  # 6 micro-steps for 256: spread as 43 x 4 + 42 x 2, not 48 x 5 + 16
    assert (plan.micro_batch, plan.accum_steps, plan.last_micro_batch) == (43, 6, 42)
    assert plan.micro_sizes() == (43, 43, 43, 43, 42, 42)
    assert plan.describe() == "batch 256 = 43 x 4 + 42 x 2 (6 micro-batches)"
    # the GPT-2 plan of issue 11: 64 in 10 micro-steps is 7 x 4 + 6 x 6, not 7 x 9 + 1
    assert Plan.for_target(64, 7).micro_sizes() == (7,) * 4 + (6,) * 6
    assert Plan.for_target(256, 64).describe() == "batch 256 = 64 x 4 (4 micro-batches)"
    assert Plan.for_target(256, 1000) == Plan(256, 1, 1, 256)  # capped at the rank share

    # the docstring's example: same number of passes, a lower peak
    assert Plan.balanced(256, 200) == Plan(128, 2, 1, 256)
    assert Plan.balanced(256, 48) == Plan(43, 6, 1, 256)

    # 10 samples over 3 ranks: shares 4, 3, 3; micro 3 -> two micro-steps on every rank, 2 + 2 on
    # rank 0 and 2 + 1 on ranks 1 and 2
    plan = Plan.for_target(10, 3, 3)
    assert [plan.rank_batch(r) for r in range(3)] == [4, 3, 3]
    assert plan.micro_batch == 2
    assert [plan.micro_sizes(r) for r in range(3)] == [(2, 2), (2, 1), (2, 1)]
    # 9 over 2 ranks at micro 1: 5 micro-steps on both ranks, rank 1's last one empty
    plan = Plan.for_target(9, 1, 2)
    assert [plan.micro_sizes(r) for r in range(2)] == [(1,) * 5, (1,) * 4 + (0,)]


def _sum(expression: str) -> int:
    """The value of a label's arithmetic: ``37 x 4 + 36 x 3``, ``(10 + 9 x 6) per rank x 2 ranks``, ``(2 x 2) on
    rank 0 + ...`` (read as written: parentheses first, then x, then +)."""
    text = re.sub(r" on rank \d+", "", expression).replace(" per rank", "").replace(" ranks", "").replace(" rank", "")
    assert re.fullmatch(r"[\d ()+x]+", text), expression
    return eval(text.replace(" x ", " * "))  # digits, parentheses, + and * only


@pytest.mark.parametrize(("args", "label"), [
    ((256, 64), "batch 256 = 64 x 4 (4 micro-batches)"),  # even
    ((256, 37), "batch 256 = 37 x 4 + 36 x 3 (7 micro-batches)"),  # uneven: the 'micro 37 x accum 7'
    ((256, 256), "batch 256 = 256 (1 micro-batch)"),
    ((128, 10, 2), "batch 128 = (10 + 9 x 6) per rank x 2 ranks (7 micro-batches each)"),
    ((128, 64, 2), "batch 128 = 64 per rank x 2 ranks (1 micro-batch each)"),
    ((129, 10, 2), "batch 129 = (10 x 2 + 9 x 5) on rank 0 + (10 + 9 x 6) on rank 1 (7 micro-batches each)"),
    ((1001, 42, 8), "batch 1001 = (42 x 3) on rank 0 + (42 x 2 + 41) per rank x 7 ranks (3 micro-batches each)"),
    ((10, 3, 3), "batch 10 = (2 x 2) on rank 0 + (2 + 1) per rank x 2 ranks (2 micro-batches each)"),
    ((3, 1, 2), "batch 3 = (1 x 2) on rank 0 + (1 + 0) on rank 1 (2 micro-batches each)"),  # an empty micro-step
])
def test_the_plan_label_adds_up(args, label):
    plan = Plan.for_target(*args)
    assert plan.describe() == label
    assert _sum(plan.cut_sum()) == plan.target_batch


def test_the_label_names_the_smallest_micro_batch_and_the_memory_saver_in_words():
    plan = Plan.for_target(256, 37, min_micro_batch=2).with_saver("checkpointing")
    assert plan.describe() == "batch 256 = 37 x 4 + 36 x 3 (7 micro-batches, none below 2 samples) with checkpointing"


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 9), st.integers(1, 600))
def test_every_label_adds_up_to_its_target(target, world, micro):
    if target < world:
        return
    plan = Plan.for_target(target, micro, world)
    head, _, tail = plan.describe().partition(" = ")
    assert head == f"batch {target}" and _sum(tail.rsplit(" (", 1)[0]) == target
    assert f"({plan.accum_steps} micro-batch" in tail  # the micro-steps every rank runs


def test_a_token_budget_in_plain_words():
    tokens = TokenBudget(4096, 0.0, 512)
    one = dataclasses.replace(Plan.for_target(64, 32), tokens=tokens)
    assert one.describe() == ("batch 64 cut by length: up to 32 samples per micro-batch, 8 at the longest length "
                              "(512); 2 or more micro-batches, by the lengths")
    two = dataclasses.replace(Plan.for_target(65, 16, 2), tokens=dataclasses.replace(tokens, quadratic=0.002))
    assert two.describe() == ("batch 65 = 33 on rank 0 + 32 on rank 1, cut by length: up to 11 samples per "
                              "micro-batch, 3 at the longest length (512); 3 or more micro-batches on each rank, "
                              "by the lengths")
    for label in (one.describe(), two.describe()):
        assert "token-units" not in label and "L^2" not in label and "accum" not in label


def test_plan_changes_say_both_cuts_so_that_each_adds_up():
    from autoaccum.guard.policy import PlanChange

    old = Plan.for_target(256, 64)
    change = PlanChange(3, "oom", "backward", old, old.halved())
    assert change.describe() == ("OOM in backward: batch 256 = 64 x 4 -> 32 x 8 (8 micro-batches); the global batch "
                                 "is unchanged")
    grown = PlanChange(9, "grow", "predicted to fit in the free memory", Plan.for_target(129, 5, 2),
                       Plan.for_target(129, 10, 2))
    assert grown.describe() == (
        "no OOM for a while (predicted to fit in the free memory): batch 129 = (5 x 13) on rank 0 + (5 x 12 + 4) on "
        "rank 1 -> (10 x 2 + 9 x 5) on rank 0 + (10 + 9 x 6) on rank 1 (7 micro-batches each); the global batch is "
        "unchanged")
    one = Plan.for_target(16, 1)
    saver = PlanChange(2, "oom", "forward", one, one.with_saver("checkpointing"))
    assert saver.describe() == ("OOM in forward: batch 16 = 1 x 16 (16 micro-batches), memory saver none -> "
                               "checkpointing; the global batch is unchanged")
    tokens = dataclasses.replace(Plan.for_target(64, 32), tokens=TokenBudget(4096, 0.0, 512))
    halved = PlanChange(1, "oom", "backward", tokens, tokens.halved())
    assert halved.describe() == (
        "OOM in backward: batch 64 cut by length: up to 32 samples per micro-batch, 8 at the longest length (512) -> "
        "up to 16 samples per micro-batch, 4 at the longest length (512); 4 or more micro-batches, by the lengths; "
        "the global batch is unchanged")


def test_plan_that_does_not_cover_the_target_is_rejected_with_the_right_accum():
    with pytest.raises(ValueError, match=r"accum_steps must be 6.*Plan.for_target"):
        Plan(48, 5, 1, 256)
    with pytest.raises(ValueError, match=r"accum_steps must be 6"):
        Plan(48, 7, 1, 256)  # too many: an empty micro-step on every rank


@pytest.mark.parametrize("field", ["micro_batch", "accum_steps", "world_size", "target_batch"])
@pytest.mark.parametrize("value, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                          ("8", TypeError)])
def test_invalid_fields_name_the_value_and_range(field, value, error):
    fields = {"micro_batch": 4, "accum_steps": 1, "world_size": 1, "target_batch": 4, field: value}
    with pytest.raises(error, match=field) as info:
        Plan(**fields)
    if error is ValueError:
        assert f"Invalid {field}: {value}. Allowed range: 1" in str(info.value)


@pytest.mark.parametrize("target", [0, -1, 2.0, True, None])
def test_for_target_rejects_bad_targets(target):
    with pytest.raises((ValueError, TypeError), match="target_batch"):
        Plan.for_target(target, 4)


def test_dict_round_trip_and_missing_keys():
    plan = Plan.for_target(1000, 48, 4)
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="missing 'world_size'"):
        Plan.from_dict({"micro_batch": 4, "accum_steps": 1, "target_batch": 4})
    assert plan.with_world_size(2) == Plan.for_target(1000, plan.micro_batch, 2)  # the same largest micro-batch


def test_read_plan_accepts_what_the_tools_write(tmp_path):
    from autoaccum.plan.sources import read_plan

    plan = Plan.for_target(256, 48)
    doc = {"kind": "autoaccum.probe", "plan": plan.to_dict()}
    path = tmp_path / "plan.json"
    path.write_text(__import__("json").dumps(doc))
    assert read_plan(plan) is plan
    assert read_plan(doc) == plan and read_plan(plan.to_dict()) == plan
    assert read_plan(path) == plan and read_plan(str(path)) == plan

    class Report:  # a ProbeReport or SearchResult: anything with a .plan
        pass

    report = Report()
    report.plan = plan
    assert read_plan(report) == plan
    with pytest.raises(TypeError, match="plan must be"):
        read_plan(5)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="Invalid plan file"):
        read_plan(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="missing"):
        read_plan({"plan": {"micro_batch": 4}})


def test_a_written_plan_with_a_micro_batch_above_the_step_is_refused(tmp_path):
    """A hand-written plan file of micro-batch 512 for target 256 trained at 256 and said 512 (issue 45)."""
    import json

    import torch

    import autoaccum
    from autoaccum.plan.sources import read_plan

    written = {"micro_batch": 512, "accum_steps": 1, "world_size": 1, "target_batch": 256}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan": written}))
    for source in (written, path):
        with pytest.raises(ValueError, match=r"micro_batch 512 is more than a rank's share .* \(256\).* 1 ~ 256"):
            read_plan(source)
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="micro_batch 512"):
        autoaccum.fit(model, (torch.randn(256, 4), torch.randint(0, 2, (256,))), 256, plan=str(path), progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # before any work
    # the same cut for two ranks is a rank share of 128: a plan written for it names that share
    with pytest.raises(ValueError, match=r"\(128\)"):
        read_plan({**written, "micro_batch": 200, "world_size": 2})
    assert read_plan({**written, "micro_batch": 256}) == Plan.for_target(256, 256)
