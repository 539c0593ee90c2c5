"""Faults on two gloo ranks (CPU) that one process cannot show: where every rank must react alike.

- an inf/NaN gradient found by every rank before the optimizer step (DDP: after the all-reduce, the
  ranks hold the same sums; FSDP2: each rank holds a shard, so the verdict is exchanged);
- an OOM in an FSDP2 evaluation on one rank: every rank halves the evaluation micro-batch;
- probe logs and plan changes from rank 0 only;
- resume: each rank's RNG continues as in the uninterrupted run.
- allocator thrashing on one rank: said in the next step's exchange, every rank shrinks together.

Each test spawns two processes bounded by a timeout (tests/_spawn.py): a hang fails.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _spawn import results, spawn
from helpers import needs_gloo
from test_distributed import SEED, TARGET, Net, _params, fsdp2_supported, make_data, make_net, mean_loss

import autoaccum
from autoaccum.distributed import DistributedSync, wrap_model
from autoaccum.errors import NonFiniteError
from autoaccum.memory import MemoryReading, NullMeter
from autoaccum.plan.data import GlobalBatches
from autoaccum.training.checkpoint import load_checkpoint

pytestmark = [needs_gloo,
              pytest.mark.slow]  # several processes each

needs_fsdp2 = pytest.mark.skipif(not fsdp2_supported(), reason="FSDP2 under autoaccum needs torch >= 2.13")


def _shard(net: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(net.inp)
    fully_shard(net.out)
    return fully_shard(net)


# -- an OOM in an FSDP2 evaluation on one rank ----------------------------------------------------------
class EvalOOMNet(Net):
    """Net that runs out of memory in its ``eval_oom_at``-th evaluation forward, between its two sharded
    submodules (under FSDP2 the other rank goes on to the second one's all-gather)."""

    def __init__(self) -> None:
        super().__init__()
        self.eval_oom_at: int | None = None
        self.eval_rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inject(self.inp(x)))
        if not self.training:
            self.eval_rows.append(x.shape[0])
            if len(self.eval_rows) == self.eval_oom_at:
                raise torch.OutOfMemoryError("injected: out of memory in an evaluation forward")
        y = self.out(h)
        flagged = x[:, 0] > 1.5
        if bool(flagged.any()):
            y = y + flagged[:, None].float() * self.extra
        return y


EVAL_N = 32  # two global batches of 16: 8 samples per rank each


def fsdp2_eval_oom(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(SEED)
    net = EvalOOMNet()  # the same initial weights as make_net()
    net.eval_oom_at = 1 if rank == 1 else None
    model = _shard(net)
    x, y, tokens = make_data()
    result = autoaccum.fit(model, (x, y, tokens), TARGET, loss_fn=mean_loss,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), seed=SEED, progress=False,
                           eval_data=(x[:EVAL_N], y[:EVAL_N], tokens[:EVAL_N]), eval_every=2, max_steps=4,
                           plan=autoaccum.Plan.for_target(TARGET, 4, world_size))
    return {"eval_loss": result.eval_loss, "eval_ooms": result.eval_ooms, "eval_rows": net.eval_rows,
            "params": _params(model), "steps": result.optimizer_steps}


@needs_fsdp2
def test_fsdp2_evaluation_oom_on_one_rank_shrinks_every_rank(tmp_path: Path) -> None:
    """Rank 1 runs out of memory in the middle of its first evaluation forward. Every rank halves the
    evaluation micro-batch (8 -> 4) and evaluates again, with no hang; both report the same loss, equal
    to one process's full-batch loss on the evaluation data with the trained weights."""
    codes, _ = spawn(fsdp2_eval_oom, tmp_path)
    out = results(tmp_path, codes)
    for rank, r in enumerate(out):
        assert r["steps"] == 4 and r["eval_ooms"] == 1, (rank, r["eval_ooms"])
        # first evaluation: the first batch's forward at 8 (rank 1's failed, and the ranks agree per batch),
        # then its 2 batches in 2 micro-batches of 4 each; the second evaluation at 4 from the start
        assert r["eval_rows"] == [8] + [4] * 4 + [4] * 4, (rank, r["eval_rows"])
    assert out[0]["eval_loss"] == out[1]["eval_loss"]
    net = Net()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(out[0]["params"][name])
        x, y, tokens = make_data()
        want = float(mean_loss(net, (x[:EVAL_N], y[:EVAL_N], tokens[:EVAL_N])))
    assert out[0]["eval_loss"] == pytest.approx(want, rel=1e-5)


# -- inf/NaN gradients: every rank decides the same, before the optimizer step -------------------------
class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan"))


class PoisonNet(Net):
    """Net whose armed forward leaves the loss as it is and turns the gradient of ``out.weight``'s row 2
    into NaN: under FSDP2 (rows 0-1 on rank 0, row 2 on rank 1) only rank 1's shard holds the NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.poison:
            y = y + 0 * _NanGrad.apply(self.out.weight[2].sum())
        return y


NAN_STEPS = 3  # the NaN gradient comes from rank 0's micro-batches of step 2


def nonfinite_on_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ["ddp"] + (["fsdp2"] if fsdp2_supported() else []):
        for policy in ("skip", "stop"):
            torch.manual_seed(SEED)
            net = PoisonNet()
            model = _shard(net) if kind == "fsdp2" else wrap_model(net)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            guard = autoaccum.OOMGuard(model, opt, target_batch=TARGET, micro_batch=4,
                                       sync=DistributedSync(model), nonfinite=policy)
            skipped, error, after = [], None, {}
            batches = GlobalBatches(make_data(), TARGET, seed=SEED, rank=rank, world_size=world_size)
            for step, rb in zip(range(1, NAN_STEPS + 1), batches.epoch(0)):
                net.poison = rank == 0 and step == 2
                try:
                    skipped.append(guard.step(rb.batch, mean_loss).skipped)
                except NonFiniteError as exc:
                    error = (exc.step, str(exc))
                    break
                finally:
                    after[step] = _params(model)
            out[f"{kind}/{policy}"] = {"skipped": skipped, "error": error, "after": after,
                                       "finite": all(bool(torch.isfinite(p).all()) for p in after[max(after)].values())}
    return out


def _one_process_skipping(skip_step: int | None, steps: int = NAN_STEPS) -> dict[str, torch.Tensor]:
    """One process, full-batch SGD steps 1..``steps``, step ``skip_step`` not taken."""
    torch.manual_seed(SEED)
    net = PoisonNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batches = GlobalBatches(make_data(), TARGET, seed=SEED).epoch(0)
    for step, rb in zip(range(1, steps + 1), batches):
        if step != skip_step:
            opt.zero_grad(set_to_none=True)
            mean_loss(net, rb.batch).backward()
            opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def test_nonfinite_gradients_on_one_rank_are_skipped_or_stopped_on_every_rank(tmp_path: Path) -> None:
    """Rank 0's micro-batches of step 2 give ``out.weight`` row 2 a NaN gradient under a finite loss.
    DDP: the all-reduced gradients hold it on every rank, so every rank's check finds it. FSDP2: after the
    reduce-scatter only rank 1's shard holds it; rank 0's own check finds nothing and learns it from the
    exchanged verdict. 'skip': every rank skips step 2 (equal to one process that leaves step 2 out);
    'stop': every rank raises NonFiniteError for step 2 with the weights of step 1, no hang."""
    codes, _ = spawn(nonfinite_on_one_rank, tmp_path)
    out = results(tmp_path, codes)
    want = _one_process_skipping(2)
    for key in out[0]:
        for rank, r in enumerate(out):
            got = r[key]
            assert got["finite"], (key, rank)
            if key.endswith("skip"):
                assert got["skipped"] == [False, True, False] and got["error"] is None, (key, rank)
                assert all(torch.equal(a, b) for a, b in zip(got["after"][2].values(), got["after"][1].values()))
                for name, p in want.items():
                    torch.testing.assert_close(got["after"][NAN_STEPS][name], p, rtol=1e-5, atol=1e-6,
                                               msg=f"{key} rank {rank} {name}")
            else:
                assert got["skipped"] == [False] and got["error"][0] == 2, (key, rank, got["error"])
                assert "stopped before optimizer.step()" in got["error"][1]
                assert all(torch.equal(a, b) for a, b in zip(got["after"][2].values(), got["after"][1].values()))
        for name in out[0][key]["after"][max(out[0][key]["after"])]:
            assert torch.equal(out[0][key]["after"][max(out[0][key]["after"])][name],
                               out[1][key]["after"][max(out[1][key]["after"])][name]), (key, name)
    # negative control: the poisoned step, taken, would have moved the weights to NaN
    assert not all(torch.equal(a, b) for a, b in zip(want.values(), _one_process_skipping(0).values()))


# -- probe logs and plan changes from rank 0 --------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.name, record.levelno, record.getMessage()))


def logs_of_two_ranks(rank: int, world_size: int) -> list[tuple[str, int, str]]:
    handler = _Records()
    package = logging.getLogger("autoaccum")
    package.addHandler(handler)
    package.setLevel(logging.DEBUG)
    x, y, tokens = make_data()
    # a probe on every rank (under DDP each rank measures its own device)
    probed = autoaccum.fit(make_net(), (x, y, tokens), TARGET, loss_fn=mean_loss, seed=SEED, progress=False,
                           max_steps=1)
    # then an OOM on rank 1 in training (its second micro-batch's backward) and in evaluation
    torch.manual_seed(SEED)
    net = EvalOOMNet()
    net.eval_oom_at = 1 if rank == 1 else None
    calls = [0]

    def oom_on_rank_1(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2 and rank == 1:
            net.inject.armed = 1
        return mean_loss(m, batch)

    autoaccum.fit(net, (x, y, tokens), TARGET, loss_fn=oom_on_rank_1, seed=SEED, progress=False, max_steps=2,
                  plan=autoaccum.Plan.for_target(TARGET, 4, world_size),
                  eval_data=(x[:EVAL_N], y[:EVAL_N], tokens[:EVAL_N]))
    package.removeHandler(handler)
    assert probed.plan_source == "probe"
    return handler.seen


def test_probe_logs_and_plan_changes_come_from_rank_zero(tmp_path: Path) -> None:
    """fit under DDP probes on every rank, and an OOM on rank 1 changes the plan of both (in training, and
    in evaluation): rank 0 logs each message once at its level; rank 1 the same messages at debug level only."""
    codes, _ = spawn(logs_of_two_ranks, tmp_path)
    seen = results(tmp_path, codes)
    watched = ("autoaccum.probe", "autoaccum.guard", "autoaccum.training.evaluate")

    def messages(rank: int, level: int) -> list[str]:
        return [m for name, lv, m in seen[rank] if name in watched and lv == level]

    probe_lines = [m for m in messages(0, logging.DEBUG) if m.startswith("probe micro-batch")]  # details: debug
    changes = messages(0, logging.WARNING)
    assert probe_lines and ("OOM in another rank: batch 16 = (4 x 2) per rank x 2 ranks -> (2 x 4) per rank x 2 ranks "
                            "(4 micro-batches each); the global batch is unchanged") in changes
    assert "OOM in evaluation: eval micro-batch 8 -> 4 (training plan unchanged)" in changes
    assert len(changes) == 2, changes
    # rank 1: nothing above debug level from the probe, the guard or evaluation; the same lines at debug level
    assert [(n, lv, m) for n, lv, m in seen[1] if n in watched and lv > logging.DEBUG] == []
    demoted = messages(1, logging.DEBUG)
    assert ("OOM in backward: batch 16 = (4 x 2) per rank x 2 ranks -> (2 x 4) per rank x 2 ranks (4 micro-batches "
            "each); the global batch is unchanged") in demoted
    assert "OOM in evaluation: eval micro-batch 8 -> 4 (training plan unchanged)" in demoted
    assert sum(m.startswith("probe micro-batch") for m in demoted) >= 2


# -- resume: each rank's RNG ------------------------------------------------------------------------------
class DropNet(Net):
    """Net with dropout after its hidden layer: each rank draws its own masks from its own generator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.inp(x)), p=0.3, training=self.training)
        return self.out(h)


RNG_STEPS, RNG_STOP = 5, 2


def _drop_net() -> DropNet:
    torch.manual_seed(SEED)
    return DropNet()


def per_rank_rng(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    plan = autoaccum.Plan.for_target(TARGET, 4, world_size)

    def run(model: torch.nn.Module, **kwargs: Any) -> Any:
        return autoaccum.fit(model, make_data(), TARGET, loss_fn=mean_loss, lr=0.1, seed=SEED, progress=False,
                             verbose=False, plan=plan, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             **kwargs)

    whole = _drop_net()
    torch.manual_seed(100 + rank)  # each rank its own random stream (its own dropout masks)
    run(whole, max_steps=RNG_STEPS)
    out: dict[str, Any] = {"whole": _params(whole), "whole_rng": torch.get_rng_state()}
    first = _drop_net()
    torch.manual_seed(100 + rank)
    run(first, max_steps=RNG_STOP, checkpoint_dir=directory)
    dist.barrier()
    torch.manual_seed(7)  # a restarted process: whatever its generators hold
    resumed = _drop_net()
    run(resumed, max_steps=RNG_STEPS, checkpoint_dir=directory, resume=True)
    out.update(resumed=_params(resumed), resumed_rng=torch.get_rng_state())
    return out


def test_resume_restores_each_ranks_own_rng(tmp_path: Path) -> None:
    """Dropout on two ranks with different random streams, stopped after step 2 and resumed: each rank's
    generator continues as in the uninterrupted run (before, every rank restored rank 0's), and so do the
    weights. Resumed in one process, the checkpoint of two ranks restores rank 0's, with a warning."""
    directory = tmp_path / "ckpt"
    codes, _ = spawn(per_rank_rng, tmp_path, directory=str(directory))
    out = results(tmp_path, codes)
    assert not torch.equal(out[0]["whole_rng"], out[1]["whole_rng"])  # the ranks' streams differ
    for rank, r in enumerate(out):
        assert torch.equal(r["resumed_rng"], r["whole_rng"]), f"rank {rank}'s RNG after the resume"
        for name, p in r["whole"].items():
            assert torch.equal(r["resumed"][name], p), (rank, name)
    saved = load_checkpoint(directory)
    assert isinstance(saved["rng"], list) and len(saved["rng"]) == 2
    with pytest.warns(RuntimeWarning, match=r"RNG states of 2 rank\(s\) and this run has 1: ranks 0..0 restore"):
        model = _drop_net()
        autoaccum.fit(model, make_data(), TARGET, loss_fn=mean_loss, seed=SEED, progress=False, verbose=False,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_steps=RNG_STEPS + 1,
                      checkpoint_dir=directory, resume=True)


# -- allocator thrashing on one rank: said in the exchange, every rank shrinks together ----------------------
class RetryMeter(NullMeter):
    """A meter that counts no bytes, only the CUDA allocator's retries (which a CPU cannot cause): on a
    thrashing rank they rise at every reading, elsewhere they stay 0."""

    kind = "counted"

    def __init__(self, rising: bool) -> None:
        self.rising, self.retries = rising, 0

    def read(self) -> MemoryReading:  # type: ignore[override]
        self.retries += self.rising
        return MemoryReading(0, 0, self.retries)


THRASH_STEPS = 5  # full global batches of make_data()


def thrash_on_one_rank(rank: int, world_size: int, thrashing_rank: int) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = wrap_model(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = autoaccum.OOMGuard(model, opt, target_batch=TARGET, micro_batch=4, sync=DistributedSync(model),
                               meter=RetryMeter(rank == thrashing_rank), grow="off")
    batches = GlobalBatches(make_data(), TARGET, seed=SEED, rank=rank, world_size=world_size)
    changes, micro = [], []
    for step, rb in zip(range(1, THRASH_STEPS + 1), batches.epoch(0)):
        result = guard.step(rb.batch, mean_loss)
        changes += [(step, c.reason, c.old.micro_batch, c.new.micro_batch, c.describe()) for c in result.changes]
        micro.append(result.plan.micro_batch)
    return {"changes": changes, "micro": micro, "params": _params(model), "ooms": guard.ooms}


@pytest.mark.parametrize("thrashing_rank", [0, 1])
def test_allocator_thrashing_on_one_rank_shrinks_every_rank_together(tmp_path: Path, thrashing_rank: int) -> None:
    """One rank's allocator retries rise at every step (thrash_steps=2): after step 3 its streak is
    complete; step 4's exchange says so, and after step 4 every rank
    halves the micro-batch at once (4 -> 2), naming that rank; the streak starts again from there. No
    hang, no OOM; the weights equal one process's full-batch SGD (the shrink changes no gradient).
    Negative control: before this, the thrashing rank only warned (no change on any rank)."""
    codes, _ = spawn(thrash_on_one_rank, tmp_path, thrashing_rank=thrashing_rank)
    out = results(tmp_path, codes)
    want = _one_process_skipping(None, THRASH_STEPS)
    for rank, got in enumerate(out):
        assert [c[:4] for c in got["changes"]] == [(4, "thrash", 4, 2)], (rank, got["changes"])
        assert f"allocator retries rising (on rank {thrashing_rank})" in got["changes"][0][4]
        assert got["micro"] == [4, 4, 4, 2, 2] and got["ooms"] == 0, (rank, got["micro"])
        for name, p in want.items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")
