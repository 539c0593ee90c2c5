import math
import pickle

import pytest
import torch

from autoaccum.training.lr import LR_RULES, LinearWarmup, scale_adam_hparams, scale_lr, warmup_lambda


def test_rules_are_the_literal_names():
    assert LR_RULES == ("linear", "sqrt", "none", "adam_sde")


@pytest.mark.parametrize(("rule", "batch", "expected"), [
    # powers of two: every product below is exact in binary floating point
    ("linear", 256, 0.5 * 4),
    ("linear", 16, 0.5 / 4),
    ("sqrt", 256, 0.5 * 2),
    ("sqrt", 16, 0.5 / 2),
    ("adam_sde", 256, 0.5 * 2),
    ("none", 256, 0.5),
    ("none", 16, 0.5),
])
def test_exact_values(rule, batch, expected):
    assert scale_lr(0.5, 64, batch, rule) == expected


def test_values_off_powers_of_two():
    assert scale_lr(3e-4, 32, 96, "linear") == pytest.approx(9e-4, rel=1e-15)
    assert scale_lr(3e-4, 32, 96, "sqrt") == pytest.approx(3e-4 * math.sqrt(3), rel=1e-15)
    assert scale_lr(0.1, 256, 8192, "linear") == pytest.approx(3.2, rel=1e-15)  # Goyal et al.'s 8k setting


@pytest.mark.parametrize("rule", LR_RULES)
def test_same_batch_is_identity(rule):
    assert scale_lr(1.234e-3, 48, 48, rule) == 1.234e-3


@pytest.mark.parametrize("rule", ["Linear", "cosine", "", None, 1, "sqrt "])
def test_bad_rule_names_value_and_allowed(rule):
    with pytest.raises(ValueError) as info:
        scale_lr(1e-3, 32, 64, rule)
    message = str(info.value)
    assert repr(rule) in message
    for name in LR_RULES:
        assert repr(name) in message


@pytest.mark.parametrize("base_lr", [0.0, -1e-3, math.inf, -math.inf, math.nan])
def test_bad_base_lr_value(base_lr):
    with pytest.raises(ValueError, match=r"Invalid base_lr: .*Allowed range: finite and > 0"):
        scale_lr(base_lr, 32, 64, "linear")


@pytest.mark.parametrize("base_lr", ["1e-3", None, True, torch.tensor(1e-3)])
def test_bad_base_lr_type(base_lr):
    with pytest.raises(TypeError, match="base_lr must be a float"):
        scale_lr(base_lr, 32, 64, "linear")


@pytest.mark.parametrize("name", ["base_batch", "batch"])
@pytest.mark.parametrize("value", [0, -8])
def test_bad_batch_value(name, value):
    kwargs = {"base_lr": 1e-3, "base_batch": 32, "batch": 64, "rule": "linear", name: value}
    with pytest.raises(ValueError, match=rf"Invalid {name}: {value}\. Allowed range: 1"):
        scale_lr(**kwargs)


@pytest.mark.parametrize("name", ["base_batch", "batch"])
@pytest.mark.parametrize("value", [32.0, "32", True, None])
def test_bad_batch_type(name, value):
    kwargs = {"base_lr": 1e-3, "base_batch": 32, "batch": 64, "rule": "linear", name: value}
    with pytest.raises(TypeError, match=rf"{name} must be an int"):
        scale_lr(**kwargs)


# --- Adam square-root rule (Malladi et al. 2022) ---

def test_adam_sde_exact_values():
    # kappa = 4: lr x 2, 1 - beta x 4, eps / 2; all exact in binary
    lr, (b1, b2), eps = scale_adam_hparams(0.5, (0.75, 0.9375), 2.0 ** -20, 64, 256)
    assert (lr, b1, b2, eps) == (1.0, 0.0, 0.75, 2.0 ** -21)


def test_adam_sde_typical_values():
    lr, (b1, b2), eps = scale_adam_hparams(1e-3, (0.9, 0.999), 1e-8, 256, 1024)
    assert lr == pytest.approx(2e-3, rel=1e-15)
    assert b1 == pytest.approx(0.6, rel=1e-14)
    assert b2 == pytest.approx(0.996, rel=1e-14)
    assert eps == pytest.approx(5e-9, rel=1e-15)
    # the rule keeps (1 - beta) / lr**2 and lr / sqrt(batch) constant
    assert (1 - b2) / lr ** 2 == pytest.approx((1 - 0.999) / 1e-3 ** 2, rel=1e-9)
    assert lr / math.sqrt(1024) == pytest.approx(1e-3 / math.sqrt(256), rel=1e-15)


def test_adam_sde_smaller_batch_moves_betas_towards_one():
    lr, (b1, b2), eps = scale_adam_hparams(1e-3, (0.9, 0.999), 1e-8, 256, 64)
    assert lr == pytest.approx(5e-4, rel=1e-15)
    assert (b1, b2) == (pytest.approx(0.975, rel=1e-14), pytest.approx(0.99975, rel=1e-14))
    assert eps == pytest.approx(2e-8, rel=1e-15)


def test_adam_sde_lr_matches_scale_lr():
    lr, _, _ = scale_adam_hparams(3e-4, (0.9, 0.95), 1e-8, 48, 80)
    assert lr == scale_lr(3e-4, 48, 80, "adam_sde") == scale_lr(3e-4, 48, 80, "sqrt")


def test_adam_sde_same_batch_returns_inputs_exactly():
    # 1 - (1 - beta) need not round back to beta; same batch must not change anything
    assert scale_adam_hparams(1e-3, (0.9, 0.999), 1e-8, 32, 32) == (1e-3, (0.9, 0.999), 1e-8)


def test_adam_sde_batch_too_large_for_beta1():
    # beta1 = 0.9 allows at most 10 x base_batch; 16 x would make beta1 = -0.6
    with pytest.raises(ValueError, match=r"beta1 = .* < 0.*batch <= base_batch / \(1 - beta1\) = 320"):
        scale_adam_hparams(1e-3, (0.9, 0.999), 1e-8, 32, 512)
    _, (b1, _), _ = scale_adam_hparams(1e-3, (0.9, 0.999), 1e-8, 32, 320)  # the limit itself is allowed
    assert b1 == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"lr": 0.0}, ValueError, "Invalid lr"),
    ({"lr": math.nan}, ValueError, "Invalid lr"),
    ({"betas": (0.9,)}, TypeError, "betas must be a pair"),
    ({"betas": 0.9}, TypeError, "betas must be a pair"),
    ({"betas": (1.0, 0.999)}, ValueError, r"Invalid beta1: 1.0. Allowed range: 0 <= beta1 < 1"),
    ({"betas": (0.9, -0.1)}, ValueError, r"Invalid beta2: -0.1"),
    ({"betas": (0.9, "0.999")}, TypeError, "beta2 must be a float"),
    ({"eps": -1e-8}, ValueError, "Invalid eps"),
    ({"eps": math.inf}, ValueError, "Invalid eps"),
    ({"eps": None}, TypeError, "eps must be a float"),
    ({"base_batch": 0}, ValueError, "Invalid base_batch: 0"),
    ({"batch": 2.0}, TypeError, "batch must be an int"),
])
def test_adam_sde_bad_input(kwargs, error, pattern):
    args = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "base_batch": 32, "batch": 64, **kwargs}
    with pytest.raises(error, match=pattern):
        scale_adam_hparams(**args)


# --- warmup ---

def test_warmup_multipliers():
    f = warmup_lambda(4)
    assert [f(step) for step in range(7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]


def test_no_warmup_is_constant_one():
    f = warmup_lambda(0)
    assert [f(step) for step in range(3)] == [1.0, 1.0, 1.0]


def test_warmup_with_lambda_lr_and_state_dict():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(2))
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [0.25, 0.5, 0.5]  # optimizer step 0 runs at lr / warmup_steps, step 1 at the full lr
    # the callable object is recorded as plain data, and pickles (e.g. for spawn workers)
    assert sched.state_dict()["lr_lambdas"] == [{"warmup_steps": 2}]
    assert pickle.loads(pickle.dumps(warmup_lambda(3)))(0) == pytest.approx(1 / 3)


@pytest.mark.parametrize(("steps", "error"), [(-1, ValueError), (2.0, TypeError), (True, TypeError), ("3", TypeError)])
def test_warmup_bad_input(steps, error):
    with pytest.raises(error, match="warmup_steps"):
        warmup_lambda(steps)
    with pytest.raises(error, match="warmup_steps"):
        LinearWarmup(steps)
