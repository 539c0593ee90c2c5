"""A Hugging Face GPT-2 trained with ``autoaccum.fit``, with the data as a Hugging Face user holds it.

The data is a list of tokenized rows (``tokenizer(text)`` for each text: ``input_ids`` and
``attention_mask`` of different lengths) and the collator is Transformers' own
``DataCollatorForLanguageModeling(tokenizer, mlm=False)``: it pads each global batch to its longest
row and sets ``labels`` (``-100`` on padding). fit needs no loss function: for dict batches it uses
the model's own loss, ``model(**batch).loss``, token-exact across micro-batches (each step divides
the summed token losses once by the step's predicted tokens, as one full-batch forward would).

No download: the tokenizer is a real ``PreTrainedTokenizerFast`` built in memory from a word-level
vocabulary, the model is built from a small config, the texts are synthetic (counting sentences of
8 to 48 words, which a small model learns). ``budget="16 MiB"`` emulates a small device on the CPU:
32 sequences do not fit at once, so fit probes, plans micro-batch x accumulation steps = 32, and
trains. Runs in seconds (most of it importing transformers):

    python examples/hf_causal_lm.py
"""

import logging
import math

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import autoaccum

WORDS, MIN_LEN, MAX_LEN = 60, 8, 48
BUDGET = "16 MiB"  # an emulated device: 32 sequences of 48 tokens need more


def make_tokenizer() -> PreTrainedTokenizerFast:
    """What ``AutoTokenizer.from_pretrained`` returns, for a vocabulary of ``WORDS`` words."""
    vocab = {word: i for i, word in enumerate(["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(WORDS)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def make_texts(num: int, seed: int) -> list[str]:
    """Counting sentences: ``w{s} w{s+d} w{s+2d} ...`` (mod WORDS) with a random start, stride and length."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, WORDS, (num,), generator=g).tolist()
    strides = torch.randint(1, 4, (num,), generator=g).tolist()
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (num,), generator=g).tolist()
    return [" ".join(f"w{(s + d * i) % WORDS}" for i in range(n)) for s, d, n in zip(starts, strides, lengths)]


def main() -> None:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("autoaccum.fit").setLevel(logging.INFO)  # fit's banner and summary go through logging
    transformers.logging.set_verbosity_error()  # HF's note that the config names no loss_type (it uses the default)
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    rows = [tokenizer(text) for text in make_texts(256, seed=1)]  # what dataset.map(tokenize) holds
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # pads; labels = input_ids, -100 on padding
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=MAX_LEN, n_embd=64, n_layer=2, n_head=4,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config)
    print(f"{len(rows)} rows of {MIN_LEN}-{MAX_LEN} tokens, GPT-2 with {model.num_parameters():,} parameters")

    result = autoaccum.fit(model, rows, target_batch=32, collate_fn=collator, lr=3e-3, epochs=2, budget=BUDGET)

    report = result.probe
    print(f"plan: {result.plan.describe()} (from {result.plan_source}: {report.probe_steps} passes at sizes "
          f"{', '.join(str(c.micro_batch) for c in report.candidates)}, {report.probe_ooms} OOMs, "
          f"{result.probe_time_s:.2f} s)")
    passes = result.micro_steps  # cut by tokens: each step's micro-batches follow its lengths
    print(f"micro-steps per optimizer step: {min(passes)} to {max(passes)} (mean {sum(passes) / len(passes):.1f}); "
          f"each micro-batch padded only to its own longest row")
    for change in result.plan_changes:  # an OOM in training: the step was replayed with a smaller micro-batch
        print(f"  {change.describe()}")
    print(f"{result.optimizer_steps} steps, {result.samples_seen:,} sequences; loss per token "
          f"{result.losses[0]:.3f} -> {result.final_loss:.3f} (perplexity {math.exp(result.final_loss):.1f} "
          f"of {len(tokenizer)}); {result.oom_events} OOMs in training; peak "
          f"{autoaccum.format_bytes(result.peak_bytes)} of {BUDGET}")

if __name__ == "__main__":
    main()
