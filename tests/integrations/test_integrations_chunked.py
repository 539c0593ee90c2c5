"""The loss in chunks inside HF's Trainer: where one sample of a large vocabulary does not fit the budget whole,
``AutoAccumTrainer``'s probe takes the chunked loss and trains as HF's own full-batch run (fp64)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from helpers import params, rel_diff  # noqa: E402
from test_integrations_hf import arguments  # noqa: E402
from transformers import Trainer  # noqa: E402

from autoaccum.integrations.transformers import AutoAccumTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, TOKENS = 50257, 512


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double()


def rows() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (8, TOKENS), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": r, "labels": r} for r in ids]


def test_the_trainer_takes_the_chunked_loss_where_one_sample_does_not_fit_whole(tmp_path):
    reference = gpt2()
    Trainer(model=reference, args=arguments(str(tmp_path / "ref"), 4, 1, max_steps=2), train_dataset=rows()).train()
    model = gpt2()
    trainer = AutoAccumTrainer(model=model, args=arguments(str(tmp_path / "aa"), 4, 1, max_steps=2),
                               train_dataset=rows(), budget="400MiB")
    trainer.train()
    guard = trainer.autoaccum_guard
    assert guard.report.savers_tried[0][0] == "none"  # one sample did not fit whole
    assert guard.guard.plan.saver.endswith("chunked_loss")  # alone, or under checkpointing where that measured faster
    assert rel_diff(params(model), params(reference)) <= 1e-10
