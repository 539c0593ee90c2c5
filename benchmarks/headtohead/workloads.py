"""The models, their data and loss, and what every system shares: slicing, the device copy, AdamW."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from common import mlp, seeded
from torch import nn

from autoaccum.demo import TinyGPT

LR = 1e-3
#: the shares of the blocks that must be checkpointed for ``micro_target`` samples at ``gpt_blocks``' budgets
SHARES = (0.25, 0.5, 1.0)

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """One model, its data and its loss.

    ``loss_sum(model, batch) -> (sum, count)``: the summed loss and the number of items (samples, or
    non-padding tokens). Every system gets this loss in the form its API takes: autoaccum the pair
    (token-exact), the peers ``sum / count`` (a mean per micro-batch) or Trainer's token count path.
    """

    name: str
    make_model: Callable[[], nn.Module]
    make_data: Callable[[int], Batch]
    target_batch: int
    micro_target: int  # the budget lets a plain accumulation loop fit exactly this micro-batch
    token_level: bool = False
    batchnorm: bool = False
    note: str = ""
    #: the memory saver (``autoaccum.memory.savers``) a plain loop needs under the budget:
    #: ``"checkpointing"`` where one sample does not fit without it (``micro_target`` is then counted with it)
    saver: str = "none"
    #: one budget each (``budget.blocks_budget``): this share of the blocks must be checkpointed for micro_target
    block_shares: tuple[float, ...] = ()


class ConvBN(nn.Module):
    def __init__(self, channels: int, side: int) -> None:
        super().__init__()
        c = channels
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * c * (side // 4) ** 2, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _classification_data(shape: tuple[int, ...]) -> Callable[[int], Batch]:
    def make(n: int) -> Batch:
        g = torch.Generator().manual_seed(1234)
        return {"ids": torch.arange(n), "x": torch.randn(n, *shape, generator=g),
                "labels": torch.randint(0, 10, (n,), generator=g)}
    return make


def _token_data(seq_len: int, vocab: int) -> Callable[[int], Batch]:
    """Padded variable-length sequences: inputs padded with token 0, labels -100 past each length."""
    def make(n: int) -> Batch:
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab
        lengths = torch.randint(seq_len // 4, seq_len + 1, (n,), generator=g)  # tokens predicted per row
        keep = torch.arange(seq_len) < lengths[:, None]
        return {"ids": torch.arange(n), "x": torch.where(keep, seq[:, :-1], 0),
                "labels": torch.where(keep, seq[:, 1:], -100)}
    return make


def loss_sum(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over the items of ``batch`` and their count (-100 labels excluded)."""
    logits = model(batch["x"])
    labels = batch["labels"]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, labels.ne(-100).sum()


def _gpt(name: str, vocab: int, seq: int, dim: int, layers: int, heads: int, target: int, micro: int,
         **kwargs: Any) -> Workload:
    """A seeded TinyGPT on padded token sequences (a token-level loss)."""
    return Workload(name, seeded(lambda: TinyGPT(vocab_size=vocab, seq_len=seq, dim=dim, layers=layers, heads=heads)),
                    _token_data(seq, vocab), target, micro, token_level=True, **kwargs)


def workloads(size: str) -> dict[str, Workload]:
    """``tiny`` (the smoke test), ``cpu`` (default: a few minutes on 2 cores) or ``gpu`` (real memory).

    ``gpt_long`` is the workload where one sample does not fit without activation checkpointing, ``gpt_blocks``
    the one whose budgets need a quarter, half and all of its blocks checkpointed for its micro_target; they run
    only when named (``--models gpt_long gpt_blocks``)."""
    long, blocks = {"saver": "checkpointing"}, {"saver": "checkpointing", "block_shares": SHARES}
    if size == "tiny":
        named = [Workload("mlp", seeded(lambda: mlp(32, 16, 4)), _classification_data((32,)), 64, 19),
                 _gpt("gpt", 32, 16, 16, 1, 2, 32, 7),
                 Workload("cnn", seeded(lambda: ConvBN(4, 8)), _classification_data((3, 8, 8)), 32, 7, batchnorm=True),
                 _gpt("gpt_long", 32, 128, 16, 8, 2, 4, 2, **long),
                 _gpt("gpt_blocks", 32, 128, 16, 8, 2, 4, 1, **blocks)]
    elif size == "cpu":
        named = [Workload("mlp", seeded(lambda: mlp(256, 128, 6)), _classification_data((256,)), 1024, 230,
                          note="256-128x6-10, ReLU"),
                 _gpt("gpt", 256, 32, 64, 2, 4, 64, 13,
                      note="TinyGPT 2 layers x 64, 32 tokens, lengths 8..32 padded; token-level loss"),
                 Workload("cnn", seeded(lambda: ConvBN(16, 16)), _classification_data((3, 16, 16)), 128, 27,
                          batchnorm=True, note="2 conv+BatchNorm blocks, 16x16 images"),
                 _gpt("gpt_long", 64, 384, 32, 6, 2, 8, 2, **long, note="TinyGPT 6 layers x 32, 384 tokens, lengths "
                      "96..384 padded; one sample does not fit without checkpointing"),
                 _gpt("gpt_blocks", 64, 256, 32, 8, 2, 16, 4, **blocks,
                      note="TinyGPT 8 layers x 32, 256 tokens, lengths 64..256 padded")]
    elif size == "gpu":  # not exercised on the CPU-only machines this was written on
        named = [Workload("mlp", seeded(lambda: mlp(4096, 4096, 8)), _classification_data((4096,)), 16384, 3600),
                 _gpt("gpt", 32000, 1024, 1024, 12, 16, 256, 23),
                 Workload("cnn", seeded(lambda: ConvBN(128, 32)), _classification_data((3, 32, 32)), 4096, 900,
                          batchnorm=True),
                 _gpt("gpt_long", 8192, 4096, 768, 12, 12, 16, 3, **long),
                 _gpt("gpt_blocks", 8192, 4096, 768, 12, 12, 16, 4, **blocks)]
    else:
        raise ValueError(f"Invalid size: {size!r}. Allowed values: tiny, cpu, gpu")
    return {w.name: w for w in named}


def describe_model(model: nn.Module) -> str:
    return f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters"


def slice_batch(data: Batch, start: int, stop: int) -> Batch:
    return {k: v[start:stop] for k, v in data.items()}


def on_device(batch: Batch, device: torch.device) -> Batch:
    """The micro-batch as the step's device holds it: on CUDA a copy made by ``.to``; on CPU a clone,
    so that the emulated device pays for it as the peers pay for their collated micro-batches (slices
    of the data are views and would cost nothing)."""
    return {k: v.to(device) if device.type == "cuda" else v.clone() for k, v in batch.items()}


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of every system and of the reference: AdamW, lr 1e-3, no weight decay."""
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
