"""The models of the real-GPU benchmark, their synthetic data and the memory each row is squeezed to.

Built from configs (no download), seeded. The default rows (:func:`workloads`): GPT-2 124M at 512
tokens (padded, token-level loss), ResNet-50 and ViT-B/16 at 224 px, a 134M MLP; kept on the host and
copied to the device for each run. The issue40 rows (:func:`rows40`): ResNet-50 and ViT-B/16 in fp32 and
bf16, GPT-2 355M in bf16 at 1024 tokens, a 1.1B Llama-style decoder (TinyLlama's shape) in bf16 with a
LoRA adapter at 2048 tokens; each built once on the device and kept there (:func:`fresh_model`). Budgets
make the target take 2 to 5 micro-steps. Size ``cpu``: the same architectures from small configs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoaccum.plan.batchnorm import smallest_micro_batch

__all__ = ["GIB", "MIB", "Built", "Workload", "build", "fresh_model", "missing_dependency", "rows40",
           "workloads"]

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
        precision: the run's precision (``fp32``, or ``bf16`` autocast), for the probe, brute force,
            fit, the hand-written loop and the sweep alike.
        on_device: built once on the device and kept there for the whole row (the issue40 rows).
        loop_steps: optimizer steps of each run of fit and of the hand-written loop in their
            comparison (the first two of each run are left out of its rate).
    """

    name: str
    describe: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int, int], Batch]
    target_batch: int
    budget_bytes: int
    needs: str | None = "transformers"
    precision: str = "fp32"
    on_device: bool = False
    loop_steps: int = 8


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return factory()
    return make


def _tokens(seq_len: int, vocab: int, pad: int, full: bool = False) -> Callable[[int, int], Batch]:
    """Rows of seq_len/4..seq_len tokens right-padded to seq_len (``padding="max_length"``); labels are the
    tokens, -100 on padding: the model's causal-LM loss counts only real tokens (token-level). ``full``:
    every row seq_len tokens (packed sequences), no attention mask."""
    def make(num: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        if full:
            ids = torch.randint(0, vocab, (num, seq_len), generator=g)
            return {"input_ids": ids, "labels": ids.clone()}
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


def _lora(dtype: torch.dtype, **config: Any) -> Callable[[], nn.Module]:
    """A Llama-style decoder from ``LlamaConfig(**config)``, its weights in ``dtype``, with a LoRA adapter on
    every linear layer of its blocks (the adapter's weights fp32: peft's default under a bf16 model)."""
    def make() -> nn.Module:
        import transformers
        from peft import LoraConfig, get_peft_model

        transformers.logging.set_verbosity_error()
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(dtype)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        return get_peft_model(base, lora)
    return _seeded(make)


def rows40(size: str) -> dict[str, Workload]:
    """The issue40 rows at ``size`` (``gpu`` or ``cpu``): the models people bring."""
    resnet = {"num_labels": 1000}
    vit = {"num_labels": 1000}
    gpt2 = {"n_embd": 1024, "n_layer": 24, "n_head": 16}
    llama = {"hidden_size": 2048, "num_hidden_layers": 22, "intermediate_size": 5632, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}
    side, classes, gpt_len, llama_len, gib = 224, 1000, 1024, 2048, GIB
    if size == "cpu":
        resnet = {"embedding_size": 8, "hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1], "num_labels": 10}
        vit = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
               "image_size": 32, "patch_size": 8, "num_labels": 10}
        gpt2 = {"vocab_size": 128, "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2}
        llama = {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 32}
        side, classes, gpt_len, llama_len, gib = 32, 10, 32, 32, MIB
    elif size != "gpu":
        raise ValueError(f"Invalid size: {size!r}. Allowed values: gpu, cpu")
    # gpu budgets: sized from each model's bytes a sample (fake-tensor estimates and the 2026-11 H200 runs) so
    # that the target takes 2 to 5 micro-steps; at cpu size a few MiB, under the emulated budget.
    budgets = {"resnet50": 4, "vit_b16": 6, "gpt2_355m": 16, "llama": 20} if size == "gpu" else \
        {"resnet50": 3, "vit_b16": 2, "gpt2_355m": 2, "llama": 1}
    targets = {"resnet50": 128, "vit_b16": 128, "gpt2_355m": 16, "llama": 8} if size == "gpu" else \
        {"resnet50": 64, "vit_b16": 64, "gpt2_355m": 16, "llama": 8}
    rows = []
    for precision in ("fp32", "bf16"):
        rows.append(Workload(f"resnet50_{precision}", f"ResNet-50, {side} px, BatchNorm, {precision}",
                             _hf("ResNetConfig", "ResNetForImageClassification", **resnet), _images(side, classes),
                             targets["resnet50"], budgets["resnet50"] * gib, precision=precision, on_device=True))
        rows.append(Workload(f"vit_b16_{precision}", f"ViT-B/16, {side} px, {precision}",
                             _hf("ViTConfig", "ViTForImageClassification", **vit), _images(side, classes),
                             targets["vit_b16"], budgets["vit_b16"] * gib, precision=precision, on_device=True))
    rows.append(Workload("gpt2_355m_bf16", f"GPT-2 355M, {gpt_len} tokens (padded), token-level loss, bf16",
                         _hf("GPT2Config", "GPT2LMHeadModel", **gpt2), _tokens(gpt_len, gpt2.get("vocab_size", 50257),
                                                                              gpt2.get("vocab_size", 50257) - 1),
                         targets["gpt2_355m"], budgets["gpt2_355m"] * gib, precision="bf16", on_device=True))
    rows.append(Workload("llama_1b_lora_bf16", f"Llama-style 1.1B, bf16 weights, LoRA r16, {llama_len} tokens, bf16",
                         _lora(torch.bfloat16, **llama), _tokens(llama_len, llama["vocab_size"], 0, full=True),
                         targets["llama"], budgets["llama"] * gib, needs="peft", precision="bf16", on_device=True,
                         loop_steps=6))
    return {w.name: w for w in rows}


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
    for module in () if w.needs is None else ("transformers", w.needs):
        try:
            __import__(module)
        except ImportError as exc:
            return f"needs {module} ({exc}); pip install 'autoaccum[bench]'" + (" peft" if module == "peft" else "")
    return None


@dataclass
class Built:
    """A workload's host model (built once) and what every run derives from it."""

    workload: Workload
    base: nn.Module  # on the host, or on the device for an on_device workload
    smallest: int  # the smallest micro-batch the model trains at (2 with BatchNorm)

    @functools.cached_property
    def data(self) -> Batch:
        """The data ``fit`` trains on and the probe slices: twice the target batch, made once."""
        return self.workload.make_batch(2 * self.workload.target_batch, 1)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.base.parameters())


def build(w: Workload, device: torch.device | None = None) -> Built:
    """``w``'s model: on the host, or (an on_device workload, given its device) built on the device
    itself (random initialisation there takes a fraction of the host's time for a 1B model)."""
    with torch.device(device) if w.on_device and device is not None else contextlib.nullcontext():
        base = w.make_model()
    base.train()
    return Built(w, base, smallest_micro_batch(base))


def fresh_model(built: Built, device: torch.device) -> nn.Module:
    """A copy of the host model on ``device``: the same initial weights for every run. An on_device
    workload's model is too large to copy for every try (a 1.1B model): it is the model itself, already
    there. Its runs measure memory and speed, neither of which depends on the weights' values; each
    starts with a fresh optimizer and no gradients (the probe leaves no trace)."""
    if built.workload.on_device and next(built.base.parameters()).device == device:
        return built.base
    return copy.deepcopy(built.base).to(device)
