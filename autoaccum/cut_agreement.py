"""What the ranks agree on before an attempt's micro-batches, in one exchange: the step's samples (the
weights' denominator), the micro-steps every rank runs, whether the gradient all-reduce overlaps the
last backward (every rank must vote for it), and the item count of a loss that counts items up front.

The exchange is a round trip that waits for every rank; on a 2-core CPU box with gloo it costs about
a millisecond, a few percent of a small step. Most steps do not need its answer to start: a full
step cut by sample count, with no item count up front, weighs each micro-batch by the plan's global
batch and runs the plan's micro-steps, which every rank can tell alone (a *guess*). Such a rank
starts its micro-batches at once and reads the answer only before the last one, where the overlap
vote is needed. That is allowed only where no collective runs inside the accumulation window (DDP
under ``no_sync``, a plain module, neither synchronising in forward: ``DistributedSync.quiet_window``;
a wrong guess makes a rank run forwards that another rank skips): every rank issues the same
collectives in the same order whether it guessed or waited. Otherwise, and for the last batch of an
epoch (``partial``), a token cut, or a loss that counts items, the rank waits for the answer first.

**Chained steps.** Where the last step was overlapped and every rank proposed it in that step's flag
(each rank proposes it where it could guess and had room to overlap), the next step has no exchange
of its own: every rank sends its row in that step's flag instead (the last gradient bucket,
``autoaccum.distributed.overlap``), and the answer is decided from those rows once every bucket is
done. The step is overlapped on every rank: it was agreed in the last step's flag, so every rank
issues the same collectives. A rank that cannot guess this time (its share is ``partial``, its loss
counts items, its window is not quiet) or whose memory no longer has room to overlap *sits out*:
it runs no micro-batch (so no rank runs an overlapped backward it voted against), sends zeros in
every bucket and a row that voids the attempt, and every rank runs it again with the exchange,
waiting for the answer first -- one attempt's compute on the other ranks, at the last batch of an
epoch or where memory turned tight. An error in the rows is raised on every rank then too, after
the buckets (their sums are dropped; nothing was stepped).

The answer is the same on every rank, and so is everything decided from it:

- a guess that was wrong (a rank guessed while another rank's share was partial) *voids* the
  attempt on every rank: its gradients are dropped and it is run again, waiting for the answer
  first (same samples, same result: nothing is changed silently);
- a loss that counts items on some ranks and not on others, or a step with no item to average,
  is an error on every rank, raised before any gradient is reduced;
- a rank whose allocator thrashed (CUDA allocator retries rising on consecutive steps, the guard's
  ``thrash_steps``) says so in its row: every rank learns which ranks did, and after the step, if
  it ran at its first attempt, every rank shrinks together (one rank's retries are its own, and a
  shrink is a collective every rank must issue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoaccum.cut import Cutter, SampleCut
from autoaccum.errors import TaskError
from autoaccum.plan import Plan
from autoaccum.sync import CUT_FIELDS, GradSync

__all__ = ["Agreed", "CutAgreement", "CutTerms", "agree_cut", "full_step_terms"]


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
    overlap: bool  # every rank voted to overlap (and the attempt is not void)
    void: bool  # some rank guessed wrong: every rank runs the attempt again
    error: TaskError | None  # raised on every rank
    thrashing: tuple[int, ...] = ()  # the ranks whose allocator thrashed (every rank shrinks after the step)


class CutAgreement:
    """One attempt's exchange: what this rank runs with now (``terms``), and the answer (``agreed()``).

    A chained attempt (``row`` given, no answer yet) gets its answer from the step's flag
    (:meth:`answer_with`); ``terms`` is then this rank's guess, or, where it sits out, its own
    numbers (it runs nothing with them)."""

    def __init__(self, guess: CutTerms | None, answer: Any, *, row: tuple[int, ...] | None = None) -> None:
        self._answer = answer
        self.guessed = guess is not None
        self.chained = answer is None
        self.row = row
        self._agreed: Agreed | None = None
        if guess is not None:
            self.terms = guess
        elif self.chained:
            assert row is not None
            self.terms = CutTerms(row[0], row[1], row[3] if row[4] else None)
        else:
            self.terms = self.agreed().terms

    @property
    def runs(self) -> bool:
        """This rank runs its micro-batches before the answer is known (it guessed), or the answer
        (waited for) lets it."""
        if self.guessed:
            return True
        if self.chained:
            return False  # it sits out: its row voids the attempt
        agreed = self.agreed()
        return not (agreed.void or agreed.error is not None)

    def answer_with(self, rows: tuple[tuple[int, ...], ...]) -> None:
        """A chained attempt's answer: every rank's row, as the step's flag brought them back."""
        if not self.chained or self._agreed is not None:
            raise RuntimeError("internal: only a chained attempt is answered by its flag, once")
        self._answer = rows

    def agreed(self) -> Agreed:
        """The answer (waits for the exchange the first time; never raises for what it holds)."""
        if self._agreed is None:
            if self._answer is None:
                raise RuntimeError("internal: a chained attempt's answer comes with its flag")
            rows = self._answer() if callable(self._answer) else self._answer
            self._agreed = _decide(rows)
        return self._agreed


def full_step_terms(cut: Cutter, plan: Plan, world_size: int) -> CutTerms | None:
    """What a full step runs with where every rank can tell it alone (a sample cut), else None."""
    if not isinstance(cut, SampleCut):
        return None
    shares = [plan.rank_batch(r) for r in range(world_size)]
    return CutTerms(sum(shares), max(cut.steps(None, share, plan) for share in shares), None)


def agree_cut(sync: GradSync, cut: Cutter, plan: Plan, *, num_samples: int, steps: int, vote: bool,
              items: int | None, may_guess: bool, chained: bool = False, thrash: bool = False) -> CutAgreement:
    """Start this attempt's exchange (one all-reduce); wait for it unless this rank may guess.

    Args:
        num_samples, steps, vote, items: this rank's samples, the micro-steps its cut needs, its
            overlap vote, and its item count up front (None: its loss counts none).
        may_guess: the step is full on this rank (not ``partial``) and the window runs no collective.
        chained: every rank agreed, in the last step's flag, that this attempt has no exchange: its
            row goes in this step's flag (:meth:`CutAgreement.answer_with`). The rank sits out
            where it cannot guess or has no room to overlap (``vote`` False).
        thrash: this rank's allocator thrashed (the guard's streak reached ``thrash_steps``).
    """
    may_guess = may_guess and items is None and sync.world_size > 1
    guess = full_step_terms(cut, plan, sync.world_size) if may_guess else None
    sits_out = chained and (guess is None or not vote)
    # the row carries the guess itself, so that whether it was right is decided from the rows alone
    # (the same on every rank, even where the ranks' plans differ), and whether the rank sat out
    row = (num_samples, steps, int(vote), items or 0, int(items is not None),
           guess.num_samples if guess is not None else 0, guess.steps if guess is not None else 0, int(sits_out),
           int(thrash))
    assert len(row) == CUT_FIELDS
    if chained:
        return CutAgreement(None if sits_out else guess, None, row=row)
    if sync.world_size == 1:
        return CutAgreement(None, (row,))
    if guess is not None:
        return CutAgreement(guess, sync.gather_async(row).result)  # type: ignore[attr-defined]
    return CutAgreement(None, sync.gather(row))


def _decide(rows: tuple[tuple[int, ...], ...]) -> Agreed:
    """What every rank concludes from the rows (samples, micro-steps, vote, items, counted, the
    guessed samples and micro-steps, 0 where the rank waited, whether it sat out a chained
    attempt, and whether its allocator thrashed)."""
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
    void = any((r[5] and CutTerms(r[5], r[6], None) != terms) or r[7] for r in rows)
    return Agreed(terms, overlap=all(r[2] for r in rows) and not void and error is None, void=void, error=error,
                  thrashing=tuple(rank for rank, r in enumerate(rows) if r[8]))
