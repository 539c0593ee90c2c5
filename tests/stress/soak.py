"""Randomized fault-injection soak: ``autoaccum.fit`` on 2 and 4 gloo ranks, fp64.

Each *episode* is one training run of ``--steps`` optimizer steps on ``world`` ranks, launched the way
torchrun launches workers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), with checkpoints
and ``resume="auto"`` in every process. Faults, drawn from ``--seed`` and logged as they fire:

- **OOMs** (a real ``torch.OutOfMemoryError``) in the forward (mid-model), the loss, the backward
  (mid-model) or an evaluation forward, on random ranks: each micro-batch forward of each rank draws
  its own, at a rate scaled by its part of the rank's share (about ``p_oom`` per rank and attempt at a
  step, whatever the micro-batch), and some draw one on several ranks at once. Only where the
  micro-batch holds 2 samples or more (an OOM at a micro-batch of 1 ends a run with ``DoesNotFitError``
  by design). The guard cannot tell these from real OOMs: an OOM right after it grew counts against
  that size, so over a long episode it settles on small micro-batches (slower steps, more of them);
- **budget drops and rises**: the emulated device's budget (``fit(budget=...)``) falls to what a
  micro-batch of 1 surely needs plus 10% to 60% of the current micro-batch's activations, so that
  real emulated OOMs follow where the micro-batch is large enough, and comes back a few steps later;
- **a non-OOM exception** (ValueError in the loss) on one rank: every rank must exit with an error;
- **SIGKILL** of one rank in mid-step.
After an exception or a kill, the driver does what torchrun's agent does: it ends what is left of that
attempt and restarts every rank, which resume from the last checkpoint. Each episode is a kill, then an
exception, then a clean run to the end (3 incarnations).

Measured: hangs (an incarnation in which no rank logged anything for ``--stall`` seconds, or still
running at ``--timeout``; 0 expected; the stacks of every live rank go to its stderr file), aborts (exit -6/134 or
"terminate called"; 0 expected), whether every rank of a failed incarnation ended on its own (an
exception: all of them; a kill: the survivors), the sample audit (per rank and step, the ids whose
gradients reached the optimizer step, by post-accumulate-grad hooks: the steps that made the final
weights must hold exactly the documented global batches, nothing lost, nothing repeated), the final
parameters against a fault-free run of the same world size (relative difference <= 1e-10; no step is
deliberately skipped here), the time lost per injected OOM, and the number of faults.

    python tests/stress/soak.py [--worlds 2 4] [--episodes 10] [--steps 300] [--seed 0]
                              [--json-only] [--out FILE]
    python tests/stress/soak.py --sabotage ...   # the negative control: must report repeated ids and a param diff
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-10  # final parameters against the fault-free run, relative (fp64)


@dataclass(frozen=True)
class Config:
    """One soak: its shape and how often each fault fires."""

    worlds: tuple[int, ...] = (2, 4)
    episodes: int = 10  # per world size
    steps: int = 300  # optimizer steps per episode
    seed: int = 0
    samples: int = 1000  # per epoch: 3 full global batches of 256 and one of 232 (at target_batch 256)
    target_batch: int = 256
    micro_batch: int = 0  # 0: the whole share of a rank (the most room to shrink)
    checkpoint_every: int = 10
    eval_every: int = 50
    eval_samples: int = 512
    # OOM rates per rank and *attempt* at a step, whatever its micro-batch: a micro-batch of b samples
    # draws with p * b / share (share: a rank's part of the global batch). A rate per micro-batch would
    # make every OOM a cascade: halving doubles the forwards of the replay, and so its chance to fail.
    p_oom: float = 0.1
    p_multi: float = 0.05  # several ranks at once (the same draw on every rank)
    p_eval_oom: float = 0.05  # per evaluation forward and rank
    p_drop: float = 0.03  # per step and rank: the budget falls
    budget: int = 2 ** 24  # the emulated device: 16 MiB, far above what a step needs
    timeout_s: float = 3600.0  # per incarnation, whatever its progress
    stall_s: float = 120.0  # a hang: no rank logged an event (each step logs one) for this long
    kill: bool = True
    error: bool = True


# ==================================================================================================
# one rank of one incarnation (runs in its own process)
# ==================================================================================================
def _model(torch: Any) -> Any:
    from torch import nn

    class Inject(nn.Module):
        """Where mid-model OOMs are raised: in the forward, or in the backward through this point."""

        def __init__(self) -> None:
            super().__init__()
            self.forward_oom = False
            self.backward_oom = False

        def forward(self, h: Any) -> Any:
            if self.forward_oom:
                self.forward_oom = False
                raise torch.OutOfMemoryError("injected by the soak: out of memory in the forward")
            return _RaiseInBackward.apply(h, self)

    class _RaiseInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, h: Any, owner: Inject) -> Any:
            ctx.owner = owner
            return h.view_as(h)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            if ctx.owner.backward_oom:
                ctx.owner.backward_oom = False
                raise torch.OutOfMemoryError("injected by the soak: out of memory in the backward")
            return grad, None

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), Inject(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).double()


def _data(torch: Any, n: int, seed: int) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(16, 4, generator=g, dtype=torch.float64)).argmax(dim=1)
    return x, y, torch.arange(n)


class Injector:
    """The faults of one rank: drawn from (seed, step, forward number, rank), so that a replay after a
    restart meets the same ones; each one that fires is logged."""

    def __init__(self, spec: dict[str, Any], rank: int, first_step: int, inject: Any, log: Any) -> None:
        import torch

        self.torch, self.spec, self.rank, self.inject, self.log = torch, spec, rank, inject, log
        self.cfg = Config(**{k: tuple(v) if k == "worlds" else v for k, v in spec["config"].items()})
        self.step = first_step + 1  # the optimizer step in progress
        self.forward = 0  # training forwards in this step, replays included
        self.eval_key: tuple[int, int] = (-1, 0)  # (step evaluated after, forwards)
        self.low_until: int | None = None  # the budget is low until this step
        self.step_started = time.perf_counter()
        self.injected = 0  # OOMs injected in this step (this rank)
        self.seen_ooms = 0  # the meter's emulated OOMs so far
        self.last_peak: tuple[int, int, int] | None = None  # (peak, base, micro) of the last step

    def _rng(self, *key: Any) -> random.Random:
        # a string seed is hashed with SHA-512: the same draw in every process (hash() is salted per process)
        return random.Random("/".join(map(str, (self.spec["seed"], *key))))

    def loss(self, model: Any, batch: Any) -> Any:
        import torch.nn.functional as F

        x, y, ids = batch
        n = len(ids)
        if model.training:
            self.audit.forward(ids)
            k, self.forward = self.forward, self.forward + 1
            if k == 0:
                self.step_started = time.perf_counter()  # the step's time: its forwards, backwards, replays
                self._budget(n)
            self._one_shot(k)
            phase = self._oom_phase(k, n)
        else:
            at, count = self.eval_key
            at, count = (at, count) if at == self.step - 1 else (self.step - 1, 0)
            self.eval_key = (at, count + 1)
            phase = ("eval" if n >= 2 and self._rng("eval", at, count, self.rank).random() < self.cfg.p_eval_oom
                     else None)
            k = count
        if phase is not None:
            self.log(type="oom", phase=phase, step=self.step, forward=k, size=n)
            self.injected += phase != "eval"  # the training OOMs of this step (an evaluation is timed apart)
        # set (or cleared) at every call: a flag left by an attempt that an emulated OOM ended earlier
        # must not fire in a later forward (perhaps at a micro-batch of 1)
        self.inject.forward_oom = phase in ("forward", "eval")
        self.inject.backward_oom = phase == "backward"
        out = F.cross_entropy(model(x), y)
        if phase == "loss":
            raise self.torch.OutOfMemoryError("injected by the soak: out of memory in the loss")
        return out

    def _oom_phase(self, k: int, n: int) -> str | None:
        if n < 2:
            return None  # an OOM at a micro-batch of 1 would be DoesNotFitError: not a fault to survive
        mine = self._rng("oom", self.step, k, self.rank)
        shared = self._rng("multi", self.step, k)
        world = self.spec["world"]
        part = min(1.0, n * world / self.cfg.target_batch)  # this micro-batch's part of a rank's share
        several = (shared.random() < self.cfg.p_multi * part
                   and self.rank in shared.sample(range(world), shared.randint(2, world)))
        if mine.random() < self.cfg.p_oom * part or several:
            return mine.choice(("forward", "loss", "backward"))
        return None

    def _one_shot(self, k: int) -> None:
        shot = self.spec.get("one_shot")
        if not shot or shot["rank"] != self.rank or shot["step"] != self.step or shot["forward"] != k:
            return
        self.log(type=shot["kind"], step=self.step, forward=k)
        if shot["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"injected by the soak: a bad sample on rank {self.rank} at step {self.step}")

    def _budget(self, micro: int) -> None:
        """At a step's first forward (of ``micro`` samples): the budget may fall to where this micro-batch no
        longer fits, or come back."""
        from autoaccum.memory import active_budget

        meter = active_budget()
        if meter is None:
            return
        if self.low_until is not None and self.step >= self.low_until:
            meter.budget_bytes, self.low_until = self.spec["budget"], None
            self.log(type="budget_rise", step=self.step, budget=meter.budget_bytes)
            return
        rng = self._rng("budget", self.step, self.rank)
        if self.low_until is not None or self.last_peak is None or rng.random() >= self.cfg.p_drop:
            return
        peak, base, last_micro = self.last_peak
        params = sum(p.numel() * p.element_size() for p in self.inject_params)
        per_sample = max(1, (peak - base - params) // last_micro)  # activations and input copy, per sample
        # What a micro-batch of 1 surely fits in: another copy of the weights (the gradients, and the
        # transient new gradient a backward adds into an existing one: 9 KB of this model's 14 KB,
        # measured with TrackedMemory in a step of 64 micro-batches of 1; SGD with momentum allocates
        # nothing in its step once its buffers exist, and a drop comes after a step) and 2 samples. On
        # top of that the drop leaves 10% to 60% of the current micro-batch's activations (none where
        # that is less than the floor: at small micro-batches a drop could not bite).
        floor = meter.current_bytes + 2 * params + 2 * per_sample
        low = meter.current_bytes + 2 * params + int(rng.uniform(0.1, 0.6) * micro * per_sample)
        if low < floor:
            return
        meter.budget_bytes, self.low_until = low, self.step + rng.randint(1, 6)
        self.log(type="budget_drop", step=self.step, budget=low, until=self.low_until)

    def before_optimizer_step(self, *_: Any) -> None:
        from autoaccum.memory import active_budget

        # the micro-batch of the attempt that succeeded: the micro-batches whose gradients are held
        micro = max((len(self.audit.micro[m]) for m in set().union(*self.audit.pending.values())), default=0)
        inconsistent = self.audit.inconsistent
        self.audit.step()
        inconsistent = self.audit.inconsistent - inconsistent  # parameters whose gradients came from other samples
        meter = active_budget()
        emulated = 0
        if meter is not None:
            emulated, self.seen_ooms = meter.oom_count - self.seen_ooms, meter.oom_count
            params = sum(p.numel() * p.element_size() for p in self.inject_params)
            self.last_peak = (meter.peak_bytes, meter.current_bytes - params, max(1, micro))
        now = time.perf_counter()
        self.log(type="step", step=self.step, ids=self.audit.steps[-1], inconsistent=inconsistent,
                 duration_s=now - self.step_started, forwards=self.forward, injected=self.injected,
                 emulated_ooms=emulated, micro=micro)
        self.step, self.forward, self.injected, self.step_started = self.step + 1, 0, 0, now


def _leak_failed_gradients(injector: Injector, log: Any) -> None:
    """The soak's negative control (``--sabotage``): a guard that, once per rank, skips clearing the
    gradients of an attempt an injected OOM ended, so that they leak into the replayed step. The sample
    audit (ids of the failed attempt counted twice) and the parameter comparison must both catch it."""
    from autoaccum.guard.guard import OOMGuard

    clear = OOMGuard._zero_grad
    leaked = False

    def leaky(guard: OOMGuard) -> None:
        nonlocal leaked
        held = any(p.grad is not None for g in guard.optimizer.param_groups for p in g["params"])
        if injector.injected and held and not leaked:
            leaked = True
            log(type="sabotage", step=injector.step)
            return
        clear(guard)

    OOMGuard._zero_grad = leaky  # type: ignore[method-assign]


def run_rank(spec_path: str) -> None:
    """One rank of one incarnation of an episode (or of the fault-free reference)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for the stacks of a hang
    sys.path.insert(0, str(ROOT / "tests"))
    from _audit import IdAudit  # the audit the integration tests use

    import autoaccum
    from autoaccum.training.checkpoint import load_checkpoint

    spec = json.loads(Path(spec_path).read_text())
    cfg = Config(**{k: tuple(v) if k == "worlds" else v for k, v in spec["config"].items()})
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(spec["out"])
    events = (out / f"events{rank}.jsonl").open("a")

    def log(**event: Any) -> None:
        events.write(json.dumps({"incarnation": spec["incarnation"], "rank": rank, **event}) + "\n")
        events.flush()

    ckpt_dir = spec.get("checkpoint_dir")
    state = load_checkpoint(ckpt_dir) if ckpt_dir and spec["incarnation"] > 0 else None
    first_step = 0 if state is None else int(state["counters"]["steps"])
    log(type="start", first_step=first_step)
    model = _model(torch)
    audit = IdAudit(model)
    injector = Injector(spec, rank, first_step, model[2], log)
    injector.audit, injector.inject_params = audit, list(model.parameters())
    if not spec["faults"]:  # the fault-free reference
        injector.cfg = replace(cfg, p_oom=0.0, p_multi=0.0, p_eval_oom=0.0, p_drop=0.0)
    if spec.get("sabotage"):
        _leak_failed_gradients(injector, log)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    audit.watch(opt)
    opt.register_step_pre_hook(injector.before_optimizer_step)
    share = -(-cfg.target_batch // world)
    x, y, ids = _data(torch, cfg.samples, 1)
    ex, ey, eids = _data(torch, cfg.eval_samples, 2)
    eids = eids + cfg.samples
    result = autoaccum.fit(
        model, (x, y, ids), cfg.target_batch, loss_fn=injector.loss, optimizer=opt,
        eval_data=(ex, ey, eids), eval_every=cfg.eval_every, epochs=None, max_steps=cfg.steps, seed=3,
        plan=autoaccum.Plan.for_target(cfg.target_batch, cfg.micro_batch or share, world),
        budget=spec["budget"] if spec["faults"] else None, grow_after=1, checkpoint_dir=ckpt_dir,
        checkpoint_every=cfg.checkpoint_every if ckpt_dir else None, resume="auto" if ckpt_dir else False,
        progress=False, verbose=False)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"final{rank}.pt")
    log(type="done", steps=result.optimizer_steps, guard_ooms=result.oom_events, eval_ooms=result.eval_ooms)
    dist.destroy_process_group()


# ==================================================================================================
# the driver: episodes, incarnations, what torchrun's agent would do
# ==================================================================================================
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Incarnation:
    """How one launch of every rank ended."""

    one_shot: dict[str, Any] | None
    codes: list[int | None]
    seconds: float
    hang: bool
    aborts: int
    stderr_tails: list[str] = field(default_factory=list)


def _launch(spec: dict[str, Any], spec_path: Path, timeout_s: float, stall_s: float) -> Incarnation:
    spec_path.write_text(json.dumps(spec))
    port = _free_port()
    procs = []
    for rank in range(spec["world"]):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(spec["world"]), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(spec["world"]), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        err = (spec_path.parent / f"stderr{rank}.{spec['incarnation']}.txt").open("w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--rank-of", str(spec_path)], env=env, cwd=ROOT,
                                       stdout=subprocess.DEVNULL, stderr=err), err))
    started = time.monotonic()
    deadline, progress, logged = started + timeout_s, started, -1
    hang = False
    while any(p.poll() is None for p, _ in procs):
        now = time.monotonic()
        size = sum(f.stat().st_size for f in spec_path.parent.glob("events*.jsonl"))
        if size != logged:
            progress, logged = now, size
        if now > deadline or now - progress > stall_s:
            hang = True
            break
        time.sleep(0.1)
    alive = [p.poll() is None for p, _ in procs]
    if hang:  # where each live rank is stuck, into its stderr file, before it is killed
        for p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        time.sleep(2.0)
    for p, err in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        err.close()
    codes = [None if still else p.returncode for (p, _), still in zip(procs, alive)]
    tails = [(spec_path.parent / f"stderr{r}.{spec['incarnation']}.txt").read_text()[-2000:] for r in range(len(procs))]
    aborts = sum(c in (-6, 134) or "terminate called" in t for c, t in zip(codes, tails))
    return Incarnation(spec.get("one_shot"), codes, time.monotonic() - started, hang, aborts, tails)


def _one_shots(cfg: Config, world: int, rng: random.Random) -> list[dict[str, Any] | None]:
    """A kill, then an exception, then a clean run to the end (each at a random step, rank and micro-batch)."""
    shots: list[dict[str, Any] | None] = []
    low = 1
    for kind, on in (("kill", cfg.kill), ("error", cfg.error)):
        if on and low < cfg.steps:
            step = rng.randint(low + 1, max(low + 1, low + cfg.steps // 3))
            shots.append({"kind": kind, "rank": rng.randrange(world), "step": step, "forward": 0})
            low = step
    return shots + [None]


def run_episode(cfg: Config, world: int, episode: int, work: Path, faults: bool = True,
                sabotage: bool = False) -> dict[str, Any]:
    """Every incarnation of one episode; its events and final parameters are left in ``work``."""
    work.mkdir(parents=True)
    rng = random.Random(f"{cfg.seed}/{world}/{episode}")
    shots = _one_shots(cfg, world, rng) if faults else [None]
    seed = rng.getrandbits(32)  # the episode's faults
    runs = []
    for incarnation, shot in enumerate(shots):
        spec = {"config": asdict(cfg), "world": world, "seed": seed, "incarnation": incarnation, "one_shot": shot,
                "out": str(work), "faults": faults, "budget": cfg.budget, "sabotage": sabotage,
                "checkpoint_dir": str(work / "ckpt") if faults else None}
        runs.append(_launch(spec, work / "spec.json", cfg.timeout_s, cfg.stall_s))
        last = runs[-1]
        if last.hang or (shot is None and last.codes != [0] * world):
            break  # a hang, or a failure nobody injected: the episode ends here, reported
    return {"world": world, "episode": episode, "incarnations": runs}


# ==================================================================================================
# what the episodes show
# ==================================================================================================
def _events(work: Path, world: int) -> list[dict[str, Any]]:
    out = []
    for rank in range(world):
        path = work / f"events{rank}.jsonl"
        if path.exists():
            out += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return out


def expected_batches(cfg: Config, world: int) -> list[list[list[int]]]:
    """Per optimizer step, per rank: the sample ids the documented order gives (autoaccum.plan.data)."""
    import torch

    from autoaccum.plan.plan import rank_share

    steps: list[list[list[int]]] = []
    epoch = 0
    while len(steps) < cfg.steps:
        order = torch.randperm(cfg.samples, generator=torch.Generator().manual_seed(3 * 1_000_003 + epoch)).tolist()
        for start in range(0, cfg.samples, cfg.target_batch):
            chunk = order[start:start + cfg.target_batch]
            steps.append([sorted(chunk[rank_share(len(chunk), r, world)]) for r in range(world)])
        epoch += 1
    return steps[:cfg.steps]


def audit(events: list[dict[str, Any]], expected: list[list[list[int]]], world: int) -> dict[str, int]:
    """The steps that made the final weights: for each step number, its record from the last incarnation
    that reached it (a restart replays the steps after its checkpoint). Each must hold exactly its ids."""
    final: dict[tuple[int, int], list[int]] = {}
    for e in events:
        if e["type"] == "step":
            key = (e["step"], e["rank"])
            if key not in final or e["incarnation"] >= final[key][0]:
                final[key] = [e["incarnation"], e["ids"], e.get("inconsistent", 0)]
    lost = repeated = wrong = missing = inconsistent = 0
    for step, shares in enumerate(expected, start=1):
        union: list[int] = []
        for rank in range(world):
            if (step, rank) not in final:
                missing += 1
                continue
            got = final[(step, rank)][1]
            inconsistent += final[(step, rank)][2]
            union += set(got)  # a sample twice within a rank is counted here, twice across ranks below
            repeated += len(got) - len(set(got))
            wrong += sorted(set(got)) != shares[rank]
        want = {i for share in shares for i in share}
        lost += len(want - set(union))
        repeated += len(union) - len(set(union))
    return {"steps_audited": len(expected), "lost": lost, "repeated": repeated, "wrong_share": wrong,
            "missing_steps": missing, "inconsistent": inconsistent}


def compare_params(work: Path, reference: dict[str, Any], world: int) -> float | None:
    import torch

    worst = 0.0
    for rank in range(world):
        path = work / f"final{rank}.pt"
        if not path.exists():
            return None
        got = torch.load(path, weights_only=True)
        for name, want in reference.items():
            scale = want.abs().max().clamp_min(1e-30)
            worst = max(worst, float((got[name] - want).abs().max() / scale))
    return worst


def time_lost(events: list[dict[str, Any]]) -> dict[str, float]:
    """Per step (rank 0's clock), how much longer a step with an OOM took than the median OOM-free step
    that ran at the same micro-batch; over the OOMs (injected and emulated, all ranks) of those steps."""
    steps = [e for e in events if e["type"] == "step"]
    by_step: dict[tuple[int, int], dict[str, Any]] = {}
    for e in steps:
        entry = by_step.setdefault((e["incarnation"], e["step"]), {"ooms": 0})
        entry["ooms"] += e["injected"] + e["emulated_ooms"]
        if e["rank"] == 0:
            entry.update(duration=e["duration_s"], micro=e["micro"])
    calm: dict[int, list[float]] = {}
    for s in by_step.values():
        if s["ooms"] == 0 and "duration" in s:
            calm.setdefault(s["micro"], []).append(s["duration"])
    lost, ooms = 0.0, 0
    for s in by_step.values():
        if s["ooms"] and "duration" in s and s["micro"] in calm:
            lost += s["duration"] - statistics.median(calm[s["micro"]])
            ooms += s["ooms"]
    return {"lost_s": lost, "ooms_timed": ooms, "lost_per_oom_s": lost / ooms if ooms else 0.0,
            "calm_step_s": statistics.median([d for v in calm.values() for d in v]) if calm else 0.0}


def summarize(cfg: Config, episodes: list[dict[str, Any]], works: list[Path],
              references: dict[int, dict[str, Any]]) -> dict[str, Any]:
    rows = {}
    for world in cfg.worlds:
        mine = [(e, w) for e, w in zip(episodes, works) if e["world"] == world]
        expected = expected_batches(cfg, world)
        counts = {k: 0 for k in ("oom_forward", "oom_loss", "oom_backward", "oom_eval", "emulated_ooms",
                                 "budget_drop", "budget_rise", "error", "kill", "multi_rank_steps", "sabotage")}
        row = {"episodes": len(mine), "incarnations": 0, "hangs": 0, "aborts": 0, "unexpected_failures": 0,
               "not_ended_alone": 0, "lost": 0, "repeated": 0, "wrong_share": 0, "missing_steps": 0, "inconsistent": 0,
               "steps_audited": 0, "params_max_rel_diff": 0.0, "params_missing": 0, "lost_s": 0.0, "ooms_timed": 0,
               "wall_s": 0.0}
        for episode, work in mine:
            for inc in episode["incarnations"]:
                row["incarnations"] += 1
                row["hangs"] += inc.hang
                row["aborts"] += inc.aborts
                row["wall_s"] += inc.seconds
                shot = inc.one_shot
                if shot is None:
                    row["unexpected_failures"] += inc.codes != [0] * world
                else:  # every rank must end, with an error, on its own (the killed one by its signal)
                    others = [c for r, c in enumerate(inc.codes) if not (shot["kind"] == "kill" and r == shot["rank"])]
                    row["not_ended_alone"] += inc.hang or any(c in (0, None) for c in others)
            events = _events(work, world)
            for e in events:
                if e["type"] == "oom":
                    counts[f"oom_{e['phase']}"] += 1
                elif e["type"] in counts:
                    counts[e["type"]] += 1
                if e["type"] == "step":
                    counts["emulated_ooms"] += e["emulated_ooms"]
            per_step: dict[tuple[int, int], set[int]] = {}
            for e in events:
                if e["type"] == "oom" and e["phase"] != "eval":
                    per_step.setdefault((e["incarnation"], e["step"]), set()).add(e["rank"])
            counts["multi_rank_steps"] += sum(len(r) > 1 for r in per_step.values())
            for k, v in audit(events, expected, world).items():
                row[k] += v
            diff = compare_params(work, references[world], world)
            if diff is None:
                row["params_missing"] += 1
            else:
                row["params_max_rel_diff"] = max(row["params_max_rel_diff"], diff)
            lost = time_lost(events)
            row["lost_s"] += lost["lost_s"]
            row["ooms_timed"] += lost["ooms_timed"]
        row.update(counts)
        row["injected_faults"] = sum(counts[k] for k in counts
                                     if k not in ("emulated_ooms", "multi_rank_steps", "sabotage"))
        row["lost_per_oom_s"] = row["lost_s"] / row["ooms_timed"] if row["ooms_timed"] else 0.0
        rows[world] = row
    return rows


def table(rows: dict[int, dict[str, Any]]) -> str:
    cols = [("ranks", None), ("episodes", "episodes"), ("steps audited", "steps_audited"),
            ("injected faults", "injected_faults"), ("OOM fwd/loss/bwd/eval", None), ("emulated OOMs", "emulated_ooms"),
            ("budget drops/rises", None), ("errors", "error"), ("kills", "kill"), ("multi-rank OOM steps",
            "multi_rank_steps"), ("hangs", "hangs"), ("aborts", "aborts"), ("not ended alone", "not_ended_alone"),
            ("unexpected failures", "unexpected_failures"), ("lost", "lost"), ("repeated", "repeated"),
            ("inconsistent", "inconsistent"),
            ("params max rel diff", None), ("s lost per OOM", None)]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for world, r in rows.items():
        cells = []
        for name, key in cols:
            if key is not None:
                cells.append(str(r[key]))
            elif name == "ranks":
                cells.append(str(world))
            elif name.startswith("OOM"):
                cells.append(f"{r['oom_forward']}/{r['oom_loss']}/{r['oom_backward']}/{r['oom_eval']}")
            elif name.startswith("budget"):
                cells.append(f"{r['budget_drop']}/{r['budget_rise']}")
            elif name.startswith("params"):
                cells.append(f"{r['params_max_rel_diff']:.1e}" + (f" ({r['params_missing']} missing)"
                                                                  if r["params_missing"] else ""))
            else:
                cells.append(f"{r['lost_per_oom_s'] * 1e3:.1f} ms")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def soak(cfg: Config, work: Path, say: Any = print, sabotage: bool = False) -> dict[str, Any]:
    """Run the whole soak under ``work``; the figures (and every incarnation's exit codes) as a dict."""
    import torch

    started = time.monotonic()
    references, episodes, works = {}, [], []
    for world in cfg.worlds:
        ref = run_episode(cfg, world, -1, work / f"reference{world}", faults=False)
        if ref["incarnations"][-1].codes != [0] * world:
            raise RuntimeError(f"the fault-free reference on {world} ranks failed: {ref['incarnations'][-1]}")
        references[world] = torch.load(work / f"reference{world}" / "final0.pt", weights_only=True)
        for episode in range(cfg.episodes):
            path = work / f"w{world}e{episode}"
            episodes.append(run_episode(cfg, world, episode, path, sabotage=sabotage))
            works.append(path)
            codes = [i.codes for i in episodes[-1]["incarnations"]]
            say(f"  {world} ranks, episode {episode}: exit codes per incarnation {codes} "
                f"({time.monotonic() - started:.0f} s)")
    rows = summarize(cfg, episodes, works, references)
    total = sum(r["injected_faults"] for r in rows.values())
    return {"config": asdict(cfg), "rows": {str(k): v for k, v in rows.items()}, "injected_faults": total,
            "wall_time_s": time.monotonic() - started,
            "incarnations": [{"world": e["world"], "episode": e["episode"],
                              "runs": [{"one_shot": i.one_shot, "codes": i.codes, "seconds": round(i.seconds, 1),
                                        "hang": i.hang} for i in e["incarnations"]]} for e in episodes]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    parser.add_argument("--worlds", type=int, nargs="+", default=list(Config.worlds))
    parser.add_argument("--episodes", type=int, default=Config.episodes, help="episodes per world size")
    parser.add_argument("--steps", type=int, default=Config.steps, help="optimizer steps per episode")
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--target-batch", type=int, default=Config.target_batch,
                        help="global batch (smaller: cheaper steps once the guard backs off to small micro-batches)")
    for name in ("p_oom", "p_multi", "p_eval_oom", "p_drop"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(Config, name),
                            help=f"fault rate (default {getattr(Config, name)}; see Config)")
    parser.add_argument("--timeout", type=float, default=Config.timeout_s, help="seconds per incarnation")
    parser.add_argument("--stall", type=float, default=Config.stall_s,
                        help="seconds without an event from any rank that count as a hang")
    parser.add_argument("--keep", help="keep the episodes' files in this directory")
    parser.add_argument("--json-only", action="store_true")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--sabotage", action="store_true",
                        help="negative control: a guard that leaks a failed attempt's gradients once per rank "
                             "(the audit and the parameter check must report it)")
    args = parser.parse_args()
    if args.rank_of:
        run_rank(args.rank_of)
        return
    import torch

    cfg = Config(worlds=tuple(args.worlds), episodes=args.episodes, steps=args.steps, seed=args.seed,
                 timeout_s=args.timeout, stall_s=args.stall, target_batch=args.target_batch, p_oom=args.p_oom,
                 p_multi=args.p_multi, p_eval_oom=args.p_eval_oom, p_drop=args.p_drop)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="autoaccum-soak-"))
    say = (lambda *_: None) if args.json_only else print
    try:
        result = soak(cfg, work, say, sabotage=args.sabotage)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result.update(command="python tests/stress/soak.py " + " ".join(sys.argv[1:]),
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  machine=f"{platform.machine()}, {os.cpu_count()} CPUs", torch=torch.__version__,
                  python=platform.python_version())
    if not args.json_only:
        print(table({int(k): v for k, v in result["rows"].items()}))
        print(f"injected faults in total: {result['injected_faults']} · wall time {result['wall_time_s']:.0f} s\n")
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
