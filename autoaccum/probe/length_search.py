"""The probe for variable-length data: sizes at several lengths, and the memory model in (b, L).

At the longest length the usual search over sizes (``autoaccum.probe.size_search``) finds the
limit. At the shortest and the median length one size each is measured, holding SHORT_FRACTION of
the tokens of that limit (short of the budget: attention without a fused kernel grows with the
square of the length). A ``TokenMemoryModel`` is anchored on the line through the sizes at the
longest length (its intercept and cost per sample), its shape in ``L`` fitted on the shorter
lengths' sizes that came near the budget; the plan's token budget comes from it.
"""

from __future__ import annotations

import logging

from autoaccum.memory.model import MemoryModel, TokenMemoryModel, TokenPoint
from autoaccum.plan.lengths import LengthProfile
from autoaccum.probe.passes import Stepper
from autoaccum.probe.report import Candidate
from autoaccum.probe.size_search import search_sizes

__all__ = ["SHORT_FRACTION", "search_lengths", "token_points"]

logger = logging.getLogger("autoaccum.probe")

#: the share of the longest length's limit (in tokens) measured at each shorter length: near the
#: budget, where the plan operates (a point of few tokens peaks elsewhere in the step), and short of
#: it, in case the memory per token grows with the length
SHORT_FRACTION = 0.75


def token_points(candidates: list[Candidate], longest: int, limit_tokens: float) -> list[TokenPoint]:
    """The points the quadratic term is fitted on: sizes that ran at shorter lengths with at least half
    the tokens of the longest length's limit (near the budget, where the plan operates; a size of few
    tokens peaks elsewhere in the step)."""
    return [TokenPoint(c.micro_batch, c.length, c.fwd_bwd_peak_bytes, c.opt_peak_bytes)  # type: ignore[arg-type]
            for c in candidates if c.fwd_bwd_peak_bytes is not None and c.length is not None and c.length < longest
            and c.micro_batch * c.length >= limit_tokens / 2]


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
    if model_at_longest is None:  # one size at the longest length: no line to anchor a model in tokens
        return None, None, note + "; one size only: planned by samples at the longest length"
    points = token_points(list(stepper.measured.values()), profile.longest, limit * profile.longest)
    token_model = TokenMemoryModel.anchored(model_at_longest.base_bytes, model_at_longest.per_sample_bytes,
                                            profile.longest, model_at_longest.opt_peak_bytes, points)
    kind = "quadratic in the length" if token_model.per_token_sq_bytes > 0 else "linear in the length"
    return token_model, model_at_longest, (f"{note}; token model {kind}, from the longest length and "
                                           f"{len(points)} shorter one(s) measured near the budget")
