"""The plan: how a target global batch is cut into micro-batches, accumulation steps and ranks."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Plan", "check_positive_int", "read_plan"]


def check_positive_int(value: object, name: str, *, hint: str = "") -> int:
    """``value`` as an int >= 1, or a ValueError/TypeError naming it and the allowed range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}){hint}")
    if value < 1:
        raise ValueError(f"Invalid {name}: {value}. Allowed range: 1 ~ any positive int{hint}")
    return value


@dataclass(frozen=True)
class Plan:
    """``micro_batch x accum_steps x world_size`` covering ``target_batch`` exactly.

    Each optimizer step consumes exactly ``target_batch`` samples. Rank ``r`` gets
    ``rank_batch(r)`` of them (the target split as evenly as it goes), cut into ``accum_steps``
    micro-batches of ``micro_batch`` samples, the last one smaller where the share does not
    divide (``micro_sizes``). Every rank runs the same number of micro-steps; the step weights
    each micro-batch by its share of the global batch, so an uneven last one is exact.

    Attributes:
        micro_batch: samples per forward/backward on one rank (the largest micro-batch).
        accum_steps: micro-batches per optimizer step on each rank.
        world_size: number of data-parallel ranks.
        target_batch: samples per optimizer step, over all ranks together.
    """

    micro_batch: int
    accum_steps: int
    world_size: int
    target_batch: int

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accum_steps", "world_size", "target_batch"):
            check_positive_int(getattr(self, name), name)
        if self.target_batch < self.world_size:
            raise ValueError(
                f"Invalid target_batch: {self.target_batch} is smaller than world_size "
                f"{self.world_size}; every rank needs at least one sample. Use target_batch >= {self.world_size}."
            )
        share = self.rank_batch(0)
        if self.accum_steps != math.ceil(share / self.micro_batch):
            raise ValueError(
                f"Plan does not cover target_batch {self.target_batch} exactly: micro_batch {self.micro_batch} "
                f"x accum_steps {self.accum_steps} x world_size {self.world_size}; for a share of {share} "
                f"samples per rank accum_steps must be {math.ceil(share / self.micro_batch)}. "
                f"Use Plan.for_target(...) to derive accum_steps."
            )

    @classmethod
    def for_target(cls, target_batch: int, micro_batch: int, world_size: int = 1) -> Plan:
        """The plan with the fewest accumulation steps for ``micro_batch`` (capped at the rank share)."""
        check_positive_int(target_batch, "target_batch")
        check_positive_int(micro_batch, "micro_batch")
        check_positive_int(world_size, "world_size")
        share = math.ceil(target_batch / world_size)
        micro = min(micro_batch, share)
        return cls(micro, math.ceil(share / micro), world_size, target_batch)

    @classmethod
    def balanced(cls, target_batch: int, max_micro_batch: int, world_size: int = 1) -> Plan:
        """As few micro-steps as ``max_micro_batch`` allows, with micro-batches as equal as they go.

        ``target 256, max 200`` gives ``128 x 2`` rather than ``200 + 56``: the same number of
        forward/backward passes and a lower peak."""
        first = cls.for_target(target_batch, max_micro_batch, world_size)
        return cls.for_target(target_batch, math.ceil(first.rank_batch(0) / first.accum_steps), world_size)

    def rank_batch(self, rank: int = 0) -> int:
        """Samples rank ``rank`` sees per optimizer step (the first ``target % world`` ranks get one more)."""
        base, extra = divmod(self.target_batch, self.world_size)
        return base + (1 if rank < extra else 0)

    def micro_sizes(self, rank: int = 0) -> tuple[int, ...]:
        """Micro-batch sizes of one optimizer step on ``rank``; they sum to ``rank_batch(rank)``.
        A rank with one sample fewer than rank 0 may end with an empty micro-step."""
        share = self.rank_batch(rank)
        sizes = [min(self.micro_batch, max(0, share - i * self.micro_batch)) for i in range(self.accum_steps)]
        return tuple(sizes)

    @property
    def last_micro_batch(self) -> int:
        return self.micro_sizes(0)[-1]

    def halved(self) -> Plan:
        """The plan after an OOM: half the micro-batch, the accumulation steps it then takes."""
        if self.micro_batch == 1:
            raise ValueError("a micro-batch of 1 cannot be halved")
        return Plan.for_target(self.target_batch, self.micro_batch // 2, self.world_size)

    def with_world_size(self, world_size: int) -> Plan:
        return Plan.for_target(self.target_batch, self.micro_batch, world_size)

    def describe(self) -> str:
        """``target 256 = micro 48 x accum 6 (last micro 16) x world 1``."""
        last = self.last_micro_batch
        tail = f" (last micro {last})" if last != self.micro_batch else ""
        return (f"target {self.target_batch} = micro {self.micro_batch} x accum {self.accum_steps}{tail} "
                f"x world {self.world_size}")

    def to_dict(self) -> dict[str, int]:
        return {"micro_batch": self.micro_batch, "accum_steps": self.accum_steps,
                "world_size": self.world_size, "target_batch": self.target_batch}

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        try:
            return cls(**{k: data[k] for k in ("micro_batch", "accum_steps", "world_size", "target_batch")})
        except KeyError as exc:
            raise ValueError(f"a plan needs micro_batch, accum_steps, world_size and target_batch; missing {exc}") from None


def read_plan(source: Any) -> Plan:
    """A :class:`Plan` from what the tools write: a Plan; an object with a ``.plan`` (ProbeReport,
    SearchResult); a dict (a plan, or a document with a ``"plan"`` entry); or the path of such a
    JSON document (``autoaccum probe --json``, ``autoaccum search --out``).

    Raises:
        ValueError: the file cannot be read or holds no plan.
        TypeError: ``source`` is none of those.
    """
    if isinstance(source, Plan):
        return source
    if isinstance(getattr(source, "plan", None), Plan):
        return source.plan
    if isinstance(source, (str, os.PathLike)):
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"Invalid plan file {str(source)!r}: {exc}") from None
    if isinstance(source, dict):
        return Plan.from_dict(source["plan"] if isinstance(source.get("plan"), dict) else source)
    raise TypeError(f"plan must be a Plan, a probe report, a search result, a dict or a JSON path, "
                    f"got {type(source).__name__}")
