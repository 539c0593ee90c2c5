"""autoaccum.memory.chunked_loss: the loss in chunks equals the whole loss (fp64 gradients to 1e-12; Hugging Face's
own loss, which takes its logits to float32, to float32 rounding), holds far less memory, and is offered only where
it stays exact."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import params, rel_diff
from torch import nn

import autoaccum
from autoaccum.memory import chunked_loss
from autoaccum.memory.savers import allowed_savers, apply_saver, describe_saver, saver_code, saver_from_code
from autoaccum.memory.tracked import TrackedMemory
from autoaccum.step.losses import default_loss

transformers = pytest.importorskip("transformers")

VOCAB = 1000


def _gpt2(vocab: int = VOCAB, width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=width, n_head=2, vocab_size=vocab, n_positions=1024,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:  # a tied head: the embedding is the head's weight
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=VOCAB, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def _tokens(rows: int = 3, length: int = 600) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, length))
    labels = ids.clone()
    labels[0, :50] = -100  # a prompt left out of the loss
    return ids, labels


def _step(model: nn.Module, saver: str, **batch: object) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with apply_saver(model, saver), chunked_loss.loss_only():  # read for its loss alone, as autoaccum's loss does
        out = model(**batch)
    out.loss.backward()
    return float(out.loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama-tied"])
@pytest.mark.parametrize("items", [None, 777], ids=["mean", "num_items"])
def test_a_causal_lms_own_loss_in_chunks_equals_it_whole(make, items):
    model = make().double()
    ids, labels = _tokens()
    batch = {"input_ids": ids, "labels": labels}
    if items is not None:
        batch["num_items_in_batch"] = torch.tensor(items)
    whole, grads = _step(model, "none", **batch)
    chunked, chunked_grads = _step(model, "chunked_loss", **batch)
    # HF's ForCausalLMLoss takes the logits to float32, also in a float64 model: the loss's sum is float32's
    assert chunked == pytest.approx(whole, rel=1e-6)
    assert rel_diff(chunked_grads, grads) <= 1e-12
    # negative control: the labels not shifted (a chunked loss that forgot the shift) is far off
    wrong, _ = _step(model, "chunked_loss", input_ids=ids, labels=labels, shift_labels=labels)
    assert abs(wrong - whole) > 1e-3 * abs(whole)


def test_a_forward_read_for_more_than_its_loss_keeps_its_logits():
    """A loop of the user's own may read ``outputs.logits`` (accuracy, a metric): outside ``loss_only`` (autoaccum's
    own loss, HF Trainer's own compute_loss) the saver leaves the model's forward as it is."""
    model = _gpt2()
    ids, labels = _tokens(1, 300)
    with apply_saver(model, "chunked_loss"):
        assert model(input_ids=ids, labels=labels).logits.shape == (1, 300, VOCAB)
        with chunked_loss.loss_only():
            assert model(input_ids=ids, labels=labels).logits is None


def test_a_float32_models_own_loss_in_chunks_equals_it_whole_to_float32_rounding():
    """A float32 model (as trained): its head's gradients computed chunk by chunk in the forward, then scaled,
    where autograd scales them first: equal to float32 rounding (the loss to 1e-6, the gradients to 1e-5 of the
    largest); a negative control with the labels unshifted is off by more than that."""
    model = _gpt2()
    ids, labels = _tokens()
    whole, grads = _step(model, "none", input_ids=ids, labels=labels)
    chunked, chunked_grads = _step(model, "chunked_loss", input_ids=ids, labels=labels)
    assert chunked == pytest.approx(whole, rel=1e-6) and rel_diff(chunked_grads, grads) <= 1e-5
    _, wrong_grads = _step(model, "chunked_loss", input_ids=ids, labels=labels, shift_labels=labels)
    assert rel_diff(wrong_grads, grads) > 1e-2


def test_given_shift_labels_are_the_targets_as_hf_takes_them():
    model = _gpt2().double()
    ids, labels = _tokens()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    shifted[1, 100:200] = -100
    whole, grads = _step(model, "none", input_ids=ids, labels=labels, shift_labels=shifted)
    chunked, chunked_grads = _step(model, "chunked_loss", input_ids=ids, labels=labels, shift_labels=shifted)
    assert chunked == pytest.approx(whole, rel=1e-6) and rel_diff(chunked_grads, grads) <= 1e-12


def test_head_loss_in_chunks_equals_the_whole_cross_entropy_in_fp64():
    torch.manual_seed(0)
    body, head = nn.Linear(16, 32).double(), nn.Linear(32, 5000).double()
    x, y = torch.randn(4, 300, 16, dtype=torch.float64), torch.randint(0, 5000, (4, 300))
    y[2, :40] = -100

    def run(saver: str) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        body.zero_grad(), head.zero_grad()
        with apply_saver(nn.Sequential(body, head), saver):
            total, count = autoaccum.head_loss(body(x), head, y)
        total.backward()
        return total.detach(), count, [p.grad.clone() for p in [*body.parameters(), *head.parameters()]]

    reference = F.cross_entropy(head(body(x)).reshape(-1, 5000), y.reshape(-1), reduction="sum")
    whole, count, grads = run("none")
    chunked, chunked_count, chunked_grads = run("chunked_loss")
    assert int(count) == int(chunked_count) == 4 * 300 - 40
    assert float(whole) == pytest.approx(float(reference), rel=1e-15)
    assert abs(float(chunked - whole)) <= 1e-12 * abs(float(whole)) and rel_diff(chunked_grads, grads) <= 1e-12
    # negative control: one chunk left out is visible
    short = chunked_loss.chunked_cross_entropy(body(x)[:, :-1], head, y[:, :-1])
    assert abs(float(short - whole)) > 1e-6 * abs(float(whole))
    # a head that is not an nn.Linear is recomputed chunk by chunk in backward; a frozen head (LoRA) takes no grad
    def tied(h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, head.weight, head.bias)

    body.zero_grad(), head.zero_grad()
    recomputed = chunked_loss.chunked_cross_entropy(body(x), tied, y, rows=256)
    recomputed.backward()
    assert abs(float(recomputed - whole)) <= 1e-12 * abs(float(whole))
    assert rel_diff([p.grad for p in [*body.parameters(), *head.parameters()]], grads) <= 1e-12
    # a head tied to an embedding, given as its weight: a linear layer without bias
    body.zero_grad(), head.zero_grad()
    with apply_saver(nn.Sequential(body, head), "chunked_loss"):
        tied_sum = autoaccum.head_loss(body(x), head.weight, y)[0]
    tied_sum.backward()
    untied = F.cross_entropy(F.linear(body(x), head.weight).reshape(-1, 5000), y.reshape(-1), reduction="sum")
    assert abs(float(tied_sum - untied)) <= 1e-12 * abs(float(untied)) and head.bias.grad is None
    head.requires_grad_(False)
    body.zero_grad(), head.zero_grad()
    with apply_saver(nn.Sequential(body, head), "chunked_loss"):
        autoaccum.head_loss(body(x), head, y)[0].backward()
    assert head.weight.grad is None and rel_diff([p.grad for p in body.parameters()], grads[:2]) <= 1e-12


def test_the_whole_logits_never_exist():
    """GPT-2's vocabulary at 1,024 tokens, width 32: the step's peak at the same micro-batch at least 30% lower
    (counted by the tracked meter)."""
    model = _gpt2(vocab=50257)
    ids = torch.randint(0, 50257, (1, 1024))
    peaks = {}
    for saver in ("none", "chunked_loss"):
        model.zero_grad(set_to_none=True)
        with TrackedMemory() as meter:
            meter.track(model)
            with apply_saver(model, saver), chunked_loss.loss_only():
                model(input_ids=ids, labels=ids).loss.backward()
        peaks[saver] = meter.read().peak_bytes
    assert peaks["chunked_loss"] < 0.7 * peaks["none"], peaks


def test_the_rung_is_offered_where_the_models_own_logits_are_its_heads():
    cpu = torch.device("cpu")
    assert allowed_savers(_gpt2(), cpu) == ("none", "chunked_loss", "checkpointing+chunked_loss")
    assert allowed_savers(_gpt2(), cpu, ("checkpointing",)) == ("none", "checkpointing")
    # a model that soft-caps its logits computes them differently from its head: its loss is not chunked
    torch.manual_seed(0)
    capped = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, vocab_size=VOCAB, final_logit_softcapping=0.5))
    assert "chunked_loss" in allowed_savers(capped, cpu)  # offered: its loss is ForCausalLMLoss; checked where taken
    ids = torch.randint(0, VOCAB, (1, 300))
    with pytest.warns(UserWarning, match="logits are not its output head's.*computed\\s+whole"):
        capped_loss, capped_grads = _step(capped, "chunked_loss", input_ids=ids, labels=ids)
    whole_loss, whole_grads = _step(capped, "none", input_ids=ids, labels=ids)
    assert capped_loss == whole_loss and rel_diff(capped_grads, whole_grads) == 0.0
    # a mixture of experts whose loss adds its router's auxiliary loss: more than the logits' cross-entropy
    for aux, chunked in ((True, False), (False, True)):
        torch.manual_seed(0)
        moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            num_local_experts=2, num_experts_per_tok=1, vocab_size=VOCAB, output_router_logits=aux))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert chunked_loss.chunks_own_loss(moe) is chunked
        assert bool(said) is not chunked
    # a model of the user's own: asked for, through head_loss
    mlp = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]))
    assert "chunked_loss" not in allowed_savers(mlp, cpu)
    assert allowed_savers(mlp, cpu, ("chunked_loss", "checkpointing")) == (
        "none", "chunked_loss", "checkpointing+chunked_loss")


def test_saver_names_codes_and_words():
    for saver in ("none", "chunked_loss", "checkpointing:2/8", "checkpointing:2/8+chunked_loss", "checkpointing",
                  "checkpointing+chunked_loss", "offload+chunked_loss"):
        assert saver_from_code(saver_code(saver)) == saver
    codes = [saver_code(s) for s in ("none", "chunked_loss", "checkpointing:1/8+chunked_loss",
                                     "checkpointing+chunked_loss", "offload+chunked_loss")]
    assert codes == sorted(codes)
    assert describe_saver("checkpointing:2/8+chunked_loss") == "checkpointing 2 of 8 blocks and the loss in chunks"
    with pytest.raises(ValueError, match="Invalid saver: 'none\\+chunked_loss'"):
        apply_saver(nn.Linear(1, 1), "none+chunked_loss").__enter__()


def test_fit_takes_the_chunked_loss_where_nothing_else_fits_and_trains_as_the_full_batch():
    """GPT-2's vocabulary at 512 tokens under a 400 MiB emulated budget: one sample needs 413 MiB whole and 406 MiB
    with every block checkpointed (DoesNotFitError without the rung); with the loss in chunks it fits, and trains as
    the full batch does with HF's own loss whole (fp64, 1e-12)."""
    def model() -> nn.Module:
        return _gpt2(vocab=50257).double()

    ids = torch.randint(0, 50257, (8, 512), generator=torch.Generator().manual_seed(3))
    reference = model()  # the same samples in the same order, whole: a plan of micro-batch 4 given, no saver
    autoaccum.fit(reference, {"input_ids": ids, "labels": ids}, 4, plan=autoaccum.Plan.for_target(4, 4), epochs=1,
                  progress=False, optimizer=torch.optim.SGD(reference.parameters(), lr=0.1))
    trained = model()
    result = autoaccum.fit(trained, {"input_ids": ids, "labels": ids}, 4, budget="400MiB", epochs=1, progress=False,
                           optimizer=torch.optim.SGD(trained.parameters(), lr=0.1))
    # the loss in chunks, alone or under checkpointing, at the micro-batch measured step times favour (not asserted)
    assert result.plan.saver.endswith("chunked_loss")
    assert rel_diff(dict(trained.named_parameters()), dict(reference.named_parameters())) <= 1e-12
    # negative control: without the rung nothing fits
    blocks_only = model()
    with pytest.raises(autoaccum.DoesNotFitError, match="checkpointing"):
        autoaccum.fit(blocks_only, {"input_ids": ids, "labels": ids}, 4, budget="400MiB", epochs=1, progress=False,
                      memory_savers=("checkpointing",), optimizer=torch.optim.SGD(blocks_only.parameters(), lr=0.1))


def test_the_guard_climbs_to_the_chunked_loss_at_the_smallest_micro_batch_and_replays_exactly():
    def model() -> nn.Module:
        return _gpt2(vocab=50257).double()

    ids = torch.randint(0, 50257, (4, 512), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    reference = model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(**batch).loss.backward()
    opt.step()
    trained = model()
    guard = autoaccum.OOMGuard(trained, torch.optim.SGD(trained.parameters(), lr=0.1), target_batch=4, micro_batch=2,
                               budget="400MiB")
    result = guard.step(batch, default_loss)
    # micro 2 OOMs, then micro 1 without a saver; the loss in chunks fits, on the same samples
    assert result.attempts == 3 and (guard.plan.micro_batch, guard.plan.saver) == (1, "chunked_loss")
    assert rel_diff(params(trained), params(reference)) <= 1e-12


def two_rank_chunked_fit(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """fit on each of two gloo ranks (DDP), 2 samples a rank a step, under a budget one sample fits only chunked."""
    model = _gpt2(vocab=50257).double()
    ids = torch.randint(0, 50257, (8, 512), generator=torch.Generator().manual_seed(3))
    result = autoaccum.fit(model, {"input_ids": ids, "labels": ids}, 4, budget="400MiB", epochs=1, progress=False,
                           verbose=False, seed=0, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert result.plan.saver.endswith("chunked_loss") and result.plan.world_size == 2, result.plan
    return params(model)


@pytest.mark.slow
def test_two_ranks_take_the_chunked_loss_and_equal_the_full_batch_steps(tmp_path):
    import torch.distributed as dist
    from _spawn import results, spawn

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out = results(tmp_path, spawn(two_rank_chunked_fit, tmp_path, timeout_s=300)[0])
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0))  # the order fit draws the samples in
    ids = torch.randint(0, 50257, (8, 512), generator=torch.Generator().manual_seed(3))[order]
    reference = _gpt2(vocab=50257).double()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        reference(input_ids=ids[step * 4:(step + 1) * 4], labels=ids[step * 4:(step + 1) * 4]).loss.backward()
        opt.step()
    for rank_params in out:
        assert rel_diff(rank_params, params(reference)) <= 1e-10


def test_an_estimate_runs_the_chunked_loss_on_fake_tensors_and_matches_the_measurement():
    """The chunked loss has no data-dependent shapes, and its logits check waits for real tensors: the estimate
    plans as the probe does, its peaks within 0.1% of the measured ones."""
    model = _gpt2(vocab=50257, width=64)
    ids = torch.randint(0, 50257, (16, 512), generator=torch.Generator().manual_seed(3))
    # the first saver that fits, on both (an estimate times nothing, so it weighs no saver above it)
    reports = [autoaccum.probe(model=model, loss_fn=default_loss, target_batch=8, budget="350MiB", estimate=estimate,
                               make_batch=lambda b: {"input_ids": ids[:b], "labels": ids[:b]}, weigh_savers=False)
               for estimate in (True, False)]
    assert [r.plan.saver for r in reports] == ["chunked_loss"] * 2 and [r.savers_tried[0][0] for r in reports] == [
        "none"] * 2
    measured = {c.micro_batch: c.peak_bytes for c in reports[1].candidates if c.status == "ok"}
    for c in reports[0].candidates:
        if c.micro_batch in measured:
            assert c.peak_bytes == pytest.approx(measured[c.micro_batch], rel=1e-3)


@pytest.mark.gpu
def test_on_cuda_the_chunked_loss_holds_less_and_gives_the_gradients_of_the_whole_loss():
    """bf16 GPT-2 (GPT-2's vocabulary, 2 x 1,024 tokens) on the card: the allocator's peak of the step at least 30%
    lower with the loss in chunks; the gradients equal the whole loss's to bf16 rounding (2e-2 of the largest)."""
    device = torch.device("cuda")
    model = _gpt2(vocab=50257, width=256).to(device, torch.bfloat16)
    ids = torch.randint(0, 50257, (2, 1024), device=device)
    peaks, grads = {}, {}
    for saver in ("none", "chunked_loss", "none"):  # none twice: the second, warm, is the one compared
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        _, grads[saver] = _step(model, saver, input_ids=ids, labels=ids)
        torch.cuda.synchronize()
        peaks[saver] = torch.cuda.max_memory_allocated(device)
    assert peaks["chunked_loss"] < 0.7 * peaks["none"], peaks
    assert rel_diff([g.float() for g in grads["chunked_loss"]], [g.float() for g in grads["none"]]) <= 2e-2
