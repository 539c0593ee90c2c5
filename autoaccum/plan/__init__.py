"""What a step is: batches and how they are cut, tasks, the Plan (micro-batch x accumulation x ranks =
the global batch, exactly), BatchNorm's smallest micro-batch, sample lengths, and global batches per
epoch and rank."""

from autoaccum.plan.plan import Plan, TokenBudget

__all__ = ["Plan", "TokenBudget"]
