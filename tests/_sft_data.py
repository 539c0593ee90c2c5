"""A tiny Llama and a word-level tokenizer built in memory (no download), and the four kinds of data
TRL's ``SFTTrainer`` trains on: plain text, prompt-completion (completion-only loss), conversations
(assistant-only loss, through a chat template with generation markers) and packed text (TRL's default
"bfd" packing, padding-free). fp64, no dropout."""

from __future__ import annotations

import _token_rows
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["<pad>", "<eos>", "<bos>", "<unk>", "user", "assistant", ":"] + [f"w{i}" for i in range(40)]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}assistant : {% generation %}"
                 "{{ m['content'] }} <eos>{% endgeneration %} {% else %}user : {{ m['content'] }} {% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")
KINDS = ("text", "completion", "chat", "packed")


def tokenizer() -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def llama() -> torch.nn.Module:
    return _token_rows.llama(len(WORDS))


def _words(g: torch.Generator, low: int, high: int) -> str:
    n = int(torch.randint(low, high, (1,), generator=g))
    return " ".join(f"w{int(j)}" for j in torch.randint(0, 40, (n,), generator=g))


def dataset(kind: str, n: int = 40) -> Dataset:
    """``n`` rows of ``kind`` (packed: 3n texts, packed into rows of at most 24 tokens)."""
    g = torch.Generator().manual_seed(0)
    if kind in ("text", "packed"):
        return Dataset.from_dict({"text": [_words(g, 3, 14) for _ in range(3 * n if kind == "packed" else n)]})
    if kind == "completion":
        pairs = [(_words(g, 2, 9), _words(g, 2, 9)) for _ in range(n)]
        return Dataset.from_dict({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})
    chats = [[{"role": "user", "content": _words(g, 2, 9)}, {"role": "assistant", "content": _words(g, 2, 9)}]
             for _ in range(n)]
    return Dataset.from_dict({"messages": chats})


def config_options(kind: str) -> dict:
    """The SFTConfig options of ``kind``: assistant-only loss for conversations, packing for packed."""
    if kind == "chat":
        return {"assistant_only_loss": True, "max_length": 64}
    if kind == "packed":
        return {"packing": True, "max_length": 24}  # packing_strategy "bfd": padding-free
    return {"max_length": 64}
