"""What a ``fit`` checkpoint holds, what resuming from one checks, and the run's position in its data.

A checkpoint is written atomically by ``autoaccum.checkpoint`` (one writer: rank 0) and loads with
``torch.load(weights_only=True)``. Resuming refuses a checkpoint written for another model shape,
another target batch or another data order, naming the first difference: continuing would train
a different run than the one that was interrupted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoaccum import checkpoint as ckpt
from autoaccum import distributed
from autoaccum.guard import OOMGuard
from autoaccum.state import capture_rng, restore_rng

__all__ = ["CHECKPOINT_FORMAT", "RunPosition", "check_resumable", "model_shapes", "restore_run", "save_run"]

CHECKPOINT_FORMAT = "autoaccum.fit/1"


@dataclass
class RunPosition:
    """Where a run stands: the next global batch to draw, and what it has done so far.

    Attributes:
        epoch, index: the epoch in progress and the number of the next global batch in it.
        steps, samples: optimizer steps taken and samples seen (resumed runs included).
        losses: every step's loss.
    """

    epoch: int = 0
    index: int = 0
    steps: int = 0
    samples: int = 0
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
    """Write the run's checkpoint (every rank calls this: FSDP2 gathers its shards collectively)."""
    if directory is None:
        return
    model_state, optimizer_state = distributed.full_state_dicts(model, optimizer)
    if rank != 0:  # one writer
        return
    ckpt.save_checkpoint(directory, {
        "format": CHECKPOINT_FORMAT, "model": model_state, "optimizer": optimizer_state,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(), "guard": guard.state_dict(),
        "position": {"epoch": position.epoch, "index": position.index}, "seed": seed,
        "target_batch": target_batch, "lr": lr, "shapes": model_shapes(distributed.unwrap_model(model)),
        "counters": {"steps": position.steps, "samples": position.samples, "losses": list(position.losses)},
        "rng": ckpt.rng_to_plain(capture_rng()),
    })


def restore_run(state: dict[str, Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                scaler: Any, guard: OOMGuard) -> RunPosition:
    """Load a checkpoint's training state into the run's objects; returns where the run stands."""
    distributed.load_full_state_dicts(model, optimizer, state["model"], state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    guard.load_state_dict(state["guard"])
    restore_rng(ckpt.rng_from_plain(state["rng"]))
    counters = state["counters"]
    return RunPosition(epoch=int(state["position"]["epoch"]), index=int(state["position"]["index"]),
                       steps=int(counters["steps"]), samples=int(counters["samples"]),
                       losses=[float(x) for x in counters["losses"]])
