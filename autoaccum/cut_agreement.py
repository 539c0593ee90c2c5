"""What the ranks agree on before an attempt's micro-batches, in one exchange: the step's samples (the
weights' denominator), the micro-steps every rank runs, whether the gradient all-reduce overlaps the
last backward (every rank must vote for it), the item count of a loss that counts items up front,
and which ranks' allocators thrashed.

The exchange is one small all-reduce, waited for before any micro-batch runs: no gradient collective
can be in flight then. Its answer is the same on every rank, and so is everything decided from it:

- a loss that counts items on some ranks and not on others, or a step with no item to average,
  is an error on every rank, raised before any gradient is computed;
- a rank whose allocator thrashed (CUDA allocator retries rising on consecutive steps, the guard's
  ``thrash_steps``) says so in its row: every rank learns which ranks did, and after the step
  every rank shrinks together (one rank's retries are its own, and a shrink is a collective every
  rank must issue).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoaccum.errors import TaskError
from autoaccum.sync import GradSync

__all__ = ["Agreed", "CutTerms", "agree_cut"]


@dataclass(frozen=True)
class CutTerms:
    """What an attempt's micro-batches run with."""

    num_samples: int  # samples of the global batch over all ranks
    steps: int  # micro-steps every rank runs
    num_items: int | None  # items of a loss that counts them up front, over all ranks


@dataclass(frozen=True)
class Agreed:
    """The exchange's answer, the same on every rank."""

    terms: CutTerms
    overlap: bool  # every rank voted to overlap (and there is no error)
    error: TaskError | None  # raised on every rank
    thrashing: tuple[int, ...] = ()  # the ranks whose allocator thrashed (every rank shrinks after the step)


def agree_cut(sync: GradSync, *, num_samples: int, steps: int, vote: bool, items: int | None,
              thrash: bool = False) -> Agreed:
    """One exchange of every rank's row; the answer.

    Args:
        num_samples: this rank's samples of the step.
        steps: the micro-steps this rank's cut needs (every rank runs the largest).
        vote: this rank votes to overlap the attempt's all-reduce.
        items: this rank's item count up front (None: its loss counts none).
        thrash: this rank's allocator thrashed (the guard's streak reached ``thrash_steps``).
    """
    row = (num_samples, steps, int(vote), items or 0, int(items is not None), int(thrash))
    return decide(sync.gather(row))


def decide(rows: tuple[tuple[int, ...], ...]) -> Agreed:
    """What every rank concludes from the rows (samples, micro-steps, vote, items, counted, thrash)."""
    counted = sum(r[4] for r in rows)
    num_items = sum(r[3] for r in rows) if counted else None
    terms = CutTerms(sum(r[0] for r in rows), max(r[1] for r in rows), num_items)
    error = None
    if 0 < counted < len(rows):
        error = TaskError("loss_fn.count_items counted items on some ranks and not on others; give every "
                          "rank batches of the same kind")
    elif num_items == 0:
        error = TaskError("the step's batch holds no item its loss averages over (every label is -100); "
                          "nothing to train on")
    return Agreed(terms, overlap=all(r[2] for r in rows) and error is None, error=error,
                  thrashing=tuple(rank for rank, r in enumerate(rows) if r[5]))
