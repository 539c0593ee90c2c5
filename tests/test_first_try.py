"""What a new user meets on the first try (issue 11): BatchNorm models, precision, compiled models,
dict data, DataLoaders, and errors that say what to change -- each raised before any work."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoaccum
from autoaccum import DoesNotFitError, OOMGuard, Plan, TaskError, emulated_budget, probe
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss


def bn_mlp(seed: int = 0) -> nn.Module:
    """BatchNorm1d on (N, C): one sample per micro-batch cannot train ("Expected more than 1 value per channel")."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 3))


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 3))


def data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def ce(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


# -- BatchNorm ----------------------------------------------------------------------------------------

def test_a_batchnorm_mlp_probes_from_two_and_trains_under_a_budget():
    model = bn_mlp()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):  # what torch says at 1
        ce(model, data(1))
    with pytest.warns(UserWarning, match="BatchNorm layers"):
        result = autoaccum.fit(model, data(256), 128, budget="120KiB", epochs=1, progress=False)
    assert result.probe.candidates[0].micro_batch == 2 and result.plan.min_micro_batch == 2
    assert result.plan.accum_steps > 1 and result.optimizer_steps == 2 and result.oom_events == 0
    assert all(s >= 2 for s in result.plan.micro_sizes())


def test_the_guard_never_runs_a_batchnorm_model_below_two():
    model = bn_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    one = OOMGuard(model, opt, target_batch=16, micro_batch=1)  # one sample is tried at the first step
    with pytest.raises(ValueError, match=r"Invalid micro_batch: 1\. A BatchNorm layer of Sequential gets one value per "
                                         r"channel from one sample .*no fewer than 2 samples .*Allowed range: 2 ~ any"):
        one.step(data(16), ce)
    assert all(torch.equal(a, b) for a, b in zip(state, (*model.parameters(), *model.buffers())))  # before any work
    assert one.steps == 0 and all(p.grad is None for p in model.parameters())
    guard = OOMGuard(model, opt, target_batch=16, micro_batch=2)
    batch = data(16)
    live = autoaccum.TrackedMemory().track(model, opt, batch).current_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # room for the step's bookkeeping (copies of the BatchNorm statistics), not for a micro-batch of 2
        with emulated_budget(live + 1024, model, opt, batch), pytest.raises(DoesNotFitError) as info:
            guard.step(batch, ce)  # everything runs out: micro 2 is the end, not 1
    assert info.value.micro_batch == 2 and "a micro-batch of 2 does not fit" in str(info.value)
    with pytest.raises(ValueError, match=r"batch holds 1 sample\(s\), fewer than the smallest .*drop_last=True"):
        guard.step(data(1), ce, partial=True)  # an epoch's last batch of one sample


class TokenBatchNorm(nn.Module):
    """BatchNorm1d over tokens, (N, C, L): one sample gives L values per channel, so it trains at 1."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.norm, self.out = nn.Embedding(vocab, dim), nn.BatchNorm1d(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(tokens).transpose(1, 2)).transpose(1, 2))


def token_ce(model: nn.Module, batch) -> torch.Tensor:
    tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def test_a_batchnorm_over_tokens_trains_at_one_sample_everywhere():
    """The floor is found by trying one sample, not read off the presence of BatchNorm: BatchNorm1d on
    (N, C, L) gets L values per channel from one sample, and the probe, the guard and fit run it at 1."""
    tokens = torch.randint(0, 32, (65, 9), generator=torch.Generator().manual_seed(0))
    model = TokenBatchNorm()
    state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    report = probe(model=model, loss_fn=token_ce, make_batch=lambda b: tokens[:b], target_batch=16, budget="40KiB")
    assert report.plan.min_micro_batch == 1 and report.candidates[0].micro_batch == 1
    assert all(torch.equal(a, b) for a, b in zip(state, (*model.parameters(), *model.buffers())))  # the trial too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNorm note: micro-batches have their own statistics
        guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=16, micro_batch=1)
        result = guard.step(tokens[:16], token_ce)
        assert result.plan.min_micro_batch == 1 and result.micro_steps == 16
        # fit: an epoch of 65 at target 64 ends in a step of one sample, which trains here
        fitted = autoaccum.fit(TokenBatchNorm(), (tokens,), 64, loss_fn=token_ce, plan=Plan.for_target(64, 16),
                               progress=False, verbose=False)
    assert fitted.optimizer_steps == 2 and fitted.samples_seen == 65


def test_a_193_sample_epoch_at_target_64_is_refused_before_training_or_dropped():
    """The reported case: 193 = 3 x 64 + 1; the last step's single sample cannot train with BatchNorm."""
    model = bn_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"last global batch holds 1 sample.*last_batch='drop'"):
        autoaccum.fit(model, data(193), 64, budget="120KiB", progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before any step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = autoaccum.fit(model, data(193), 64, budget="120KiB", last_batch="drop", progress=False)
    assert result.optimizer_steps == 3 and result.samples_seen == 192
    plain = autoaccum.fit(mlp(), data(193), 64, budget="120KiB", progress=False)  # no BatchNorm: an exact 4th step
    assert plain.optimizer_steps == 4 and plain.samples_seen == 193


# -- precision, compile ---------------------------------------------------------------------------------

def test_the_probe_measures_under_the_precision_training_runs_in():
    torch.manual_seed(0)
    task = autoaccum.Task(model=TinyGPT(dim=64), loss_fn=token_loss, make_batch=lambda b: synthetic_tokens(b, seed=b))
    # without memory savers: with them each precision plans its own fastest saver, and the largest micro-batch
    # that fits is that saver's (fp32 took checkpointing half the blocks and fitted more than bf16 without)
    fp32 = probe(task, target_batch=256, budget="24MiB", memory_savers="off")
    bf16 = probe(task, target_batch=256, budget="24MiB", precision="bf16", memory_savers="off")
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16")
    # bf16 activations take half the bytes: the same budget fits a larger micro-batch
    assert bf16.max_fitting_micro_batch > 1.3 * fp32.max_fitting_micro_batch
    assert bf16.model.per_sample_bytes < 0.75 * fp32.model.per_sample_bytes
    # and fit plans with the bf16 measurement when it trains in bf16 (a bf16 run got fp32's plan). Checked
    # by memory, not by the chosen micro-batch: the plan takes the fastest size that fits, and on a CPU
    # bf16's throughput is flat enough across sizes that noise once picked 26, fp32's own choice.
    result = autoaccum.fit(TinyGPT(dim=64), synthetic_tokens(512), 256, loss_fn=token_loss_tuple, budget="24MiB",
                           precision="bf16", epochs=1, progress=False, memory_savers="off")
    assert result.probe.precision == "bf16" and result.plan == result.probe.plan
    assert result.probe.max_fitting_micro_batch > 1.3 * fp32.max_fitting_micro_batch


def token_loss_tuple(model, batch):
    return token_loss(model, batch[0] if isinstance(batch, (tuple, list)) else batch)


def test_a_compiled_model_is_refused_where_the_counter_would_run_it_eagerly():
    compiled = torch.compile(mlp())
    with pytest.raises(ValueError, match=r"torch.compile'd.*compiles nothing.*model._orig_mod"):
        autoaccum.fit(compiled, data(64), 32, budget="1MiB", progress=False)
    with pytest.raises(ValueError, match=r"cannot probe it: the model is torch.compile'd"):
        probe(model=compiled, loss_fn=ce, make_batch=data, target_batch=32, budget="1MiB")
    inplace = mlp()
    inplace.compile()
    with pytest.raises(ValueError, match="torch.compile'd"):
        probe(model=inplace, loss_fn=ce, make_batch=data, target_batch=32, budget="1MiB")


# -- data ------------------------------------------------------------------------------------------------

def test_a_dict_of_tensors_is_data():
    x, y = data(64)
    seen = []

    def loss_fn(model, batch):
        seen.append(sorted(batch))
        return F.cross_entropy(model(batch["x"]), batch["y"])

    result = autoaccum.fit(mlp(), {"x": x, "y": y}, 32, loss_fn=loss_fn, plan=Plan.for_target(32, 16), progress=False)
    assert result.optimizer_steps == 2 and seen[0] == ["x", "y"]
    with pytest.raises(TaskError, match=r"needs 'labels' in the batch \(keys: 'x', 'y'\).*or pass loss_fn="):
        autoaccum.fit(mlp(), {"x": x, "y": y}, 32, plan=Plan.for_target(32, 16), progress=False)


@pytest.mark.parametrize("loader_batch, target, says", [
    (64, 256, r"batches \(DataLoader batch_size\) of 64 samples, but target_batch is 256 (?!\(fit's default\)).*"
              r"pass target_batch=64"),  # no default: fit needs target_batch (tests/training/test_fit_inputs.py)
    (32, 64, r"of 32 samples, but target_batch is 64 over 1 rank\(s\).*pass target_batch=32"),
])
def test_a_dataloader_of_other_sized_batches_names_target_batch_before_any_work(loader_batch, target, says):
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data(256)), batch_size=loader_batch)
    model = mlp()
    kwargs = {} if target is None else {"target_batch": target}
    with pytest.raises(ValueError, match=says):
        autoaccum.fit(model, loader, loss_fn=ce, budget="1MiB", progress=False, **kwargs)


# -- errors that name the fix ----------------------------------------------------------------------

def test_a_loss_fn_with_the_wrong_signature_is_named_before_any_work():
    with pytest.raises(TypeError, match=r"called as loss_fn\(model, batch\), but yours takes \(batch\); write it as "
                                        r"lambda model, batch"):
        autoaccum.fit(mlp(), data(64), 32, loss_fn=lambda batch: batch[0].sum(), progress=False)
    model = mlp()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=32, micro_batch=8)
    with pytest.raises(TypeError, match=r"but yours takes \(model, batch, extra\)"):
        guard.step(data(32), lambda model, batch, extra: ce(model, batch))


def test_swapped_arguments_are_named():
    model = mlp()
    with pytest.raises(TypeError, match=r"data must be .* got a function; the arguments look swapped"):
        autoaccum.fit(model, ce, data(64))  # fit(model, loss_fn, data)
    with pytest.raises(TypeError, match=r"target_batch must be an int .* got a tuple; fit's arguments are"):
        autoaccum.fit(model, data(64), data(64))
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=32, micro_batch=8)
    with pytest.raises(TypeError, match=r"got a function as batch and a tuple as loss_fn: the arguments look swapped"):
        guard.step(ce, data(32))


def test_an_optimizer_over_another_models_parameters_is_refused():
    model, other = mlp(0), mlp(1)
    with pytest.raises(ValueError, match=r"steps none of the 4 trainable parameters of the Sequential.*"
                                         r"SGD\(model.parameters\(\), ...\)"):
        autoaccum.fit(model, data(64), 32, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), progress=False)
    with pytest.raises(ValueError, match="steps none of the"):
        OOMGuard(model, torch.optim.SGD(other.parameters(), lr=0.1), target_batch=32, micro_batch=8)


def test_a_loss_of_shape_1_is_refused():
    model = mlp()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=8, micro_batch=8)
    with pytest.raises(TaskError, match=r"scalar tensor \(0 dimensions\), got \(1,\).*\.squeeze\(\)"):
        guard.step(data(8), lambda m, b: ce(m, b).reshape(1))


def test_does_not_fit_states_an_emulated_budget_it_runs_under():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = OOMGuard(model, opt, target_batch=8, micro_batch=1)  # no meter given: the budget is found
    batch = data(8)
    with emulated_budget("3KiB", model, opt, batch), pytest.raises(DoesNotFitError) as info:
        guard.step(batch, ce)
    assert info.value.available_bytes == 3 * 1024
    assert "available 3 KiB" in str(info.value) and "unknown" not in str(info.value)


@pytest.mark.parametrize("device, says", [("banana", r"Invalid device: 'banana'"),
                                          ("cuda", r"Invalid device: 'cuda': CUDA is not available here"),
                                          ("xpu", r"Invalid device: 'xpu': xpu is not available here"),
                                          ("meta", r"Invalid device: 'meta': meta tensors hold no data")])
def test_a_device_that_does_not_exist_here_is_a_clear_error(device, says):
    if device == "cuda" and torch.cuda.is_available() or device == "xpu" and torch.xpu.is_available():
        pytest.skip(f"needs a machine without {device}")
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=says):  # before: xpu leaked an AssertionError, meta NotImplementedError
        autoaccum.fit(model, data(64), 32, device=device, progress=False)
    after = model.state_dict()  # refused before any work: the model was not moved (meta would erase it)
    assert all(after[k].device.type == "cpu" and torch.equal(after[k], v) for k, v in before.items())


def test_unknown_fit_options_suggest_the_known_one():
    with pytest.raises(TypeError, match=r"unknown option 'lr_rul'; did you mean 'lr_rule'\?"):
        autoaccum.fit(mlp(), data(64), 32, lr_rul="sqrt")
    with pytest.raises(TypeError, match=r"fit\(\): overlap= was removed"):
        autoaccum.fit(mlp(), data(64), 32, overlap="on")
    with pytest.raises(ValueError, match=r"2 invalid fit options:\n  - Invalid lr: -1.*\n  - Invalid epochs: 0"):
        autoaccum.fit(mlp(), data(64), 32, lr=-1.0, epochs=0)


# -- output off a terminal ------------------------------------------------------------------------------

def _run_script(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow  # a fresh interpreter importing torch
def test_fit_speaks_off_a_terminal_without_any_logging_setup(tmp_path):
    """Under a job scheduler stderr is a file and nobody configured logging: the banner, each plan change
    and the summary must still show (they did not: nothing at all was printed)."""
    job = """
        import torch, autoaccum
        torch.manual_seed(0)
        x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
        model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
        autoaccum.fit(model, (x, y), 128, budget="120KiB", epochs=1, VERBOSE)
        print("done")
    """
    result = _run_script(job.replace("VERBOSE", "verbose=True"), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "autoaccum: autoaccum fit · cpu · budget 120 KiB (emulated) · batch 128 = " in result.stderr
    assert "micro-batches), measured by the probe · lr " in result.stderr
    assert "autoaccum: autoaccum fit done · 2 steps, 256 samples" in result.stderr
    quiet = _run_script(job.replace("VERBOSE", "verbose=False"), tmp_path)
    assert quiet.returncode == 0 and "autoaccum fit" not in quiet.stderr
    # Hugging Face's example scripts: logging.basicConfig() leaves the root at WARNING, which dropped the banner.
    # It shows once, through the application's handler and format; a level set for autoaccum silences it.
    configured = job.replace("import torch, autoaccum", "import logging, torch, autoaccum\n"
                             "        logging.basicConfig(format='%(levelname)s|%(name)s|%(message)s')")
    shown = _run_script(configured.replace("VERBOSE", "verbose=True"), tmp_path)
    assert shown.returncode == 0 and shown.stderr.count("INFO|autoaccum.fit|autoaccum fit ·") == 1, \
        shown.stderr
    assert "autoaccum: autoaccum fit" not in shown.stderr  # not a second time, through a handler of autoaccum's
    silenced = _run_script(configured.replace("VERBOSE", "verbose=True").replace(
        "import logging, torch, autoaccum\n", "import logging, torch, autoaccum\n"
        "        logging.getLogger('autoaccum').setLevel(logging.WARNING)\n"), tmp_path)
    assert silenced.returncode == 0 and "autoaccum fit ·" not in silenced.stderr


def test_verbose_false_prints_nothing_after_an_earlier_fit_in_the_process(tmp_path):
    """The first fit installs the stderr handler; a later fit(verbose=False) printed the probe's byte lines
    through it. Now it prints nothing, and a default fit prints the same lines the first time and later."""
    job = """
        import sys, torch, autoaccum
        torch.manual_seed(0)
        x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
        def run(**kwargs):
            model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
            autoaccum.fit(model, (x, y), 128, budget="120KiB", epochs=1, **kwargs)
        run()
        print("-- quiet", file=sys.stderr, flush=True)
        run(verbose=False)
        print("-- default again", file=sys.stderr, flush=True)
        run()
    """
    result = _run_script(job, tmp_path)
    assert result.returncode == 0, result.stderr
    first, rest = result.stderr.split("-- quiet\n")
    quiet, again = rest.split("-- default again\n")
    assert quiet == ""
    def kinds(text: str) -> list[str]:  # each line without its time, loss and speed
        return [line.split(" ", 1)[1].split(" · final loss")[0] for line in text.splitlines()]

    shown = kinds(first)
    assert kinds(again) == shown
    assert len(shown) == 2 and shown[0].startswith("autoaccum: autoaccum fit · ")
    assert shown[1].startswith("autoaccum: autoaccum fit done · 2 steps, 256 samples")
    assert "peak 7" not in first and "probe micro-batch" not in result.stderr  # no raw bytes, no measurements


# -- first contact: mistakes named before any work (the probe's warm-up included) ------------------------

def _untouched(model: nn.Module):
    """A check that ``model``'s parameters and buffers are as they are now."""
    state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    return lambda: all(torch.equal(a, b) for a, b in zip(state, (*model.parameters(), *model.buffers())))


def test_a_float16_model_fed_float32_data_is_explained_on_every_path(tmp_path):
    """The guard's path explained it; the probe's warm-up (fit without plan=, probe, the CLI) raised torch's
    'mat1 and mat2 must have the same dtype' 20 frames deep. One line now, naming both dtypes and the fixes."""
    says = (r"the model's parameters are torch.float16 and the batch holds torch.float32 tensors \(.*\); convert "
            r"the data to the model's dtype \(x.to\(torch.float16\)\), or keep the model in float32 and train in "
            r"mixed precision \(fit\(..., precision='bf16' or 'fp16'\)")
    model = mlp().half()
    same = _untouched(model)
    with pytest.raises(TaskError, match=says):
        autoaccum.fit(model, data(64), 32, budget="1MiB", progress=False)  # the probe's warm-up
    with pytest.raises(TaskError, match=says):
        probe(model=model, loss_fn=ce, make_batch=data, target_batch=32, budget="1MiB")
    with pytest.raises(TaskError, match=says):
        autoaccum.fit(model, data(64), 32, plan=Plan.for_target(32, 8), progress=False)  # the guard's path
    assert same()


def test_a_loss_fn_with_swapped_arguments_is_named_before_any_work():
    model = mlp()
    same = _untouched(model)
    with pytest.raises(TypeError, match=r"loss_fn takes \(batch, model\), but it is called as loss_fn\(model, batch\): "
                                        r"the arguments are swapped\. Write it as lambda model, batch: \.\.\."):
        autoaccum.fit(model, data(64), 32, loss_fn=lambda batch, model: ce(model, batch), progress=False)
    with pytest.raises(TaskError, match=r"the loss function called the batch \(tuple\) as a model \('tuple' object is "
                                        r"not callable\): its arguments look swapped\. loss_fn is called as "
                                        r"loss_fn\(model, batch\); write it as lambda model, batch"):
        autoaccum.fit(model, data(64), 32, loss_fn=lambda b, m: ce(m, b), budget="1MiB", progress=False)
    with pytest.raises(TaskError, match=r"its arguments look swapped"):  # the guard's path
        autoaccum.fit(model, data(64), 32, loss_fn=lambda b, m: ce(m, b), plan=Plan.for_target(32, 8), progress=False)
    assert same()


@pytest.mark.parametrize(("model", "targets", "says"), [
    (lambda: nn.Linear(6, 1), torch.randn(64), r"the model gives 1 output per sample \(output shape \(\d+, 1\)\), and "
     r"cross-entropy over a single class is 0 whatever it predicts.*For regression pass loss_fn=lambda model, batch: "
     r"F.mse_loss"),
    (lambda: nn.Linear(6, 3), torch.randn(64), r"the targets are torch.float32 of shape \(\d+,\) "
     r"\(regression values\?\): expected class indices \(an integer tensor of shape \(\d+,\)\) or class probabilities "
     r".*F.mse_loss"),
    (lambda: nn.Linear(6, 3), torch.arange(64) % 4, r"Invalid target 3: the default loss is cross-entropy over the "
     r"model's 3 outputs, so targets are class indices in 0 ~ 2 \(or -100, skipped\)\. Give the model one output per "
     r"class \(at least 4\), or map the labels to 0 ~ 2"),
    (lambda: nn.Linear(6, 3), -(torch.arange(64) % 2), r"Invalid target -1: .* class indices in 0 ~ 2"),
])
def test_the_default_loss_refuses_targets_it_cannot_mean_before_any_work(model, targets, says):
    """Float regression targets and labels out of range reached torch's cross_entropy (a shape error, a
    silent zero loss, 'Target 3 is out of bounds', or on CUDA a device-side assert)."""
    torch.manual_seed(0)
    net = model()
    same = _untouched(net)
    x = torch.randn(64, 6)
    with pytest.raises(TaskError, match=says):
        autoaccum.fit(net, (x, targets), 32, budget="1MiB", progress=False)  # in the probe's warm-up
    with pytest.raises(TaskError, match=says):
        autoaccum.fit(net, (x, targets), 32, plan=Plan.for_target(32, 8), progress=False)  # the guard's first pass
    assert same()


def test_the_default_loss_runs_in_an_estimate_on_fake_tensors():
    """Fake tensors hold no values: the labels' range is not read there (an estimate runs no real step)."""
    from autoaccum.step.losses import default_loss

    report = probe(model=nn.Linear(6, 3), loss_fn=default_loss, make_batch=data, target_batch=32, budget="1MiB",
                   estimate=True)
    assert report.is_estimate and report.plan.target_batch == 32


def test_the_default_loss_takes_class_probabilities_and_skipped_labels():
    model = nn.Linear(6, 3)
    probabilities = torch.softmax(torch.randn(64, 3), dim=1)
    assert autoaccum.fit(model, (torch.randn(64, 6), probabilities), 32, epochs=1, plan=Plan.for_target(32, 8),
                         progress=False).optimizer_steps == 2
    labels = torch.arange(64) % 3
    labels[::5] = -100
    assert autoaccum.fit(model, (torch.randn(64, 6), labels), 32, epochs=1, plan=Plan.for_target(32, 8),
                         progress=False).optimizer_steps == 2


def test_a_log_file_in_a_missing_directory_is_refused_before_the_probe(tmp_path, monkeypatch):
    import autoaccum.training.fit as fit_module

    monkeypatch.setattr(fit_module, "probe", lambda *a, **k: pytest.fail("probed before checking log_file"))
    missing = tmp_path / "no" / "such" / "metrics.jsonl"
    with pytest.raises(ValueError, match=rf"Invalid log_file '{missing}': its directory '{missing.parent}' does not "
                                         rf"exist\. Allowed: a file path in an existing directory; create it first "
                                         rf"\(os.makedirs\('{missing.parent}', exist_ok=True\)\)"):
        autoaccum.fit(mlp(), data(64), 32, log_file=missing, progress=False)
    with pytest.raises(ValueError, match=r"Invalid log_file .*: it is a directory"):
        autoaccum.fit(mlp(), data(64), 32, log_file=tmp_path, progress=False)


def test_a_probe_report_of_another_model_is_refused_as_plan(tmp_path):
    """plan= given a probe report (or its --json file) made for another model was used as it was: its cut and
    its memory model (which growth after an OOM reads) belong to that model. Refused, naming both models and
    the fixes; a bare Plan is the caller's explicit choice and passes."""
    report = probe(model=mlp(), loss_fn=ce, make_batch=data, target_batch=32, budget="1MiB")
    assert report.model_fingerprint and report.model_summary.startswith("Sequential: ")
    path = tmp_path / "plan.json"
    path.write_text(__import__("json").dumps(report.to_dict()))
    other = nn.Sequential(nn.Linear(6, 128), nn.ReLU(), nn.Linear(128, 3))
    same = _untouched(other)
    says = (r"plan= is a probe report.* measured on another model \(Sequential: .* parameters .*\) than the one "
            r"training \(Sequential: .*\); .* Probe this model \(drop plan=\), pass the probe report made for it, or, "
            r"to keep that cut anyway, pass only its plan \(plan=its .plan, or autoaccum.load_plan_file\(path\) for "
            r"a file\)")
    for source in (report, path, str(path), report.to_dict()):
        with pytest.raises(ValueError, match=says):
            autoaccum.fit(other, data(64), 32, plan=source, progress=False)
    with pytest.raises(ValueError, match=says):
        OOMGuard(other, torch.optim.SGD(other.parameters(), lr=0.1), plan=report)
    assert same()
    assert autoaccum.fit(other, data(64), 32, plan=report.plan, progress=False).plan_source == "given"
    assert autoaccum.fit(mlp(), data(64), 32, plan=path, progress=False).plan_source == "given"  # its own model


def test_fit_refuses_budget_next_to_a_plan_on_cuda_where_it_means_nothing():
    """On CUDA budget= sizes the probe's plan only (no emulated device there): next to plan= it is refused. The
    rule fit and the integrations share (``emulated_device``), asked for a CUDA device a CPU machine lacks;
    control: the same budget alone is the probe's, with no emulated device."""
    from autoaccum.memory import emulated_device

    with pytest.raises(TypeError, match=r"budget= is the memory the probe plans for, and plan= skips the probe.*"
                                        r"budget= would mean nothing on cuda"):
        emulated_device("1GiB", torch.device("cuda"), mlp(), skips_probe="plan=")
    assert emulated_device("1GiB", torch.device("cuda"), mlp()) is None
    assert emulated_device("1GiB", torch.device("cpu"), mlp()).budget_bytes == 2**30


def test_announce_shows_a_line_on_the_console_without_any_logging_setup(tmp_path):
    """The integrations' plan line goes where fit's banner goes: stderr, with nothing configured."""
    job = """
        import logging
        from autoaccum.log import announce
        announce(logging.getLogger("autoaccum.integrations.lazy_guard"), "autoaccum · batch 8 = 3 x 2 + 2")
        logging.getLogger("autoaccum").setLevel(logging.WARNING)
        announce(logging.getLogger("autoaccum.integrations.lazy_guard"), "silenced")
    """
    result = _run_script(job, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.endswith("autoaccum: autoaccum · batch 8 = 3 x 2 + 2\n") and "silenced" not in result.stderr
