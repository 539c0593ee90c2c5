"""The memory savers (autoaccum.memory.savers): each gives the gradients of the step without
it (fp64, 1e-12), draws the same dropout masks, updates BatchNorm running statistics once per forward,
and handles tied and frozen weights as without it. Each property with a negative control: plain
``torch.utils.checkpoint`` updates the statistics twice; without the RNG state kept the masks differ.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoaccum.memory.savers import SAVERS, allowed_savers, apply_saver, checkpoint_layers, next_saver, suggestions

TIGHT = {"rtol": 1e-12, "atol": 1e-14}


class Block(nn.Module):
    """A residual block with BatchNorm (running statistics), dropout and a LoRA-style adapter: a frozen
    base weight and a trainable low-rank update."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(dim)
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)  # frozen, as under LoRA
        self.lora_a = nn.Parameter(torch.randn(4, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, 4) * 0.1)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.transpose(1, 2)).transpose(1, 2)
        h = self.base(h) + h @ self.lora_a.t() @ self.lora_b.t()
        return x + self.drop(torch.tanh(h))


class Net(nn.Module):
    """Blocks in an ``nn.ModuleList`` between an embedding and a head whose weight is the embedding's (tied)."""

    def __init__(self, vocab: int = 11, dim: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _step(model: nn.Module, saver: str, seed: int = 5) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One forward/backward on ``saver`` from a fixed RNG state: the gradients and the buffers after it."""
    ids = torch.randint(0, 11, (6, 7), generator=torch.Generator().manual_seed(1))
    model.train()
    with apply_saver(model, saver):
        torch.manual_seed(seed)
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {n: b.detach().clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("saver", ["checkpointing:1/3", "checkpointing:2/3", "checkpointing"])
def test_checkpointing_gives_the_same_gradients_masks_and_statistics(saver: str) -> None:
    """For every count of blocks checkpointed (1 and 2 of 3, and all)."""
    want_grads, want_buffers = _step(_net(), "none")
    grads, buffers = _step(_net(), saver)
    assert grads.keys() == want_grads.keys() and "blocks.0.base.weight" not in grads  # frozen stays frozen
    assert "embed.weight" in grads  # tied: one gradient, from the embedding and the head
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, **TIGHT, msg=name)
    for name, b in want_buffers.items():
        torch.testing.assert_close(buffers[name], b, **TIGHT, msg=name)
    assert int(buffers["blocks.0.norm.num_batches_tracked"]) == 1  # one forward: one update


def test_negative_control_plain_checkpoint_updates_batchnorm_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the buffers put back around the recomputation (plain ``torch.utils.checkpoint``), the
    running statistics are updated again in backward: the comparison above would fail. With 1 of 3 blocks
    checkpointed, only the first block's statistics are updated twice: the others run as written."""
    import autoaccum.memory.savers as savers

    monkeypatch.setattr(savers, "_context_fn", lambda module: (lambda: (contextlib.nullcontext(),
                                                                         contextlib.nullcontext())))
    _, want_buffers = _step(_net(), "none")
    _, buffers = _step(_net(), "checkpointing")
    assert int(buffers["blocks.0.norm.num_batches_tracked"]) == 2
    assert not torch.allclose(buffers["blocks.0.norm.running_mean"], want_buffers["blocks.0.norm.running_mean"])
    _, buffers = _step(_net(), "checkpointing:1/3")
    assert [int(buffers[f"blocks.{i}.norm.num_batches_tracked"]) for i in range(3)] == [2, 1, 1]


def test_negative_control_without_the_rng_state_the_dropout_masks_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.checkpoint as ckpt

    real = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda *a, **k: real(*a, **{**k, "preserve_rng_state": False}))
    want_grads, _ = _step(_net(), "none")
    grads, _ = _step(_net(), "checkpointing")
    assert not torch.allclose(grads["blocks.0.lora_a"], want_grads["blocks.0.lora_a"], rtol=1e-6, atol=1e-9)


def test_the_saver_is_taken_off_afterwards_and_keeps_no_memory_of_activations() -> None:
    model = _net()
    layers = checkpoint_layers(model)
    assert layers is model.blocks
    with apply_saver(model, "checkpointing"):
        assert all("forward" in block.__dict__ for block in model.blocks)
    assert all("forward" not in block.__dict__ for block in model.blocks)
    # what the saver is for: the blocks' activations are not kept for backward
    from autoaccum.memory import TrackedMemory

    peaks = {}
    for saver in ("none", "checkpointing"):
        m = Net(dim=64, depth=6).double()
        ids = torch.randint(0, 11, (16, 64))
        with TrackedMemory().track(m) as mem, apply_saver(m, saver):
            loss = m(ids).sum()
            peaks[saver] = mem.current_bytes
            loss.backward()
    assert peaks["checkpointing"] < 0.6 * peaks["none"], peaks


def test_partial_checkpointing_wraps_the_first_blocks_and_saves_in_proportion() -> None:
    """``checkpointing:k/N`` wraps the first ``k`` blocks (backward reaches them last, so their recomputation
    adds nothing to the peak) and keeps their activations out of memory: the live bytes at the end of the
    forward fall by about the same amount for each block checkpointed."""
    model = _net()
    with apply_saver(model, "checkpointing:2/3"):
        assert ["forward" in block.__dict__ for block in model.blocks] == [True, True, False]
    assert all("forward" not in block.__dict__ for block in model.blocks)
    from autoaccum.memory import TrackedMemory

    live = {}
    for k in (0, 1, 2, 4, 8):
        m = Net(dim=64, depth=8).double()
        ids = torch.randint(0, 11, (16, 64))
        saver = "none" if k == 0 else "checkpointing" if k == 8 else f"checkpointing:{k}/8"
        with TrackedMemory().track(m) as mem, apply_saver(m, saver):
            loss = m(ids).sum()
            live[k] = mem.current_bytes
            loss.backward()
    per_block = (live[0] - live[8]) / 8
    for k in (1, 2, 4):
        assert abs((live[0] - live[k]) - k * per_block) < 0.05 * per_block * k, (k, live)


def test_a_partial_saver_names_its_blocks_and_refuses_another_model() -> None:
    with pytest.raises(ValueError, match="checkpoints 2 of 4 blocks, but Net has 3"):
        with apply_saver(_net(), "checkpointing:2/4"):
            pass
    for bad in ("checkpointing:0/3", "checkpointing:3/3", "checkpointing:x/3"):
        with pytest.raises(ValueError, match="Invalid saver"):
            with apply_saver(_net(), bad):
                pass


def test_a_hugging_face_model_uses_its_own_switch_with_the_same_gradients() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=31, n_positions=16,
                                     resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)

    def run(saver: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).double().train()
        ids = torch.randint(0, 31, (3, 12), generator=torch.Generator().manual_seed(2))
        state = "is_activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") \
            else "is_gradient_checkpointing"
        with apply_saver(model, saver):
            assert getattr(model, state) == (saver != "none")
            torch.manual_seed(9)
            model(input_ids=ids, labels=ids).loss.backward()
        assert not getattr(model, state)  # switched off again
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = run("none"), run("checkpointing")
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, **TIGHT, msg=name)
    # its own switch is all or nothing: no partial saver is offered (the loss in chunks below it, a causal LM's own
    # loss: tests/memory/test_chunked_loss.py), and one given is refused
    model = transformers.GPT2LMHeadModel(config)
    assert allowed_savers(model, torch.device("cpu")) == ("none", "chunked_loss", "checkpointing+chunked_loss")
    with pytest.raises(ValueError, match="own switch"):
        with apply_saver(model, "checkpointing:1/2"):
            pass


def test_the_savers_follows_the_model_the_device_and_the_option() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    partial = ("checkpointing:1/3", "checkpointing:2/3")  # k doubling below N
    assert allowed_savers(_net(), cpu) == ("none", *partial, "checkpointing")
    assert allowed_savers(_net(), cuda) == ("none", *partial, "checkpointing", "offload")  # offload needs CUDA
    assert allowed_savers(_net(), cuda, "off") == ("none",)
    assert allowed_savers(_net(), cuda, ("checkpointing",)) == ("none", *partial, "checkpointing")
    assert allowed_savers(_net(), cuda, ("checkpointing:2/3",)) == ("none", "checkpointing:2/3")
    assert allowed_savers(nn.Sequential(nn.Linear(2, 2)), cuda) == ("none",)  # no blocks, no switch: nothing to save
    assert next_saver(SAVERS, "none") == "chunked_loss" and next_saver(SAVERS, "offload") is None
    assert next_saver(allowed_savers(_net(), cpu), "none") == "checkpointing:1/3"
    assert next_saver(allowed_savers(_net(), cpu), "checkpointing:2/3") == "checkpointing"
    for bad in ("sometimes", ("checkpointing", "swap")):
        with pytest.raises(ValueError, match="memory_savers"):
            allowed_savers(_net(), cpu, bad)
    with pytest.raises(TypeError, match="memory_savers"):
        allowed_savers(_net(), cpu, 3)


def test_a_compiled_model_takes_no_saver_and_the_error_says_why() -> None:
    """torch.compile cannot trace the exact checkpointing (dynamo: "checkpoint not implemented for ...
    context_fn"), so a compiled model's savers is the bottom saver alone, and what DoesNotFitError suggests
    says so; the same model uncompiled keeps its savers (the negative control)."""
    net = _net()
    assert allowed_savers(net, torch.device("cpu")) == ("none", "checkpointing:1/3", "checkpointing:2/3",
                                                        "checkpointing")
    assert allowed_savers(torch.compile(net), torch.device("cpu")) == ("none",)
    net.compile()  # compiled in place
    assert allowed_savers(net, torch.device("cuda")) == ("none",)
    assert any("torch.compile'd model takes no saver" in s for s in suggestions(("none",)))
