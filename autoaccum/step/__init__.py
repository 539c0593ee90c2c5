"""One exact step on a global batch: the accumulated gradient (``accumulate``: weighted micro-batch
losses, token counts, gradients reduced once), the optimizer step after it (``optim``: unscale, check,
clip, step) and the default losses (``losses``). The OOM guard on top is ``autoaccum.guard``."""
