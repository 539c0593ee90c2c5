"""The rows of the real-GPU benchmark: the models people bring, their synthetic data and the memory each
row is squeezed to.

Built from configs (no download), seeded, on the device itself, and kept there for the whole row:
ResNet-50 and ViT-B/16 in fp32 and bf16, GPT-2 355M in bf16 at 1024 tokens, a 1.1B Llama-style
decoder (TinyLlama's shape) in bf16 with a LoRA adapter at 2048 tokens. Budgets make the target take
2 to 5 micro-steps. Size ``cpu``: the same architectures from small configs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from common import seeded
from torch import nn

from autoaccum.plan.batchnorm import smallest_micro_batch

__all__ = ["GIB", "MIB", "Built", "Workload", "build", "missing_dependency", "rows"]

MIB, GIB = 2**20, 2**30

Batch = dict[str, torch.Tensor]  # a Hugging Face model's inputs and labels


@dataclass(frozen=True)
class Workload:
    """One model at one size."""

    name: str  # the row's name (``resnet50_fp32``, ..., ``llama_1b_lora_bf16``)
    describe: str  # what the model is, for the table
    make_model: Callable[[], nn.Module]  # a fresh model, the same weights every call
    make_batch: Callable[[int, int], Batch]  # ``make_batch(b, seed)``: ``b`` samples on the host
    target_batch: int  # the global batch every plan covers exactly
    budget_bytes: int  # the memory the squeeze leaves this process
    needs: str | None = "transformers"  # the module the model needs beyond torch, or None
    #: the run's precision (``fp32``, or ``bf16`` autocast) for the probe, brute force, fit, the hand loop, the sweep
    precision: str = "fp32"
    #: optimizer steps of each run of fit and of the hand loop in their comparison (the first two not timed)
    loop_steps: int = 8


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


def _hf(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        transformers.logging.set_verbosity_error()  # the note that the config names no loss_type
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
    return seeded(make)


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
    return seeded(make)


def rows(size: str) -> dict[str, Workload]:
    """The rows at ``size`` (``gpu`` or ``cpu``)."""
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
    # (target, budget) a row; gpu budgets sized from each model's bytes a sample (fake-tensor estimates and the
    # 2026-11 H200 runs) so that the target takes 2 to 5 micro-steps; at cpu size a few MiB, emulated
    resnet_at, vit_at, gpt2_at, llama_at = ((128, 4), (128, 6), (16, 16), (8, 20)) if size == "gpu" else \
        ((64, 3), (64, 2), (16, 2), (8, 1))
    vocab = gpt2.get("vocab_size", 50257)
    out = [Workload(f"{name}_{precision}", f"{label}, {side} px{', BatchNorm' * (kind == 'ResNet')}, {precision}",
                    _hf(f"{kind}Config", f"{kind}ForImageClassification", **config), _images(side, classes), at[0],
                    at[1] * gib, precision=precision)
           for precision in ("fp32", "bf16")
           for name, label, kind, config, at in (("resnet50", "ResNet-50", "ResNet", resnet, resnet_at),
                                                 ("vit_b16", "ViT-B/16", "ViT", vit, vit_at))]
    out.append(Workload("gpt2_355m_bf16", f"GPT-2 355M, {gpt_len} tokens (padded), token-level loss, bf16",
                        _hf("GPT2Config", "GPT2LMHeadModel", **gpt2), _tokens(gpt_len, vocab, vocab - 1),
                        gpt2_at[0], gpt2_at[1] * gib, precision="bf16"))
    out.append(Workload("llama_1b_lora_bf16", f"Llama-style 1.1B, bf16 weights, LoRA r16, {llama_len} tokens, bf16",
                        _lora(torch.bfloat16, **llama), _tokens(llama_len, llama["vocab_size"], 0, full=True),
                        llama_at[0], llama_at[1] * gib, needs="peft", precision="bf16", loop_steps=6))
    return {w.name: w for w in out}


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
    """A row's model, built once on the device, and what every run derives from it. Every run (the probe,
    brute force, fit, the hand loop, the sweep) trains this model itself: a 1.1B model is too large to copy
    for every try, and the runs measure memory and speed, neither of which depends on the weights' values;
    each starts with a fresh optimizer and no gradients."""

    workload: Workload
    model: nn.Module
    smallest: int  # the smallest micro-batch the model trains at (2 with BatchNorm)

    @functools.cached_property
    def data(self) -> Batch:
        """The data ``fit`` trains on and the probe slices: twice the target batch, made once."""
        return self.workload.make_batch(2 * self.workload.target_batch, 1)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def clear_grads(self) -> None:
        """Drop the gradients a run left (an OOM's partial ones too)."""
        for p in self.model.parameters():
            p.grad = None


def build(w: Workload, device: torch.device) -> Built:
    """``w``'s model, built on ``device`` itself (random initialisation there takes a fraction of the
    host's time for a 1B model)."""
    with torch.device(device):
        model = w.make_model()
    model.train()
    return Built(w, model, smallest_micro_batch(model))
