"""The systems compared, one module each, and the registry that names them.

Adding a system: a module with ``run(ctx, recorder, budget) -> RunResult`` and one line in ``REGISTRY``
(with the package it needs, so that a machine without it reports the row as not installed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..context import Context, RunResult
from ..recorder import Recorder
from . import (
    accelerate_system,
    autoaccum_accelerate,
    autoaccum_lightning,
    autoaccum_system,
    autoaccum_trainer,
    hand,
    lightning_system,
    transformers_system,
)


@dataclass(frozen=True)
class System:
    run: Callable[[Context, Recorder, Any], RunResult]  # Any: the budget (emulated or CUDA)
    requires: str | None = None  # the peer package it imports (inside ``run``), checked before it runs


#: name -> system, in the order of the table's rows
REGISTRY: dict[str, System] = {
    "autoaccum": System(autoaccum_system.run),
    "accelerate": System(accelerate_system.run, requires="accelerate"),
    "autoaccum_accelerate": System(autoaccum_accelerate.run, requires="accelerate"),
    "lightning": System(lightning_system.run, requires="lightning"),
    "autoaccum_lightning": System(autoaccum_lightning.run, requires="lightning"),
    "transformers": System(transformers_system.run, requires="transformers"),
    "autoaccum_trainer": System(autoaccum_trainer.run, requires="transformers"),
    "hand": System(hand.run),
}
SYSTEMS = tuple(REGISTRY)
