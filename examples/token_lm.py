"""A small causal language model on padded variable-length sequences, with a token-level loss.

Sequences of 6 to 32 tokens are right-padded to one length. The loss sums cross-entropy over the
real (unpadded) target tokens and returns ``(loss_sum, num_tokens)``: fit adds the sums of all
micro-batches and divides the step's gradient once by the step's token count, so every token
weighs the same however the sequences fall into micro-batches (a mean per micro-batch would give
tokens in short micro-batches more weight). Runs on CPU in seconds:

    python examples/token_lm.py
"""

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

import autoaccum

VOCAB, MAX_LEN, PAD, DIM = 64, 32, 0, 64


class SmallLM(nn.Module):
    """Token and position embeddings, two pre-norm transformer layers with a causal mask, a linear head.
    Padding sits at the end of each sequence, so under the causal mask no real token attends to it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_LEN, DIM)
        layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=4 * DIM, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(length, device=tokens.device))
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.blocks(x, mask=causal, is_causal=True))


def make_sequences(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, mask)`` of shape (num, MAX_LEN + 1): counting sequences with a random start and
    stride (learnable), of random length, padded with PAD; mask marks the real tokens."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, VOCAB, (num, 1), generator=g)
    stride = torch.randint(1, 5, (num, 1), generator=g)
    tokens = 1 + (start + stride * torch.arange(MAX_LEN + 1)) % (VOCAB - 1)  # tokens 1..VOCAB-1
    lengths = torch.randint(6, MAX_LEN + 2, (num, 1), generator=g)
    mask = torch.arange(MAX_LEN + 1) < lengths
    return tokens.masked_fill(~mask, PAD), mask


def token_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over real target tokens, and their count."""
    tokens, mask = batch
    logits = model(tokens[:, :-1])
    targets, real = tokens[:, 1:], mask[:, 1:]
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return per_token[real.reshape(-1)].sum(), real.sum()


def main() -> None:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("autoaccum.fit").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = SmallLM()
    train, held_out = make_sequences(1024, seed=1), make_sequences(256, seed=2)
    print(f"{len(train[0])} training sequences, {int(train[1][:, 1:].sum()):,} target tokens "
          f"({train[1][:, 1:].float().mean():.0%} of the padded grid)")

    result = autoaccum.fit(model, train, target_batch=64, loss_fn=token_loss, lr=3e-3, warmup_steps=10,
                           epochs=3, budget="8MiB", eval_data=held_out, eval_every=16)

    plan = result.final_plan
    print(f"plan: {plan.describe()} sequences per step (from {result.plan_source})")
    print(f"{result.optimizer_steps} steps; loss per token {result.losses[0]:.3f} -> {result.final_loss:.3f}; "
          f"held-out loss {result.eval_loss:.3f} (perplexity {math.exp(result.eval_loss):.1f} of {VOCAB})")


if __name__ == "__main__":
    main()
