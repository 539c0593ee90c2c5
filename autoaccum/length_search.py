"""The probe for variable-length data: sizes at several lengths, and the memory model in (b, L).

At the longest length the usual search over sizes (``autoaccum.size_search``) finds the limit. At
the shortest and the median length one size each is measured, holding about half the tokens of
that limit (a conservative jump: attention without a fused kernel grows with the square of the
length). A :class:`~autoaccum.memory_model.TokenMemoryModel` is fitted on the two largest sizes at
the longest length and the points at the other lengths; from it the plan's token budget.
"""

from __future__ import annotations

import logging

from autoaccum.lengths import LengthProfile
from autoaccum.memory_model import MemoryModel, TokenMemoryModel, TokenPoint
from autoaccum.report import Candidate
from autoaccum.size_search import search_sizes
from autoaccum.stepper import Stepper

__all__ = ["SHORT_FRACTION", "search_lengths", "token_points"]

logger = logging.getLogger("autoaccum.probe")

#: the share of the longest length's limit (in tokens) measured at each shorter length
SHORT_FRACTION = 0.5


def token_points(candidates: list[Candidate], longest: int) -> list[TokenPoint]:
    """The points the token model is fitted on: the two largest sizes that ran at the longest length
    (the limit's neighbourhood: the peak is convex in b) and every size that ran at other lengths."""
    ran = [c for c in candidates if c.fwd_bwd_peak_bytes is not None and c.length is not None]
    at_longest = sorted((c for c in ran if c.length == longest), key=lambda c: c.micro_batch)[-2:]
    others = [c for c in ran if c.length != longest]
    return [TokenPoint(c.micro_batch, c.length, c.fwd_bwd_peak_bytes, c.opt_peak_bytes)  # type: ignore[arg-type]
            for c in at_longest + others]


def search_lengths(stepper: Stepper, profile: LengthProfile, smallest: int, upper: int, budget_bytes: int,
                   headroom: float, max_candidates: int) -> tuple[TokenMemoryModel | None, MemoryModel | None, str]:
    """Measure at the profile's lengths; returns the token model (None where it cannot be fitted), the
    model at the longest length, and a note on how the search ended."""
    stepper.length = profile.longest
    model_at_longest, note = search_sizes(stepper, smallest, upper, budget_bytes, headroom, max_candidates)
    limit = max(c.micro_batch for c in stepper.current.values() if c.status == "ok")
    for length in profile.probe_lengths()[1:]:
        stepper.length = length
        size = min(upper, max(smallest, int(SHORT_FRACTION * limit * profile.longest / length)))
        stepper.measure(size)
    stepper.length = profile.longest
    points = token_points(list(stepper.measured.values()), profile.longest)
    if len(points) < 3 or len({p.length for p in points}) < 2:
        return None, model_at_longest, note + "; one length only: planned by samples at the longest"
    token_model = TokenMemoryModel.fit(points)
    kind = "with a quadratic term" if token_model.per_token_sq_bytes > 0 else "linear in tokens"
    return token_model, model_at_longest, (f"{note}; token model {kind}, residual {token_model.residual:.2%} "
                                           f"on {token_model.num_points} points at {len(profile.probe_lengths())} "
                                           f"lengths")
