"""Hugging Face models as a new user brings them to ``fit`` and ``OOMGuard`` (not through a trainer): models built from
small configs, dict batches with padding, the model's own loss, BatchNorm vision models -- against full-batch
references.

fp64 throughout the exactness tests, dropout off. GPT-2's loss (``ForCausalLMLoss``) computes the
cross-entropy in float32 even for a float64 model; the guard passes the step's token count up
front (``num_items_in_batch``), so every token's gradient is computed as in the full-batch
forward, and the comparison holds to 1e-10.
"""

from __future__ import annotations

import copy
import functools
import json
import warnings

import pytest
import torch

import autoaccum
from autoaccum import OOMGuard, Plan
from autoaccum.step import losses as losses_module
from autoaccum.step.losses import default_loss, predicted_tokens

transformers = pytest.importorskip("transformers")
from _token_rows import PAD, SEQ, VOCAB, bert, gpt2  # noqa: E402 - the models the integration tests train
from helpers import params, rel_diff  # noqa: E402
from transformers import ResNetConfig, ResNetForImageClassification  # noqa: E402 - after the skip: these tests need transformers

RTOL = 1e-10


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()  # "loss_type=None ... default loss" is HF's own note
    yield


def resnet(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1],
                          num_labels=10)
    return ResNetForImageClassification(config)


def padded_tokens(n: int, seed: int, labels: str = "tokens") -> dict[str, torch.Tensor]:
    """``n`` sequences of 3..SEQ tokens, right-padded: what a tokenizer with padding=True returns."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, SEQ + 1, (n,), generator=g)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    batch = {"input_ids": ids, "attention_mask": mask}
    batch["labels"] = ids.masked_fill(mask == 0, -100) if labels == "tokens" else \
        torch.randint(0, 3, (n,), generator=g)
    return batch


def full_batch_steps(model: torch.nn.Module, batches: list[dict], lr: float = 0.1) -> None:
    """The reference: one forward of each whole global batch, HF's own loss, one SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()


class OOMAt:
    """A forward pre-hook that raises torch.OutOfMemoryError at the given calls (1-based), once each."""

    def __init__(self, *calls: int) -> None:
        self.calls, self.count = set(calls), 0

    def __call__(self, module: torch.nn.Module, args: object) -> None:
        self.count += 1
        if self.count in self.calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (injected by the test)")


@pytest.mark.parametrize("make_model, labels", [(gpt2, "tokens"), (bert, "samples")],
                         ids=["gpt2-causal-lm", "bert-cls"])
def test_the_models_own_loss_on_padded_dict_batches_equals_the_full_batch_step(make_model, labels):
    target = 10  # micro 4: 4 + 3 + 3, uneven; the OOM at the 5th forward (step 2) replays it at micro 2
    batches = [padded_tokens(target, seed=s, labels=labels) for s in range(4)]
    ref = make_model()
    full_batch_steps(ref, batches)
    model = make_model()
    hook = OOMAt(5)
    model.base_model.register_forward_pre_hook(hook)
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=target, micro_batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = [guard.step(b, default_loss) for b in batches]
    assert [r.attempts for r in results] == [1, 2, 1, 1] and guard.ooms == 1
    assert guard.plan.micro_batch == 2  # replayed smaller, the same samples
    assert rel_diff(params(model), params(ref)) <= RTOL
    if labels == "tokens":  # token-exact: the step's count of predicted tokens, after GPT-2's shift
        assert results[0].num_items == int(sum(predicted_tokens(model, batches[0]).reshape(1)))
        assert results[0].num_items == int((batches[0]["labels"][:, 1:] != -100).sum())
    full = [make_model()(**b).loss.item() for b in batches[:1]]
    assert results[0].loss == pytest.approx(full[0], rel=1e-6)  # the step reports the full-batch loss


def test_negative_control_a_mean_of_micro_batch_means_is_not_the_full_batch_step():
    target = 10
    batches = [padded_tokens(target, seed=s) for s in range(3)]
    ref = make = gpt2
    reference = ref()
    full_batch_steps(reference, batches)
    model = make()
    guard = OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=target, micro_batch=4)
    for b in batches:
        guard.step(b, lambda m, micro: m(**micro).loss)  # each micro-batch's token mean, weighted by samples
    assert rel_diff(params(model), params(reference)) > 1e-6  # the padding makes token counts differ


def test_fit_takes_a_dict_of_tensors_and_an_iterable_of_dict_batches_as_they_are():
    target = 8
    data = padded_tokens(64, seed=0)  # a tokenizer's output for the whole dataset
    result = autoaccum.fit(gpt2(), data, target, epochs=1, plan=Plan.for_target(target, 3), progress=False,
                           optimizer=None, lr=1e-3)
    assert result.optimizer_steps == 8 and result.samples_seen == 64
    batches = [padded_tokens(target, seed=s) for s in range(3)]  # what a DataLoader with a padding collator yields
    ref = gpt2()
    full_batch_steps(ref, batches)
    model = gpt2()
    result = autoaccum.fit(model, iter(batches), target, plan=Plan.for_target(target, 3), progress=False,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert result.optimizer_steps == 3 and rel_diff(params(model), params(ref)) <= RTOL


def test_fit_probes_and_trains_a_dataset_of_dicts_with_a_padding_collator_under_a_budget(tmp_path):
    collator = transformers.DataCollatorForLanguageModeling(tokenizer=_ByteTokenizer(), mlm=False)
    rows = [{"input_ids": list(range(2, 2 + n))} for n in [5, 9, 3, 12, 7, 16, 4, 8] * 8]  # 64 rows
    log = tmp_path / "steps.jsonl"
    result = autoaccum.fit(gpt2().float(), rows, 16, collate_fn=collator, budget="2MiB", epochs=1, progress=False,
                           log_file=log)
    # rows of different lengths: planned and cut by tokens, each micro-batch padded to its own longest
    assert result.plan.tokens is not None and result.probe.lengths.longest == 16
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert max(s["micro_steps"] for s in steps) > 1  # the budget forces accumulation
    assert result.optimizer_steps == 4 and result.samples_seen == 64


class _ByteTokenizer:
    """The least a collator asks of a tokenizer: padding of id lists."""

    pad_token_id, pad_token, padding_side = PAD, "<pad>", "right"

    def pad(self, features, return_tensors="pt", **kwargs):
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.tensor([f["input_ids"] + [PAD] * (longest - len(f["input_ids"])) for f in features])
        mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"])) for f in features])
        return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask})

    def __len__(self) -> int:
        return VOCAB


def test_a_batchnorm_vision_model_probes_and_trains_under_a_budget():
    """HF's ResNet on 32 x 32 images: its last stage's BatchNorm sees 1 x 1 maps, so one image per
    micro-batch cannot train (torch: "Expected more than 1 value per channel"). The probe used to
    start there and crash."""
    g = torch.Generator().manual_seed(0)
    data = {"pixel_values": torch.randn(96, 3, 32, 32, generator=g), "labels": torch.randint(0, 10, (96,), generator=g)}
    with pytest.warns(UserWarning, match="BatchNorm layers"):
        result = autoaccum.fit(resnet(), data, 32, budget="1.4MiB", epochs=1, progress=False)
    assert result.plan.min_micro_batch == 2 and result.plan.accum_steps > 1
    assert result.probe.candidates[0].micro_batch == 2
    assert result.optimizer_steps == 3 and result.oom_events == 0


def test_a_batchnorm_epoch_whose_last_batch_leaves_one_sample_is_refused_before_training():
    g = torch.Generator().manual_seed(0)
    data = {"pixel_values": torch.randn(65, 3, 32, 32, generator=g), "labels": torch.randint(0, 10, (65,), generator=g)}
    model = resnet()
    before = params(model)
    with pytest.raises(ValueError, match=r"last global batch holds 1 sample.*last_batch='drop'"):
        autoaccum.fit(model, data, 32, plan=Plan.for_target(32, 8), progress=False)
    assert rel_diff(params(model), before) == 0  # nothing trained
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = autoaccum.fit(model, data, 32, plan=Plan.for_target(32, 8), last_batch="drop", progress=False)
    assert result.optimizer_steps == 2 and result.samples_seen == 64


def test_the_model_returned_instead_of_its_loss_names_the_fix():
    with pytest.raises(autoaccum.TaskError, match=r"returned the model's output \(CausalLMOutputWithCrossAttentions"
                                                  r"\), not a loss.*model\(\*\*batch\).loss"):
        autoaccum.fit(gpt2(), padded_tokens(16, 0), 8, loss_fn=lambda m, b: m(**b), plan=Plan.for_target(8, 4),
                      progress=False)


def test_dict_batches_without_labels_ask_for_them_or_a_loss_fn():
    batch = padded_tokens(16, 0)
    del batch["labels"]
    with pytest.raises(autoaccum.TaskError, match=r"needs 'labels' in the batch .*or pass loss_fn="):
        autoaccum.fit(gpt2(), batch, 8, plan=Plan.for_target(8, 4), progress=False)


def test_a_float16_model_fed_float32_data_names_the_fix():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).half()
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    with pytest.raises(autoaccum.TaskError, match=r"parameters are torch.float16 and the batch holds torch.float32.*"
                                                  r"precision='bf16' or 'fp16'"):
        autoaccum.fit(model, (x, y), 16, plan=Plan.for_target(16, 8), progress=False)


def test_an_hf_model_moved_with_copy_keeps_its_loss_kind():
    """The token count follows the model's loss function (ForCausalLMLoss shifts) through a DDP-like wrapper."""
    model = gpt2()
    batch = padded_tokens(4, 0)
    shifted = int((batch["labels"][:, 1:] != -100).sum())
    assert predicted_tokens(model, batch) == shifted

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert predicted_tokens(Wrapper(copy.deepcopy(model)), batch) == shifted


def _probe_leaves_no_trace(model: torch.nn.Module, make_batch, device: str, budget: str) -> None:
    """The probe on ``model`` (AdamW with state from one step, gradients held, buffers moved) copies the weights
    on their device for the warm-up, and leaves weights, gradients, buffers and optimizer state bit for bit."""
    from autoaccum import state as training_state

    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {k: v.to(device) for k, v in make_batch(4).items()}
    model(**batch).loss.backward()
    optimizer.step()
    model(**batch).loss.backward()  # gradients held, as mid-accumulation

    def everything() -> dict[str, torch.Tensor]:
        out = {f"p/{n}": p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        out |= {f"g/{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out |= {f"b/{n}": b.clone() for n, b in model.named_buffers()}
        out |= {f"o/{i}/{k}": v.clone() for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}
        return out

    before = everything()
    made: list[int] = []
    init = training_state.WeightsCopy.__init__

    def recording(self, m):
        init(self, m)
        made.append(len(self.copies))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training_state.WeightsCopy, "__init__", recording)
        report = autoaccum.probe(model=model, loss_fn=default_loss, make_batch=make_batch, optimizer=optimizer,
                                 target_batch=64, budget=budget)
    assert report.probe_ooms == 0 and report.optimizer_steps == 2
    assert made == [len({id(p) for p in model.parameters()})]  # one copy, tied weights once
    after = everything()
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_probe_of_gpt2_with_tied_weights_and_of_a_batchnorm_resnet_leaves_no_trace(device):
    """GPT-2 ties its output layer to the token embedding (one parameter, two names); ResNet's BatchNorm
    statistics move in every forward: the weights come back from the copy on the device, the rest from the
    host snapshot."""
    # on CUDA the budget also holds cuBLAS's workspaces: 75.6 MiB at micro-batch 1 on an H100
    budget = "64MiB" if device == "cpu" else "1GiB"
    gpt = gpt2()
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    _probe_leaves_no_trace(gpt, lambda b: padded_tokens(b, seed=b), device, budget)
    g = torch.Generator().manual_seed(0)
    images = {"pixel_values": torch.randn(64, 3, 32, 32, generator=g),
              "labels": torch.randint(0, 10, (64,), generator=g)}
    _probe_leaves_no_trace(resnet(), lambda b: {k: v[:b] for k, v in images.items()}, device, budget)


# -- whether labels are shifted is asked of the loss function, not read from its identity ----------------------
def _causal_lm_loss_in_float64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                               shift_labels=None, **kwargs):
    """``ForCausalLMLoss`` without its float32 cast: a drop-in replacement, as kernel libraries and
    fine-tuning frameworks install them (``model.loss_function = ...``)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                             ignore_index=ignore_index,
                                             reduction="sum" if num_items_in_batch is not None else "mean")
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _unshifted_token_loss(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
    """A per-token loss that does not shift (every label other than -100 is a target)."""
    return _causal_lm_loss_in_float64(logits, labels, vocab_size, num_items_in_batch, shift_labels=labels)


def _with_loss(loss_function) -> torch.nn.Module:
    model = gpt2()
    model.loss_function = loss_function
    return model


def test_whether_a_loss_shifts_labels_is_read_from_what_it_does():
    from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

    from autoaccum.step.losses import loss_shifts_labels

    assert loss_shifts_labels(ForCausalLMLoss) is True and loss_shifts_labels(ForMaskedLMLoss) is False
    assert loss_shifts_labels(_causal_lm_loss_in_float64) is True  # a drop-in: same answer as the original
    assert loss_shifts_labels(_unshifted_token_loss) is False
    assert loss_shifts_labels(functools.partial(_causal_lm_loss_in_float64, ignore_index=-100)) is True
    # a function this test cannot read (another calling convention) falls back to HF's rule: not ForCausalLMLoss
    assert loss_shifts_labels(lambda labels, pooled_logits, config: pooled_logits.sum()) is False
    batch = padded_tokens(4, 0)
    shifted, unshifted = int((batch["labels"][:, 1:] != -100).sum()), int((batch["labels"] != -100).sum())
    assert shifted < unshifted
    assert predicted_tokens(_with_loss(_causal_lm_loss_in_float64), batch) == shifted
    assert predicted_tokens(_with_loss(_unshifted_token_loss), batch) == unshifted


@pytest.mark.parametrize("loss_function", [_causal_lm_loss_in_float64, _unshifted_token_loss],
                         ids=["drop-in-causal-lm", "unshifted"])
def test_fit_with_a_replaced_loss_function_equals_full_batch_token_mean_descent(loss_function, monkeypatch):
    """``fit`` on dict batches with the model's own loss, cut 5 x 7 (last 4) from 32: token-exact whatever
    the model's loss function is. Negative control: the opposite verdict (for the drop-in, the one its
    identity gives: not ``ForCausalLMLoss``, so unshifted) divides every step by the wrong token count."""
    import autoaccum.step.losses

    batches = [padded_tokens(32, seed=s) for s in range(3)]
    reference = _with_loss(loss_function)
    full_batch_steps(reference, batches, lr=1.0)

    def trained() -> torch.nn.Module:
        model = _with_loss(loss_function)
        autoaccum.fit(model, iter(batches), 32, plan=Plan.for_target(32, 5), progress=False,
                      optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        return model

    assert rel_diff(params(trained()), params(reference)) <= RTOL
    opposite = loss_function is _unshifted_token_loss
    monkeypatch.setattr(losses_module, "loss_shifts_labels", lambda f, device="cpu": opposite)
    assert rel_diff(params(trained()), params(reference)) > 1e-3
