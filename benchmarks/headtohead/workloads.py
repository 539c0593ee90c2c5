"""The models, their data and loss, and what every system shares: slicing, the device copy, AdamW."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from common import mlp
from torch import nn

from autoaccum.demo import TinyGPT

LR = 1e-3

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


def workloads(size: str) -> dict[str, Workload]:
    """``tiny`` (the smoke test), ``cpu`` (default: a few minutes on 2 cores) or ``gpu`` (real memory).

    ``gpt_long`` is the workload where one sample does not fit without activation checkpointing; it runs
    only when named (``--models gpt_long``)."""
    def seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            torch.manual_seed(0)
            return factory()
        return make

    if size == "tiny":
        return {
            "mlp": Workload("mlp", seeded(lambda: mlp(32, 16, 4)), _classification_data((32,)), 64, 19),
            "gpt": Workload("gpt", seeded(lambda: TinyGPT(vocab_size=32, seq_len=16, dim=16, layers=1, heads=2)),
                            _token_data(16, 32), 32, 7, token_level=True),
            "cnn": Workload("cnn", seeded(lambda: ConvBN(4, 8)), _classification_data((3, 8, 8)), 32, 7,
                            batchnorm=True),
            "gpt_long": Workload("gpt_long", seeded(lambda: TinyGPT(vocab_size=32, seq_len=128, dim=16, layers=8,
                                                                    heads=2)),
                                 _token_data(128, 32), 4, 2, token_level=True, saver="checkpointing"),
        }
    if size == "cpu":
        return {
            "mlp": Workload("mlp", seeded(lambda: mlp(256, 128, 6)), _classification_data((256,)), 1024, 230,
                            note="256-128x6-10, ReLU"),
            "gpt": Workload("gpt", seeded(lambda: TinyGPT(vocab_size=256, seq_len=32, dim=64, layers=2, heads=4)),
                            _token_data(32, 256), 64, 13, token_level=True,
                            note="TinyGPT 2 layers x 64, 32 tokens, lengths 8..32 padded; token-level loss"),
            "cnn": Workload("cnn", seeded(lambda: ConvBN(16, 16)), _classification_data((3, 16, 16)), 128, 27,
                            batchnorm=True, note="2 conv+BatchNorm blocks, 16x16 images"),
            "gpt_long": Workload("gpt_long", seeded(lambda: TinyGPT(vocab_size=64, seq_len=384, dim=32, layers=6,
                                                                    heads=2)),
                                 _token_data(384, 64), 8, 2, token_level=True, saver="checkpointing",
                                 note="TinyGPT 6 layers x 32, 384 tokens, lengths 96..384 padded; one sample "
                                      "does not fit without checkpointing"),
        }
    if size == "gpu":  # not exercised on the CPU-only machines this was written on
        return {
            "mlp": Workload("mlp", seeded(lambda: mlp(4096, 4096, 8)), _classification_data((4096,)), 16384, 3600),
            "gpt": Workload("gpt", seeded(lambda: TinyGPT(vocab_size=32000, seq_len=1024, dim=1024, layers=12,
                                                          heads=16)),
                            _token_data(1024, 32000), 256, 23, token_level=True),
            "cnn": Workload("cnn", seeded(lambda: ConvBN(128, 32)), _classification_data((3, 32, 32)), 4096, 900,
                            batchnorm=True),
            "gpt_long": Workload("gpt_long", seeded(lambda: TinyGPT(vocab_size=8192, seq_len=4096, dim=768, layers=12,
                                                                    heads=12)),
                                 _token_data(4096, 8192), 16, 3, token_level=True, saver="checkpointing"),
        }
    raise ValueError(f"Invalid size: {size!r}. Allowed values: tiny, cpu, gpu")


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
