"""The loss contract's mistakes named before any work (issue 45): they met a raw torch error from inside the model or
autograd. Each through ``fit`` as a user meets it, with a negative control that trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoaccum
from autoaccum import TaskError


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 20, generator=g), torch.randint(0, 2, (32,), generator=g)


def ce(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


OPTIONS = {"target_batch": 16, "epochs": 1, "budget": "1MiB", "verbose": False}


class TwoOutputs(nn.Module):
    """Returns (scores, an auxiliary value), as many research models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x), x.pow(2).mean()


def test_a_tuple_output_with_the_default_loss_names_the_elements_and_the_loss_to_write():
    """It was ``cross_entropy_loss(): argument 'input' must be Tensor, not tuple``. The first element is not taken
    on a guess (it may be hidden states); the message shows the elements' shapes and the loss_fn to pass."""
    with pytest.raises(TaskError, match=r"returned a tuple of 2 \(\(\d+, 2\), \(\)\).*model\(batch\[0\]\)\[0\]"):
        autoaccum.fit(TwoOutputs(), data(), **OPTIONS)
    result = autoaccum.fit(TwoOutputs(), data(), loss_fn=lambda m, b: F.cross_entropy(m(b[0])[0], b[1]), **OPTIONS)
    assert result.optimizer_steps == 2  # the control: the loss the message names trains


def test_integer_features_to_a_linear_layer_are_named_with_the_conversion():
    """``mat1 and mat2 must have the same dtype, but got Long and Float`` from inside nn.Linear, raised by the probe:
    the batch's int64 tensors are named, with x.float() and nn.Embedding."""
    x, y = data()
    with pytest.raises(TaskError, match=r"int64 tensors that reached a layer of floating parameters.*x\.float\(\).*"
                                        r"nn\.Embedding"):
        autoaccum.fit(mlp(), ((x * 3).long(), y), loss_fn=ce, **OPTIONS)
    assert autoaccum.fit(mlp(), ((x * 3).long().float(), y), loss_fn=ce, **OPTIONS).optimizer_steps == 2


def test_a_loss_fn_that_calls_backward_itself_is_named():
    """``Trying to backward through the graph a second time`` from autograd: the loss_fn ran backward, and the step
    would run it again."""
    def own_backward(model, batch):
        loss = ce(model, batch)
        loss.backward()
        return loss

    with pytest.raises(TaskError, match=r"backpropagated twice.*not call \.backward\(\) itself"):
        autoaccum.fit(mlp(), data(), loss_fn=own_backward, **OPTIONS)
    guard = autoaccum.OOMGuard(model := mlp(), torch.optim.SGD(model.parameters(), lr=0.1), target_batch=16,
                               micro_batch=8)
    with pytest.raises(TaskError, match=r"backpropagated twice"):
        guard.step(tuple(t[:16] for t in data()), own_backward)
    assert guard.step(tuple(t[:16] for t in data()), ce).micro_steps == 2  # the control


def test_a_summed_loss_is_warned_about_by_the_probe_and_a_mean_or_a_pair_is_not():
    """``reduction="sum"`` returned alone is read as a mean: the step trains at micro-batch times the lr. The probe's
    losses at its sizes grow with the size: a warning naming reduction='mean' and (loss_sum, num_items)."""
    def summed(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")

    with pytest.warns(UserWarning, match=r"grew with the micro-batch.*looks summed.*reduction='mean'.*"
                                         r"\(loss_sum, num_items\)"):
        autoaccum.fit(mlp(), data(), loss_fn=summed, **OPTIONS)

    def pair(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="sum"), batch[1].numel()

    import warnings

    for loss_fn in (ce, pair):  # the negative controls: a mean, and a sum with its count
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*grew with the micro-batch.*")
            autoaccum.fit(mlp(), data(), loss_fn=loss_fn, **OPTIONS)
