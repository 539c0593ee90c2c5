"""The plan: how a target global batch is cut into micro-batches, accumulation steps and ranks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from autoaccum.memory.savers import check_saver, describe_saver
from autoaccum.validate import check_positive_int

__all__ = ["Plan", "TokenBudget", "micro_sizes", "micro_step_count", "rank_share"]


def rank_share(global_size: int, rank: int, world_size: int) -> slice:
    """Which samples of a global batch of ``global_size`` rank ``rank`` takes: consecutive, split
    as evenly as it goes, the first ``global_size % world_size`` ranks taking one more. The one
    formula for a rank's share (the plan, the data and the guard all use it)."""
    base, extra = divmod(global_size, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def micro_step_count(largest_share: int, micro_batch: int) -> int:
    """Micro-steps every rank runs when the largest share of any rank is ``largest_share``."""
    return -(-largest_share // micro_batch)


def micro_sizes(share: int, micro_batch: int, steps: int, min_micro_batch: int = 1) -> tuple[int, ...]:
    """``share`` samples cut into ``steps`` micro-steps, as evenly as they go.

    The samples fill the fewest micro-batches of at most ``micro_batch`` (``ceil(share /
    micro_batch)`` of them), spread evenly (sizes differ by at most one, larger first, so that no
    micro-batch is needlessly tiny: 64 in 10 is ``7 x 4 + 6 x 6``, not ``7 x 9 + 1``), then empty
    micro-steps. Every rank runs the same ``steps`` (ranks that run different numbers of micro-steps
    can deadlock FSDP's collectives); an empty micro-step runs no forward.

    No micro-batch holds fewer than ``min_micro_batch`` samples (the smallest size the model trains
    at, e.g. 2 with BatchNorm) unless the whole share is smaller: where ``micro_batch`` and
    ``min_micro_batch`` leave no even cut (a share of 3 at micro 2, min 2), fewer micro-batches are
    used and one holds up to ``min_micro_batch - 1`` samples more than ``micro_batch``.

    Raises:
        ValueError: ``share`` needs more than ``steps`` micro-batches of ``micro_batch``.
    """
    if share == 0:
        return (0,) * steps
    count = micro_step_count(share, micro_batch)
    if min_micro_batch > 1:
        count = max(1, min(count, share // min_micro_batch))
    if count > steps:
        raise ValueError(f"{share} samples do not fit in {steps} micro-batches of {micro_batch}")
    base, extra = divmod(share, count)
    return (base + 1,) * extra + (base,) * (count - extra) + (0,) * (steps - count)


def _sizes_sum(sizes: tuple[int, ...]) -> str:
    """``(37, 37, 37, 37, 36, 36, 36)`` as ``37 x 4 + 36 x 3``; an empty micro-step as ``0``."""
    terms: list[list[int]] = []
    for size in sizes:
        if terms and terms[-1][0] == size:
            terms[-1][1] += 1
        else:
            terms.append([size, 1])
    return " + ".join(f"{size} x {count}" if count > 1 and size else
                      " + ".join(["0"] * count) if not size else str(size) for size, count in terms)


def _rank_groups(global_size: int, world_size: int) -> list[tuple[int, int, int]]:
    """The ranks grouped by share: ``(first rank, share, ranks)``; the first ``global % world`` ranks
    take one sample more (``rank_share``)."""
    base, extra = divmod(global_size, world_size)
    groups = [(0, base + 1, extra)] if extra else []
    return groups + ([(extra, base, world_size - extra)] if world_size > extra else [])


@dataclass(frozen=True)
class TokenBudget:
    """How much of a variable-length batch one micro-batch may hold (``autoaccum.memory.model``).

    ``b`` samples padded to length ``L`` cost ``b * (L + quadratic * L**2 + per_sample)``
    token-units: the tokens, the attention's quadratic term where the model has one (without a
    fused kernel), and what a sample costs whatever its length. A micro-batch fits when its cost is
    at most ``max_cost``.

    Attributes:
        max_cost: the token-units one micro-batch may hold.
        quadratic: the quadratic coefficient (per token of length), 0 for linear models.
        longest: the longest sample length planned for (a micro-batch of the smallest size at
            this length must fit).
        pass_cost: what one forward/backward pass costs beyond its tokens, in token-units (the
            time of a pass is about ``pass_cost + cost``): the cutter weighs padding against passes.
        per_sample: a sample's cost whatever its length, in token-units (may be negative).
    """

    max_cost: float
    quadratic: float = 0.0
    longest: int = 1
    pass_cost: float = 0.0
    per_sample: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_cost) and self.max_cost > 0):
            raise ValueError(f"Invalid max_cost: {self.max_cost!r}. Allowed range: finite and > 0")
        if not (math.isfinite(self.quadratic) and self.quadratic >= 0):
            raise ValueError(f"Invalid quadratic: {self.quadratic!r}. Allowed range: finite and >= 0")
        check_positive_int(self.longest, "longest")
        if not (math.isfinite(self.pass_cost) and self.pass_cost >= 0):
            raise ValueError(f"Invalid pass_cost: {self.pass_cost!r}. Allowed range: finite and >= 0")

    def unit(self, length: int) -> float:
        """The cost of one sample padded to ``length``."""
        return max(length + self.quadratic * length * length + self.per_sample, 1e-9)

    def cost(self, num_samples: int, length: int) -> float:
        return num_samples * self.unit(length)

    def max_batch(self, length: int) -> int:
        """The most samples of ``length`` one micro-batch may hold (0 if not even one)."""
        return int(self.max_cost // self.unit(length))

    def halved(self) -> TokenBudget:
        return dataclasses.replace(self, max_cost=self.max_cost / 2)

    def to_dict(self) -> dict[str, float | int]:
        return {"max_cost": self.max_cost, "quadratic": self.quadratic, "longest": self.longest,
                "pass_cost": self.pass_cost, "per_sample": self.per_sample}

    @classmethod
    def from_dict(cls, data: dict) -> TokenBudget:
        return cls(float(data["max_cost"]), float(data.get("quadratic", 0.0)), int(data.get("longest", 1)),
                   float(data.get("pass_cost", 0.0)), float(data.get("per_sample", 0.0)))


@dataclass(frozen=True)
class Plan:
    """``micro_batch x accum_steps x world_size`` covering ``target_batch`` exactly.

    Each optimizer step consumes exactly ``target_batch`` samples. Rank ``r`` gets
    ``rank_batch(r)`` of them (the target split as evenly as it goes), cut into ``accum_steps``
    micro-batches of at most ``micro_batch`` samples, as even as they go (``micro_sizes``). Every
    rank runs the same number of micro-steps; the step weights each micro-batch by its share of the
    global batch, so uneven micro-batches are exact.

    Attributes:
        micro_batch: samples per forward/backward on one rank (the largest micro-batch).
        accum_steps: micro-batches per optimizer step on each rank.
        world_size: number of data-parallel ranks.
        target_batch: samples per optimizer step, over all ranks together.
        min_micro_batch: the smallest micro-batch the model trains at (2 with BatchNorm, which
            needs more than one value per channel); no micro-batch is cut smaller, and the guard
            never shrinks below it.
        tokens: for variable-length data, the token budget each micro-batch is cut by
            (``autoaccum.plan.cut.TokenCut``); ``micro_batch`` is then the most samples a micro-batch may
            hold (at the shortest lengths) and ``accum_steps`` the fewest micro-steps a step takes:
            how many it takes depends on the lengths of its samples.
        saver: the memory saver a step runs with (``autoaccum.memory.savers``): ``"none"``,
            ``"checkpointing:k/N"`` (the first ``k`` of ``N`` blocks), ``"checkpointing"`` or ``"offload"``.
    """

    micro_batch: int
    accum_steps: int
    world_size: int
    target_batch: int
    min_micro_batch: int = 1
    tokens: TokenBudget | None = None
    saver: str = "none"

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accum_steps", "world_size", "target_batch", "min_micro_batch"):
            check_positive_int(getattr(self, name), name)
        check_saver(self.saver)
        if self.micro_batch < min(self.min_micro_batch, self.rank_batch(0)):
            raise ValueError(f"Invalid micro_batch: {self.micro_batch} is below the smallest micro-batch this model "
                             f"trains at ({self.min_micro_batch}). Allowed range: {self.min_micro_batch} ~ any")
        if self.target_batch < self.world_size:
            raise ValueError(
                f"Invalid target_batch: {self.target_batch} is smaller than world_size "
                f"{self.world_size}; every rank needs at least one sample. Use target_batch >= {self.world_size}."
            )
        share = self.rank_batch(0)
        if self.accum_steps != micro_step_count(share, self.micro_batch):
            raise ValueError(
                f"Plan does not cover target_batch {self.target_batch} exactly: micro_batch {self.micro_batch} "
                f"x accum_steps {self.accum_steps} x world_size {self.world_size}; for a share of {share} "
                f"samples per rank accum_steps must be {math.ceil(share / self.micro_batch)}. "
                f"Use Plan.for_target(...) to derive accum_steps."
            )

    @classmethod
    def for_target(cls, target_batch: int, micro_batch: int, world_size: int = 1, min_micro_batch: int = 1) -> Plan:
        """As few micro-steps as ``micro_batch`` allows, with micro-batches as equal as they go.

        ``target 256, micro 200`` gives ``128 x 2`` rather than ``200 + 56``: the same number of
        forward/backward passes and a lower peak; ``micro_batch`` is then the largest micro-batch
        cut (128), capped at the rank share.

        Raises:
            ValueError: ``micro_batch`` is below ``min_micro_batch`` (and below the rank share).
        """
        check_positive_int(target_batch, "target_batch")
        check_positive_int(micro_batch, "micro_batch")
        check_positive_int(world_size, "world_size")
        share = math.ceil(target_batch / world_size)
        if micro_batch < min(min_micro_batch, share):
            raise ValueError(f"Invalid micro_batch: {micro_batch} is below the smallest micro-batch this model trains "
                             f"at ({min_micro_batch}). Allowed range: {min_micro_batch} ~ any")
        accum = micro_step_count(share, min(micro_batch, share))
        return cls(math.ceil(share / accum), accum, world_size, target_batch, min_micro_batch)

    balanced = for_target  # an alias: every cut ``for_target`` makes is balanced

    def rank_batch(self, rank: int = 0) -> int:
        """Samples rank ``rank`` sees per optimizer step (the first ``target % world`` ranks get one more)."""
        bounds = rank_share(self.target_batch, rank, self.world_size)
        return bounds.stop - bounds.start

    def check_rank_batch(self, n: int, rank: int = 0, *, partial: bool = False) -> None:
        """Refuse a batch of ``n`` samples that is not rank ``rank``'s share of a step (invariant 1: the global
        batch is never changed silently); ``partial``: the epoch's smaller last batch, of which a rank's
        share may be empty under torch.distributed.

        Raises:
            ValueError: ``n`` is not the share (or, partial, more than it), or fewer than the smallest micro-batch.
        """
        expected = self.rank_batch(rank)
        if n != expected and not (partial and 0 <= n < expected and (n > 0 or self.world_size > 1)):
            hint = " (pass partial=True for the smaller last batch of an epoch)" if 0 < n < expected else ""
            raise ValueError(f"batch holds {n} samples; this rank's share of target_batch {self.target_batch} "
                             f"is {expected}{hint}. The global batch is never changed silently.")
        if 0 < n < self.min_micro_batch:
            raise ValueError(f"batch holds {n} sample(s), fewer than the smallest micro-batch this model trains at "
                             f"({self.min_micro_batch}: its BatchNorm gets one value per channel from one "
                             f"sample). Drop the epoch's smaller last batch (DataLoader(drop_last=True), or fit(..., "
                             f"last_batch='drop')) or make it hold at least {self.min_micro_batch} per rank.")

    def micro_sizes(self, rank: int = 0) -> tuple[int, ...]:
        """Micro-batch sizes of one optimizer step on ``rank``; they sum to ``rank_batch(rank)``.
        Every rank has ``accum_steps`` of them; a rank with one sample fewer than rank 0 may end
        with an empty micro-step."""
        return micro_sizes(self.rank_batch(rank), self.micro_batch, self.accum_steps, self.min_micro_batch)

    @property
    def last_micro_batch(self) -> int:
        """The smallest micro-batch rank 0 runs (the last one cut)."""
        return min(s for s in self.micro_sizes(0) if s > 0)

    @property
    def can_shrink(self) -> bool:
        """A smaller cut exists: the micro-batch is above the model's smallest (for a token budget:
        or the budget still holds more than the smallest micro-batch at the longest length)."""
        if self.tokens is not None:
            return self.tokens.max_batch(self.tokens.longest) > self.min_micro_batch or \
                self.micro_batch > self.min_micro_batch
        return self.micro_batch > self.min_micro_batch

    def halved(self) -> Plan:
        """The plan after an OOM: half the micro-batch (not below ``min_micro_batch``), the
        accumulation steps it then takes; a token budget is halved too."""
        if not self.can_shrink:
            raise ValueError(f"a micro-batch of {self.micro_batch} cannot be halved: it is the smallest this model "
                             f"trains at")
        plan = self.with_micro_batch(max(self.micro_batch // 2, self.min_micro_batch))
        if self.tokens is None:
            return plan
        tokens = self.tokens.halved()
        # never below the smallest micro-batch at the longest length
        floor = self.min_micro_batch * tokens.unit(tokens.longest)
        return dataclasses.replace(plan, tokens=dataclasses.replace(tokens, max_cost=max(tokens.max_cost, floor)))

    def with_micro_batch(self, micro_batch: int) -> Plan:
        """The same target, ranks, smallest size, token budget and saver, cut at ``micro_batch``."""
        return self._same(Plan.for_target(self.target_batch, micro_batch, self.world_size, self.min_micro_batch))

    def with_world_size(self, world_size: int) -> Plan:
        return self._same(Plan.for_target(self.target_batch, self.micro_batch, world_size, self.min_micro_batch))

    def with_min_micro_batch(self, min_micro_batch: int) -> Plan:
        """This plan for a model that trains at no fewer than ``min_micro_batch`` samples per micro-batch."""
        if min_micro_batch == self.min_micro_batch:
            return self
        return self._same(Plan.for_target(self.target_batch, self.micro_batch, self.world_size, min_micro_batch))

    def with_saver(self, saver: str) -> Plan:
        """This plan on another memory saver."""
        return dataclasses.replace(self, saver=saver)

    def _same(self, plan: Plan) -> Plan:
        """``plan`` with this plan's token budget and saver."""
        return plan if self.tokens is None and self.saver == "none" else \
            dataclasses.replace(plan, tokens=self.tokens, saver=self.saver)

    def describe(self) -> str:
        """How one optimizer step's samples are cut, written so that it adds up.

        ``batch 256 = 37 x 4 + 36 x 3 (7 micro-batches)``: four micro-batches of 37 samples and three
        of 36, one after another, their gradients accumulated. On several ranks each rank's share is
        cut alike: ``batch 128 = (10 + 9 x 6) per rank x 2 ranks (7 micro-batches each)``, or
        ``batch 129 = (10 x 2 + 9 x 5) on rank 0 + (10 + 9 x 6) on rank 1 (7 micro-batches each)``
        where shares differ by one (``+ 0``: an empty micro-step). Cut by length: ``batch 64 cut by
        length: up to 32 samples per micro-batch, 5 at the longest length (512); 2 or more
        micro-batches``. A memory saver ends it (``with checkpointing``).
        """
        saver = "" if self.saver == "none" else f" with {describe_saver(self.saver)}"
        if self.tokens is not None:
            return f"batch {self.target_batch}{self._ranks_by_length()} cut by length: {self.length_words()}{saver}"
        return f"batch {self.target_batch} = {self.cut_sum()} ({self.count_words()}){saver}"

    def cut_sum(self) -> str:
        """The cut as a sum of ``size x count`` terms that adds up to the target (see ``describe``)."""
        groups = _rank_groups(self.target_batch, self.world_size)
        if len(groups) == 1 and groups[0][2] == 1:
            return _sizes_sum(self.micro_sizes(0))
        terms = []
        for first, share, ranks in groups:
            text = _sizes_sum(self.micro_sizes(first))
            text = f"({text})" if "+" in text or " x " in text else text
            terms.append(f"{text} on rank {first}" if ranks == 1 and len(groups) > 1 else
                         f"{text} per rank x {ranks} rank{'s' if ranks > 1 else ''}")
        return " + ".join(terms)

    def count_words(self) -> str:
        """``7 micro-batches`` (``each`` on several ranks; the smallest micro-batch where it is above 1)."""
        text = f"{self.accum_steps} micro-batch{'es' if self.accum_steps > 1 else ''}"
        if self.world_size > 1:
            text += " each"
        if self.min_micro_batch > 1:
            text += f", none below {self.min_micro_batch} samples"
        return text

    def length_words(self) -> str:
        """A token budget in words: the most samples a micro-batch holds, how many at the longest length."""
        if self.tokens is None:
            return self.count_words()
        longest = self.tokens.longest
        at_longest = min(self.micro_batch, max(self.tokens.max_batch(longest), self.min_micro_batch))
        text = f"up to {self.micro_batch} sample{'s' if self.micro_batch > 1 else ''} per micro-batch"
        if at_longest < self.micro_batch:
            text += f", {at_longest} at the longest length ({longest:,})"
        if self.min_micro_batch > 1:
            text += f", none below {self.min_micro_batch}"
        each = " on each rank" if self.world_size > 1 else ""
        return text + f"; {self.accum_steps} or more micro-batches{each}, by the lengths"

    def _ranks_by_length(self) -> str:
        if self.world_size == 1:
            return ""
        return " = " + " + ".join(f"{share} on rank {first}" if ranks == 1 else f"{share} per rank x {ranks} ranks"
                                  for first, share, ranks in _rank_groups(self.target_batch, self.world_size)) + ","

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"micro_batch": self.micro_batch, "accum_steps": self.accum_steps,
                               "world_size": self.world_size, "target_batch": self.target_batch,
                               "min_micro_batch": self.min_micro_batch}
        if self.tokens is not None:
            out["tokens"] = self.tokens.to_dict()
        if self.saver != "none":
            out["saver"] = self.saver
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        try:
            fields = {k: data[k] for k in ("micro_batch", "accum_steps", "world_size", "target_batch")}
        except KeyError as exc:
            raise ValueError("a plan needs micro_batch, accum_steps, world_size and target_batch; "
                             f"missing {exc}") from None
        tokens = data.get("tokens")
        return cls(**fields, min_micro_batch=data.get("min_micro_batch", 1),
                   tokens=None if tokens is None else TokenBudget.from_dict(tokens), saver=data.get("saver", "none"))


#: where a run's plan came from, in a user's words (``FitResult.plan_source`` and the integrations' keys)
