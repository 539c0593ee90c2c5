"""fit's answers to a new user's mistakes (issue 45): each was accepted silently or met a raw torch error.

Every refusal comes before any work: the loss is never called and the weights are unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _fit_models import Mlp, cross_entropy, mlp_data
from helpers import full_batch_steps, params, rel_diff

import autoaccum
from autoaccum.plan.data import GlobalBatches
from autoaccum.plan.plan import Plan


class _Spy:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model, batch):
        self.calls += 1
        return cross_entropy(model, batch)


def _refused(error, match, *, model=None, data=None, target=64, **kwargs):
    """fit raises ``error`` matching ``match`` with the loss never called and the weights as they were."""
    spy, model = _Spy(), model if model is not None else Mlp(p=0.0)
    before = params(model) if not any(p.is_meta for p in model.parameters()) else None
    kwargs.setdefault("plan", Plan.for_target(target, 16))
    with pytest.raises(error, match=match):
        autoaccum.fit(model, mlp_data(128) if data is None else data, target, loss_fn=spy, progress=False, **kwargs)
    assert spy.calls == 0
    if before is not None:
        assert rel_diff(params(model), before) == 0.0


def test_a_one_tuple_of_data_reaches_the_loss_as_a_tuple_and_trains_on_every_row():
    """``(X,)`` reached the loss as a bare tensor: ``b[0]`` was one sample, trained on one row per micro-batch."""
    torch.manual_seed(0)
    x = torch.randn(64, 4, dtype=torch.float64)
    model = torch.nn.Linear(4, 2).double()
    reference = torch.nn.Linear(4, 2).double()
    reference.load_state_dict(model.state_dict())
    seen = []

    def loss(m, b):  # an autoencoder-like loss on the only column
        seen.append(type(b))
        return m(b[0]).pow(2).mean()

    autoaccum.fit(model, (x,), 64, loss_fn=loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                  plan=Plan.for_target(64, 16), last_batch="drop", seed=0, progress=False, verbose=False)
    assert seen and all(t is tuple for t in seen)
    full_batch_steps(reference, loss, [(x,)], torch.optim.SGD(reference.parameters(), lr=0.5))
    assert rel_diff(params(model), params(reference)) <= 1e-12  # fp64: the same sum, cut in four
    control = torch.nn.Linear(4, 2).double()  # the negative control: one row per micro-batch, as before
    control.load_state_dict(reference.state_dict())
    full_batch_steps(control, lambda m, b: m(b[0][:1]).pow(2).mean(), [(x,)], torch.optim.SGD(control.parameters(),
                                                                                             lr=0.5))
    assert rel_diff(params(control), params(reference)) > 1e-3


def test_target_batch_is_required():
    with pytest.raises(TypeError, match=r"fit needs target_batch: .* \(e\.g\. fit\(model, data, target_batch=256\)"):
        autoaccum.fit(Mlp(p=0.0), mlp_data(128), progress=False)


def test_eval_every_without_eval_data_is_refused():
    _refused(ValueError, r"eval_every=2 evaluates eval_data= .* no eval_data was given", eval_every=2)


def test_a_one_shot_iterator_with_more_than_one_epoch_is_refused():
    x, y = mlp_data(128)
    batches = ((x[i:i + 64], y[i:i + 64]) for i in (0, 64))
    _refused(ValueError, r"one-shot iterator \(generator\).* epochs=2 would train one epoch only", data=batches,
             epochs=2)
    # a DataLoader is iterated again each epoch: two epochs of two steps
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    result = autoaccum.fit(Mlp(p=0.0), loader, 64, plan=Plan.for_target(64, 16), epochs=2, progress=False,
                           verbose=False)
    assert result.optimizer_steps == 4


def test_an_optimizer_lr_and_a_different_lr_option_are_refused():
    model = Mlp(p=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _refused(ValueError, r"lr=0.01 and the optimizer's lr 0.1 \(param group 0\) disagree", model=model,
             optimizer=optimizer, lr=0.01)
    assert optimizer.param_groups[0]["lr"] == 0.1
    result = autoaccum.fit(model, mlp_data(128), 64, optimizer=optimizer, lr=0.1, plan=Plan.for_target(64, 16),
                           progress=False, verbose=False)  # the same lr twice is no conflict
    assert result.lr == 0.1


def test_adam_sde_with_an_optimizer_without_betas_is_refused():
    model = Mlp(p=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _refused(ValueError, r"lr_rule='adam_sde' scales Adam's betas and eps, and SGD's param group 0 has none; use "
                         r"lr_rule='sqrt'", model=model, optimizer=optimizer, lr_rule="adam_sde", base_batch=32)
    assert optimizer.param_groups[0]["lr"] == 0.1  # no group changed


def test_a_report_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    _refused(ValueError, r"Invalid report_dir .*notes.txt': it is a file", report_dir=path)
    assert path.read_text() == "mine"


def test_a_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = Mlp(p=0.0)
    _refused(ValueError, r"Mlp's 'net.0.weight' is on the meta device: .* \(model.to_empty", model=model)


def test_an_emulated_budget_larger_than_the_host_is_refused():
    from autoaccum.memory.tracked import host_memory_bytes

    host = host_memory_bytes()
    assert host is not None and host > 2**30  # Linux says
    _refused(ValueError, r"Invalid budget: .* is more than this machine's memory .* Allowed range: up to",
             budget=4 * host, plan=None)


class _SampleStream(torch.utils.data.IterableDataset):
    """Single samples ``(x_i, y_i)``, in row order: what an IterableDataset given to fit yields."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


def test_an_iterable_dataset_of_samples_is_batched_by_fit_in_its_order_exactly():
    """Each sample was taken for a batch ("a first batch of 6 samples": its feature dim). fit batches the
    stream: global batches of target_batch in the stream's order, the last one (12 of 60) a real step."""
    x, y = mlp_data(60, dtype=torch.float64)
    torch.manual_seed(0)
    model = Mlp(p=0.0, dtype=torch.float64)
    reference = Mlp(p=0.0, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    result = autoaccum.fit(model, _SampleStream(x, y), 16, loss_fn=cross_entropy, plan=Plan.for_target(16, 4),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.5), progress=False, verbose=False)
    assert (result.optimizer_steps, result.samples_seen) == (4, 60)
    in_order = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 60, 16)]  # 16, 16, 16, 12
    full_batch_steps(reference, cross_entropy, in_order, torch.optim.SGD(reference.parameters(), lr=0.5))
    assert rel_diff(params(model), params(reference)) <= 1e-12  # fp64: the same sums, cut in micro-batches
    torch.manual_seed(0)
    control = Mlp(p=0.0, dtype=torch.float64)  # the negative control: a shuffled order, as for a map-style dataset
    order = torch.randperm(60, generator=torch.Generator().manual_seed(0))
    shuffled = [(x[order[i:i + 16]], y[order[i:i + 16]]) for i in range(0, 60, 16)]
    full_batch_steps(control, cross_entropy, shuffled, torch.optim.SGD(control.parameters(), lr=0.5))
    assert rel_diff(params(control), params(reference)) > 1e-3


def test_an_iterable_dataset_of_samples_is_probed_and_trained_under_a_budget():
    x, y = torch.randn(64, 20), torch.randint(0, 2, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    result = autoaccum.fit(model, _SampleStream(x, y), 16, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                           epochs=2, budget="1MiB", progress=False, verbose=False)
    assert (result.plan_source, result.optimizer_steps, result.samples_seen) == ("probe", 8, 128)


def test_a_dataloader_of_single_samples_is_refused_naming_batch_size():
    x, y = mlp_data(128)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=None)
    _refused(ValueError, r"data is a DataLoader with batch_size=None: it yields single samples, not batches .*"
                         r"Pass batch_size=64 \(this rank's share of target_batch=64\).*data=loader.dataset",
             data=loader)
    # the fixes the message names train: the loader batched at the share, or its dataset
    for data in (torch.utils.data.DataLoader(loader.dataset, batch_size=64), loader.dataset):
        result = autoaccum.fit(Mlp(p=0.0), data, 64, plan=Plan.for_target(64, 16), progress=False, verbose=False)
        assert result.samples_seen == 128


def test_token_lists_of_different_lengths_are_refused_naming_collate_fn():
    """``[[1, 2, 3], [4, 5]]``: default_collate turned one sample into three "columns", then a TaskError about
    the default loss; now refused before any work with the lengths and the options named."""
    _refused(ValueError, r"data's samples differ in shape: sample 0 is a list of 3 \(a number, a number, a number\), "
                         r"sample 1 is a list of 2 .*collate_fn= that pads them.*length_fn=len", target=16,
             data=[[1, 2, 3], [4, 5]] * 10)
    same = [[1, 2, 3], [4, 5, 6]] * 10  # the negative control: sequences of one length are stacked as before
    batches = GlobalBatches(same, 16)
    batches.check()
    assert [t.shape for t in batches.sample(4)] == [torch.Size([4])] * 3


def test_eval_data_of_another_shape_is_refused_before_training_naming_both_shapes():
    """eval X of (16, 7) against training X of (64, 6) met "mat1 and mat2 shapes cannot be multiplied" after
    training steps had run."""
    x, y = mlp_data(16)
    _refused(ValueError, r"eval_data's batches differ from data's: eval_data\[0\] is a torch.float32 tensor of shape "
                         r"\[\*, 7\], data\[0\] is a torch.float32 tensor of shape \[\*, 6\]",
             eval_data=(torch.randn(16, 7), y))
    _refused(ValueError, r"eval_data\[0\] is a torch.float64 tensor of shape \[\*, 6\], data\[0\] is a torch.float32",
             eval_data=(x.double(), y))
    _refused(ValueError, r"eval_data is a DataLoader with batch_size=None",
             eval_data=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=None))
    # the negative control: another kind of the same samples (a dataset, collated as a list) is evaluated
    model = Mlp(p=0.0)
    result = autoaccum.fit(model, mlp_data(128), 64, eval_data=torch.utils.data.TensorDataset(x, y),
                           plan=Plan.for_target(64, 16), progress=False, verbose=False)
    with torch.no_grad():
        expected = float(F.cross_entropy(model(x), y))
    assert result.eval_loss == pytest.approx(expected, rel=1e-5)  # fp32: one mean, cut in micro-batches


def test_a_generator_whose_first_batch_is_below_the_share_is_refused_naming_target_batch():
    """A generator of 100-sample batches for target_batch=256 met "the probe needs 215 samples but the data's
    batches hold 100" after the probe's first passes, with no word of target_batch. Its length is unknown, so a
    short first batch is not the epoch's last: refused before any work. Control: batches of the share train."""
    x, y = mlp_data(512)

    def batches(size):
        return ((x[i:i + size], y[i:i + size]) for i in range(0, 512, size))

    _refused(ValueError, r"a first batch of 32 samples, but target_batch is 64 .*pass target_batch=32",
             data=batches(32))
    result = autoaccum.fit(Mlp(p=0.0), batches(64), 64, loss_fn=cross_entropy, plan=Plan.for_target(64, 16),
                           progress=False)
    assert result.optimizer_steps == 8
