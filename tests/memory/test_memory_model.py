"""autoaccum.memory.model: peak(b) = max(opt_peak, base + per_sample * b), fitted on measured phases."""

import pytest
from _probe_models import gpt_batch, gpt_loss, measure_phases, mlp, mlp_batch, mlp_loss, tiny_gpt

from autoaccum.memory.model import GOOD_FIT_RESIDUAL, MemoryModel, MemoryPoint


def line_points(sizes, base=1000, per_sample=50, opt=0):
    return [MemoryPoint(b, base + per_sample * b, opt) for b in sizes]


def test_exact_line_is_recovered():
    model = MemoryModel.fit(line_points([2, 5, 9]))
    assert model.base_bytes == pytest.approx(1000)
    assert model.per_sample_bytes == pytest.approx(50)
    assert model.residual == pytest.approx(0, abs=1e-12)
    assert model.num_points == 3 and model.is_good_fit
    assert model.predict(100) == 6000


def test_max_batch_is_the_largest_size_under_budget_times_one_minus_headroom():
    model = MemoryModel.fit(line_points([2, 5, 9]))
    # usable = 10000 * 0.9 = 9000 = 1000 + 50 * 160
    assert model.max_batch(10_000, headroom=0.1) == 160
    assert model.predict(160) <= 9000 < model.predict(161)
    assert model.max_batch(9049) == 160 and model.max_batch(9050) == 161
    assert model.max_batch(999) == 0  # not even the intercept fits


def test_the_optimizer_peak_is_a_floor_and_can_rule_out_every_size():
    model = MemoryModel.fit(line_points([1, 2], opt=5000))
    assert model.predict(1) == 5000  # the optimizer step, not the forward/backward, is the peak here
    assert model.predict(200) == 11000
    assert model.max_batch(4999) == 0  # the line would allow 79 samples, the optimizer step none
    assert model.max_batch(5000) == 80


def test_memory_that_does_not_grow_with_b():
    model = MemoryModel.fit(line_points([1, 4, 8], per_sample=0))
    assert model.per_sample_bytes == 0
    assert model.max_batch(10_000) >= 2**31 - 1  # unbounded: the caller caps it


def test_noise_never_makes_memory_shrink_with_b():
    model = MemoryModel.fit([MemoryPoint(1, 1000, 0), MemoryPoint(2, 990, 0)])
    assert model.per_sample_bytes == 0.0


def test_repeated_sizes_keep_the_larger_reading():
    model = MemoryModel.fit([MemoryPoint(1, 1050, 10), MemoryPoint(1, 1100, 30), MemoryPoint(3, 1150, 20)])
    assert model.num_points == 2
    assert model.predict(1) == 1100 and model.opt_peak_bytes == 30


def test_points_off_the_model_have_a_large_residual():
    convex = [MemoryPoint(b, 1000 + 5 * b * b, 0) for b in (1, 10, 20, 40)]
    model = MemoryModel.fit(convex)
    assert model.residual > GOOD_FIT_RESIDUAL and not model.is_good_fit


def test_needs_two_distinct_sizes():
    with pytest.raises(ValueError, match=r"at least 2 distinct micro-batch sizes, got \[4\]"):
        MemoryModel.fit([MemoryPoint(4, 100, 10), MemoryPoint(4, 120, 10)])
    with pytest.raises(ValueError, match="got \\[\\]"):
        MemoryModel.fit([])


def test_dict_round_trip():
    model = MemoryModel.fit(line_points([2, 5, 9], opt=777))
    assert MemoryModel.from_dict(model.to_dict()) == model


# -- on real measurements (tracked meter, CPU) ----------------------------------------------------

SHAPES = {
    # fitted on three sizes; checked on sizes between, beyond, and (gpt, b=1) where the optimizer
    # step is the peak
    "mlp": (mlp, mlp_batch(), mlp_loss, (64, 128, 192), (96, 160, 384)),
    "tinygpt": (tiny_gpt, gpt_batch(), gpt_loss, (4, 8, 12), (1, 6, 10, 20)),
}


@pytest.fixture(scope="module")
def measured():
    """Forward/backward and optimizer-step peaks of two real steps, per shape and size."""
    out = {}
    for name, (make_model, make_batch, loss_fn, fitted, unseen) in SHAPES.items():
        model = make_model()
        out[name] = {b: measure_phases(model, make_batch, loss_fn, b) for b in (*fitted, *unseen)}
    return out


@pytest.mark.parametrize("name", SHAPES)
def test_the_model_predicts_the_measured_peak_of_unfitted_sizes_within_5_percent(name, measured):
    _, _, _, fitted, unseen = SHAPES[name]
    model = MemoryModel.fit([MemoryPoint(b, *measured[name][b]) for b in fitted])
    assert model.is_good_fit
    for b in unseen:
        peak = max(measured[name][b])
        assert model.predict(b) == pytest.approx(peak, rel=0.05), f"{name}: b={b}"


def test_negative_control_one_line_through_the_overall_peaks_misses_the_optimizer_peak(measured):
    """Fitting the overall peak instead of the two phases (a wrong model) misses b=1 by more
    than 5%: the tolerance above is tight enough to tell."""
    _, _, _, fitted, _ = SHAPES["tinygpt"]
    wrong = MemoryModel.fit([MemoryPoint(b, max(measured["tinygpt"][b]), 0) for b in fitted])
    peak = max(measured["tinygpt"][1])
    assert abs(wrong.predict(1) / peak - 1) > 0.05


def test_tracked_measurements_are_repeatable(measured):
    model = mlp()
    assert measure_phases(model, mlp_batch(), mlp_loss, 96) == measured["mlp"][96]
