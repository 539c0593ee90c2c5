"""What a ``fit`` checkpoint holds, what resuming from one checks, and the run's position in its data.

A checkpoint is written atomically by ``autoaccum.training.checkpoint`` (one writer: rank 0) and loads with
``torch.load(weights_only=True)``. It holds the model and optimizer (full state, FSDP2 shards
gathered), scheduler, scaler, the guard's plan and counters, the position in the data, the run's
counters (steps, samples, skipped steps, the last step's loss: a fixed size, however long the run;
every step's loss is in the metrics file) and **every rank's RNG state**, gathered to rank 0 (a
list indexed by rank; each rank restores its own, so dropout on rank 1 continues as rank 1's).

Resuming refuses a checkpoint written for another model shape, another target batch or another
data order, naming the first difference: continuing would train a different run than the one that
was interrupted. Under another number of ranks each rank ``r`` restores the RNG state rank ``r``
saved where there was one, and a rank the checkpoint has none for keeps its generators as they are
(warned: the run goes on, but the random draws are not those of any uninterrupted run).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoaccum import distributed
from autoaccum.guard.guard import OOMGuard
from autoaccum.log import user_stacklevel
from autoaccum.state import capture_rng, restore_rng
from autoaccum.training import checkpoint as ckpt

__all__ = ["CHECKPOINT_FORMAT", "RunPosition", "check_resumable", "model_shapes", "restore_run", "save_run"]

CHECKPOINT_FORMAT = "autoaccum.fit/1"


@dataclass
class RunPosition:
    """Where a run stands: the next global batch to draw, and what it has done so far.

    Attributes:
        epoch: the epoch in progress.
        index: the number of the next global batch in it.
        steps: optimizer steps taken (resumed runs included).
        samples: samples seen (resumed runs included).
        skipped: steps skipped for inf/NaN gradients (resumed runs included).
        last_loss: the last step's loss (resumed runs included), None before the first step.
        losses: the loss of each step this process ran (not saved: a checkpoint stays one size).
    """

    epoch: int = 0
    index: int = 0
    steps: int = 0
    samples: int = 0
    skipped: int = 0
    last_loss: float | None = None
    losses: list[float] = field(default_factory=list)


def model_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def check_resumable(state: dict[str, Any], directory: Path, model: torch.nn.Module, target_batch: int,
                    seed: int) -> None:
    """Raise ValueError when ``state`` cannot continue this run (format, model shapes, target, seed)."""
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{directory} holds a checkpoint of format {state.get('format')!r}, not {CHECKPOINT_FORMAT}")
    shapes = model_shapes(model)
    if state["shapes"] != shapes:
        diff = next((k for k in set(state["shapes"]) | set(shapes) if state["shapes"].get(k) != shapes.get(k)), "?")
        raise ValueError(f"the checkpoint in {directory} was written for a model of other shapes (first difference: "
                         f"{diff!r}: {state['shapes'].get(diff)} vs {shapes.get(diff)}); resume it with the same "
                         f"model, or use another checkpoint_dir / resume=False")
    if state["target_batch"] != target_batch:
        raise ValueError(f"the checkpoint was written with target_batch {state['target_batch']}, this run asks for "
                         f"{target_batch}; resume with the same global batch")
    if state.get("seed", seed) != seed:  # another order would repeat some samples of the epoch and skip others
        raise ValueError(f"the checkpoint was written with seed {state['seed']}, this run asks for seed {seed}; "
                         f"resume with seed={state['seed']} (the data order of the epoch in progress)")


def save_run(directory: Path | None, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             scaler: Any, guard: OOMGuard, position: RunPosition, seed: int, target_batch: int, lr: float,
             rank: int) -> None:
    """Write the run's checkpoint (every rank calls this: FSDP2 gathers its shards collectively, and
    every rank's RNG state is gathered to rank 0)."""
    if directory is None:
        return
    model_state, optimizer_state = distributed.full_state_dicts(model, optimizer)
    rngs = distributed.gather_to_rank_zero(ckpt.rng_to_plain(capture_rng()))
    if rank != 0 or rngs is None:  # one writer
        return
    ckpt.save_checkpoint(directory, {
        "format": CHECKPOINT_FORMAT, "model": model_state, "optimizer": optimizer_state,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(), "guard": guard.state_dict(),
        "position": {"epoch": position.epoch, "index": position.index}, "seed": seed,
        "target_batch": target_batch, "lr": lr, "shapes": model_shapes(distributed.unwrap_model(model)),
        "counters": {"steps": position.steps, "samples": position.samples, "skipped": position.skipped,
                     "last_loss": position.last_loss},
        "rng": rngs,  # indexed by rank
    })


def restore_run(state: dict[str, Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                scaler: Any, guard: OOMGuard, rank: int = 0, world_size: int = 1) -> RunPosition:
    """Load a checkpoint's training state into the run's objects, and this rank's RNG state; returns
    where the run stands."""
    distributed.load_full_state_dicts(model, optimizer, state["model"], state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    guard.load_state_dict(state["guard"])
    _restore_rank_rng(state["rng"], rank, world_size)
    counters = state["counters"]
    last_loss = counters.get("last_loss")
    if "losses" in counters:  # counters that hold every step's loss: the last one is the one kept
        last_loss = float(counters["losses"][-1]) if counters["losses"] else None
    return RunPosition(epoch=int(state["position"]["epoch"]), index=int(state["position"]["index"]),
                       steps=int(counters["steps"]), samples=int(counters["samples"]),
                       skipped=int(counters.get("skipped", 0)),
                       last_loss=None if last_loss is None else float(last_loss))


def _restore_rank_rng(saved: Any, rank: int, world_size: int) -> None:
    """This rank's RNG state from the checkpoint's list (one per rank that saved it)."""
    if isinstance(saved, dict):  # one state for the run, not a list per rank: rank 0's, restored everywhere
        restore_rng(ckpt.rng_from_plain(saved))
        return
    if len(saved) != world_size and rank == 0:
        warnings.warn(f"the checkpoint holds the RNG states of {len(saved)} rank(s) and this run has {world_size}: "
                      f"ranks 0..{min(len(saved), world_size) - 1} restore their own, "
                      + (f"ranks {len(saved)}..{world_size - 1} keep their generators as they are; " if
                         world_size > len(saved) else "")
                      + "the run goes on, but its random draws (dropout) are not those of an uninterrupted run",
                      RuntimeWarning, stacklevel=user_stacklevel())
    if rank < len(saved):
        restore_rng(ckpt.rng_from_plain(saved[rank]))
