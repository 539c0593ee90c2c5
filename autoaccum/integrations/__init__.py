"""autoaccum inside the trainers people already use: Hugging Face ``Trainer``, Lightning, Accelerate.

Each framework owns its optimizer step (clipping, scheduler, logging, checkpoints). autoaccum brings
the part that framework lacks: the exact gradient of one global batch, cut into micro-batches that
fit, with an out-of-memory error replayed on the same samples (``OOMGuard.accumulate``). The plan is
measured on the first global batch (``LazyGuard``).

- ``autoaccum.integrations.transformers.AutoAccumTrainer``: a drop-in ``transformers.Trainer``.
- ``autoaccum.integrations.lightning.AutoAccum``: a Lightning callback.
- ``autoaccum.integrations.accelerate.guard_for``: the guard for an Accelerate loop.

Each module imports its framework when it is imported itself, never from ``import autoaccum``
(extras ``autoaccum[transformers]``, ``autoaccum[lightning]``, ``autoaccum[accelerate]``).
"""

from autoaccum.integrations.lazy_guard import LazyGuard

__all__ = ["LazyGuard"]
