"""Nothing of autoaccum's left in flight: the exit-time abort under gloo (issue 14).

The abort: gloo's worker thread drops its reference to a finished collective a moment after the call
returned; if the caller has dropped the tensor, the worker frees it and needs the GIL, which it cannot
take during interpreter shutdown, so the process aborts ("terminate called without an active
exception"). Two things make that impossible for autoaccum's collectives and for a script that ends
with ``destroy_process_group()``, and each is tested here against the real gloo backend:

1. every collective autoaccum runs returns only once the worker has let go of its tensors
   (``autoaccum.distributed.settled``); a late worker thread is emulated by handing each collective's
   work handle (it holds the tensors) to a thread that drops it 50 ms later;
2. ``destroy_process_group()`` after ``fit`` really frees the group and stops gloo's worker threads
   (torch.distributed.nn's default arguments would otherwise pin the group: autoaccum imports it
   before any group exists).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _collectives import intercept_all_reduces
from _spawn import results, spawn
from helpers import needs_gloo

import autoaccum

pytestmark = [needs_gloo,
              pytest.mark.slow]  # several processes each


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 6, generator=g, dtype=torch.float64)
    return x, (x[:, 0] > 0).long()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2)).double()


class LateWorker:
    """A gloo worker thread that lets go of each finished collective late.

    Every all-reduce (``dist.all_reduce``, seen at ``ProcessGroup.allreduce``), ``dist.broadcast`` and
    ``dist.gather`` still runs on the real backend and is waited on; its work handle (which holds the
    tensors) is then dropped by a thread of its own ``LATE_S`` later (``SENT_AHEAD_LATE_S`` for a call
    sent ahead), as by a worker thread the OS did not schedule for that long. ``held()`` counts the
    tensors handed to a collective that are still held beyond the reference count they had before it."""

    LATE_S = 0.05
    SENT_AHEAD_LATE_S: float | None = None  # None: LATE_S

    def __init__(self) -> None:
        self.timers: list[threading.Timer] = []
        self.records: list[tuple[torch.Tensor, int, bool]] = []
        for name in ("broadcast", "gather"):
            setattr(dist, name, self._late(getattr(dist, name)))
        intercept_all_reduces(self._late_all_reduce)  # in this spawned rank only

    def _let_go_late(self, work: Any, sent_ahead: bool) -> None:
        """The last reference to ``work`` goes to a thread that drops it after the delay."""
        delay = self.SENT_AHEAD_LATE_S if sent_ahead and self.SENT_AHEAD_LATE_S is not None else self.LATE_S
        held = [work]
        timer = threading.Timer(delay, held.clear)
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def drain(self) -> None:
        """Wait until every handle was dropped: a handle still held at exit would be freed by a daemon
        thread during interpreter shutdown, the very abort under test (seen in the negative control,
        where nothing waits for it)."""
        for timer in self.timers:
            timer.join(10)

    def _late(self, real: Any) -> Any:
        def collective(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            for t in [tensor, *(kwargs.get("gather_list") or [])]:  # gather: its outputs too, on the root
                self.records.append((t, t._use_count(), async_op))
            work = real(tensor, *args, async_op=True, **kwargs)
            if async_op:  # the caller holds the handle and waits on it
                self._let_go_late(work, sent_ahead=True)  # and a late thread lets go of it too
                return work
            work.wait()
            self._let_go_late(work, sent_ahead=False)
            return None
        return collective

    def _late_all_reduce(self, tensors: list[torch.Tensor], sent_ahead: bool, call: Any) -> Any:
        for t in tensors:
            self.records.append((t, t._use_count(), sent_ahead))
        work = call()
        # the caller waits on the handle (dist.all_reduce does, for a call that is not sent ahead) and
        # drops it; a late thread lets go of it too
        self._let_go_late(work, sent_ahead)
        return work

    def held(self, *, returned_only: bool = False) -> int:
        """``returned_only``: only the collectives whose call returned done (not those sent ahead
        asynchronously, which their caller holds and waits on later)."""
        return sum(t._use_count() > before for t, before, sent_ahead in self.records
                   if not (returned_only and sent_ahead))


def fit_with_a_late_worker(rank: int, world_size: int, settle: bool, checkpoint_dir: str) -> dict[str, Any]:
    if not settle:  # negative control: autoaccum's collectives without the wait
        import autoaccum.distributed.settle as settle_module
        settle_module._wait = lambda noted, timeout_s: None
    late = LateWorker()
    held_at_loss: list[int] = []

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        # inside guard.step, after its agreements: every collective whose call returned is settled (the
        # cut's exchange of this attempt may still be in flight, sent ahead: autoaccum holds it and
        # waits on it before the last micro-batch; after fit nothing at all is held, below)
        held_at_loss.append(late.held(returned_only=True))
        x, y = batch
        return F.cross_entropy(model(x), y)

    x, y = _data()
    autoaccum.fit(_model(), (x, y), target_batch=32, loss_fn=loss_fn, eval_data=(x[:40], y[:40]), epochs=1,
                  plan=autoaccum.Plan.for_target(32, 8, world_size), progress=False, verbose=False,
                  optimizer=None, lr=0.05, seed=1, checkpoint_dir=checkpoint_dir, checkpoint_every=1)
    held_after_fit = late.held()
    late.drain()
    return {"held_after_fit": held_after_fit, "held_at_loss": held_at_loss, "collectives": len(late.records)}


@pytest.mark.parametrize("settle", [True, False], ids=["settled", "negative-control"])
def test_no_collective_tensor_is_held_when_fit_returns(tmp_path: Path, settle: bool) -> None:
    codes = spawn(fit_with_a_late_worker, tmp_path, settle=settle, checkpoint_dir=str(tmp_path / "ckpt"))[0]
    if not settle and -signal.SIGABRT in codes:
        # the negative control may also show the defect itself: a rank that saved its result, then aborted
        # at exit because the late worker freed a collective's tensor during shutdown
        assert all(c in (0, -signal.SIGABRT) for c in codes), codes
        codes = [0] * len(codes)
    out = results(tmp_path, codes)
    for r in out:
        assert r["collectives"] > 20  # every step: gather, agree, gradients, buffers, loss; evaluation
        if settle:
            assert r["held_after_fit"] == 0 and set(r["held_at_loss"]) == {0}, r
        else:  # the late worker still holds the step's first collectives when the loss runs: the test sees it
            assert max(r["held_at_loss"]) > 0, r


def gather_with_a_late_worker(rank: int, world_size: int, settle: bool) -> dict[str, Any]:
    if not settle:
        import autoaccum.distributed.settle as settle_module
        settle_module._wait = lambda noted, timeout_s: None
    late = LateWorker()
    gathered = autoaccum.distributed.gather_to_rank_zero({"rank": rank, "state": torch.arange(7 + 100 * rank)})
    held = late.held()
    late.drain()
    return {"held": held, "collectives": len(late.records), "gathered": gathered}


@pytest.mark.parametrize("settle", [True, False], ids=["settled", "negative-control"])
def test_gather_to_rank_zero_returns_once_no_tensor_is_held(tmp_path: Path, settle: bool) -> None:
    """The object gather (every rank's RNG state in a checkpoint) runs on tensors it holds, of different
    sizes per rank, and returns only once the worker let go of them; rank 0 gets every rank's object."""
    out = results(tmp_path, spawn(gather_with_a_late_worker, tmp_path, world_size=3, settle=settle)[0])
    for rank, r in enumerate(out):
        assert r["collectives"] == (2 + 3 if rank == 0 else 2)  # the sizes' all-reduce; the gather (+ 3 outputs)
        assert (r["held"] == 0) == settle, r
    assert out[1]["gathered"] is None and out[2]["gathered"] is None
    assert [g["rank"] for g in out[0]["gathered"]] == [0, 1, 2]
    for rank, g in enumerate(out[0]["gathered"]):
        assert torch.equal(g["state"], torch.arange(7 + 100 * rank))


def _gloo_threads() -> int:
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop"
               for t in os.listdir("/proc/self/task"))


def fit_then_destroy(rank: int, world_size: int, pin: bool) -> dict[str, int]:
    if pin:  # negative control: the defaults of torch.distributed.nn bound to the live group
        import importlib

        import torch.distributed.nn.functional as functional
        importlib.reload(functional)
    x, y = _data()
    autoaccum.fit(_model(), (x, y), target_batch=32, epochs=1, plan=autoaccum.Plan.for_target(32, 8, world_size),
                  progress=False, verbose=False, seed=1)  # wraps the model in DDP, which imports torch._dynamo
    during = _gloo_threads()
    dist.destroy_process_group()
    return {"during": during, "after": _gloo_threads()}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
@pytest.mark.parametrize("pin", [False, True], ids=["freed", "negative-control"])
def test_destroy_process_group_after_fit_stops_gloo_threads(tmp_path: Path, pin: bool) -> None:
    out = results(tmp_path, spawn(fit_then_destroy, tmp_path, pin=pin)[0])
    for r in out:
        assert r["during"] > 0
        assert (r["after"] > 0) == pin, r


def test_settled_waits_for_a_tensor_held_elsewhere_then_gives_up_with_a_warning(caplog) -> None:
    free = torch.zeros(3)
    held = torch.zeros(3, requires_grad=True)
    with autoaccum.distributed.settled(free, timeout_s=0.05) as keep:
        graph = (keep(held) * 2).sum()  # the autograd graph holds `held` until it is freed: never, here
    assert "still holds a collective's tensor" in caplog.text
    caplog.clear()
    with autoaccum.distributed.settled(free, held.detach(), timeout_s=0.05):
        pass
    assert caplog.text == ""  # nothing held: no wait, no warning
    del graph
