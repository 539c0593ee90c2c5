"""A tiny GPT-2 (and BERT, Llama) from configs and padded token rows with sample ids, for the integration tests.

Sample ``i`` starts with token ``2 + i``, so a forward hook can name the samples of any batch.
fp64, dropout off.
"""

from __future__ import annotations

import torch
from helpers import pad_rows
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

VOCAB, SEQ, PAD, N = 64, 16, 0, 32


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
    return GPT2LMHeadModel(config).double()


def llama(vocab_size: int = VOCAB) -> torch.nn.Module:
    """A tiny Llama (it attends within each sequence of a padding-free row, by its position ids)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(config).double()


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=48, max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=PAD)
    return BertForSequenceClassification(config).double()


class Rows(torch.utils.data.Dataset):
    """Token rows of 3..16 tokens; sample ``i`` starts with token ``2 + i``; a class label per row."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = []
        for i in range(n):
            ids = torch.randint(2, VOCAB, (int(torch.randint(3, SEQ + 1, (1,), generator=g)),), generator=g)
            ids[0] = 2 + i
            self.rows.append((ids, int(torch.randint(0, 3, (1,), generator=g))))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i][0], "label": self.rows[i][1]}


def collate(rows: list[dict], per_sample: bool = False) -> dict[str, torch.Tensor]:
    """Right padding to the longest row, as a tokenizer's padding collator does."""
    batch = pad_rows(rows, PAD)
    if per_sample:
        batch["labels"] = torch.tensor([r["label"] for r in rows])
    return batch


def ids_of(args: tuple, kwargs: dict) -> list[int]:
    """The sample ids of a forward's ``input_ids``."""
    return (kwargs["input_ids"][:, 0] - 2).tolist()
