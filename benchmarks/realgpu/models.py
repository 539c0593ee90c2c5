"""The models of the real-GPU benchmark, their synthetic data and the memory each row is squeezed to.

Every model is built from a config (no download) with the same seed, kept on the host, and copied to
the device for each run (a fresh model for every brute-force try, probe and fit). Two sizes:

- ``gpu``: what issue 16 asks for. GPT-2 124M (``GPT2LMHeadModel`` with its default config), 512
  tokens right-padded (lengths 128..512), the model's own token-level loss; ResNet-50 at 224 px with
  BatchNorm (``ResNetForImageClassification``, default config); ViT-B/16 at 224 px
  (``ViTForImageClassification``, default config); the 134M MLP of ``compare.py --size gpu``
  (4096 -> 4096 x 8 -> 10). Each is squeezed to a few GiB so that its target batch needs
  accumulation and a step takes well under a second on an H100.
- ``cpu``: the same architectures from small configs, for the smoke test, under emulated budgets.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoaccum.batchnorm import smallest_micro_batch

__all__ = ["GIB", "MIB", "Built", "Workload", "build", "fresh_model", "missing_dependency", "workloads"]

MIB, GIB = 2**20, 2**30

Batch = Any  # a dict of tensors (Hugging Face models) or an (inputs, targets) tuple


@dataclass(frozen=True)
class Workload:
    """One model at one size.

    Attributes:
        name: the row's name (``gpt2``, ``resnet50``, ``vit_b16``, ``mlp``).
        describe: what the model is, for the table.
        make_model: ``make_model()`` -> a fresh model on the host, the same weights every call.
        make_batch: ``make_batch(b, seed)`` -> ``b`` samples on the host.
        target_batch: the global batch every plan covers exactly.
        budget_bytes: the memory each squeeze leaves this process (the same in all three squeezes,
            so that their limits can be compared).
        needs: the module the model needs beyond torch (``transformers``), or None.
    """

    name: str
    describe: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int, int], Batch]
    target_batch: int
    budget_bytes: int
    needs: str | None = "transformers"


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return factory()
    return make


def _tokens(seq_len: int, vocab: int, pad: int) -> Callable[[int, int], Batch]:
    """Rows of seq_len/4..seq_len tokens right-padded to seq_len (``padding="max_length"``); labels are the
    tokens, -100 on padding: the model's causal-LM loss counts only real tokens (token-level)."""
    def make(num: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(seq_len // 4, seq_len + 1, (num,), generator=g)
        mask = (torch.arange(seq_len) < lengths[:, None]).long()
        ids = torch.randint(0, vocab, (num, seq_len), generator=g).masked_fill(mask == 0, pad)
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return make


def _images(side: int, classes: int) -> Callable[[int, int], Batch]:
    def make(num: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(num, 3, side, side, generator=g),
                "labels": torch.randint(0, classes, (num,), generator=g)}
    return make


def _vectors(width: int, classes: int) -> Callable[[int, int], Batch]:
    def make(num: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(num, width, generator=g), torch.randint(0, classes, (num,), generator=g)
    return make


def _mlp(in_dim: int, width: int, depth: int) -> nn.Module:
    from headtohead.workloads import MLP  # compare.py's model: the same 134M MLP at size gpu

    return MLP(in_dim, width, depth)


def _hf(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        transformers.logging.set_verbosity_error()  # the note that the config names no loss_type
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
    return _seeded(make)


def workloads(size: str) -> dict[str, Workload]:
    """The four models at ``size`` (``gpu`` or ``cpu``)."""
    if size == "gpu":
        # Budgets where a fake-tensor estimate (on a CPU) puts the limit near 10 (gpt2), 106 (resnet50), 68 (vit_b16)
        # and 9,500 (mlp): every target takes 2 to 4 micro-steps, and a step well under a second on an H100.
        return {w.name: w for w in (
            Workload("gpt2", "GPT-2 124M, 512 tokens (padded), token-level loss",
                     _hf("GPT2Config", "GPT2LMHeadModel"), _tokens(512, 50257, 50256), 32, 16 * GIB),
            Workload("resnet50", "ResNet-50, 224 px, BatchNorm",
                     _hf("ResNetConfig", "ResNetForImageClassification", num_labels=1000), _images(224, 1000), 256,
                     10 * GIB),
            Workload("vit_b16", "ViT-B/16, 224 px", _hf("ViTConfig", "ViTForImageClassification", num_labels=1000),
                     _images(224, 1000), 256, 10 * GIB),
            Workload("mlp", "MLP 4096 -> 4096 x 8 -> 10 (134M)", _seeded(lambda: _mlp(4096, 4096, 8)),
                     _vectors(4096, 10), 16384, 4 * GIB, needs=None),
        )}
    if size == "cpu":
        return {w.name: w for w in (
            Workload("gpt2", "GPT-2 1 x 32, 32 tokens (padded), token-level loss",
                     _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=128, n_positions=32, n_embd=32, n_layer=1,
                         n_head=2), _tokens(32, 128, 0), 16, 2 * MIB),
            Workload("resnet50", "ResNet (bottleneck) 8-64 channels, 32 px, BatchNorm",
                     _hf("ResNetConfig", "ResNetForImageClassification", embedding_size=8,
                         hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10),
                     _images(32, 10), 64, 3 * MIB),
            Workload("vit_b16", "ViT 2 x 32, 32 px, patch 8", _hf(
                "ViTConfig", "ViTForImageClassification", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, image_size=32, patch_size=8, num_labels=10), _images(32, 10), 64, 2 * MIB),
            Workload("mlp", "MLP 64 -> 64 x 2 -> 10", _seeded(lambda: _mlp(64, 64, 2)), _vectors(64, 10), 128,
                     256 * 2**10, needs=None),
        )}
    raise ValueError(f"Invalid size: {size!r}. Allowed values: gpu, cpu")


def missing_dependency(w: Workload) -> str | None:
    """Why ``w`` cannot be built here (its module is missing), or None."""
    if w.needs is None:
        return None
    try:
        __import__(w.needs)
    except ImportError as exc:
        return f"needs {w.needs} ({exc}); pip install 'autoaccum[bench]'"
    return None


@dataclass
class Built:
    """A workload's host model (built once) and what every run derives from it."""

    workload: Workload
    base: nn.Module
    smallest: int  # the smallest micro-batch the model trains at (2 with BatchNorm)

    @functools.cached_property
    def data(self) -> Batch:
        """The data ``fit`` trains on and the probe slices: twice the target batch, made once."""
        return self.workload.make_batch(2 * self.workload.target_batch, 1)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.base.parameters())


def build(w: Workload) -> Built:
    base = w.make_model()
    base.train()
    return Built(w, base, smallest_micro_batch(base))


def fresh_model(built: Built, device: torch.device) -> nn.Module:
    """A copy of the host model on ``device``: the same initial weights for every run."""
    return copy.deepcopy(built.base).to(device)
