"""One optimizer step on a global batch: the exact accumulated gradient (``accumulate``), the OOM guard
on top (``guard``: replay, shrink, grow back), its checks and results, how ranks agree (``sync``),
plan changes (``policy``), growth after an OOM (``growth``), the optimizer step (``optim``) and the
default losses (``losses``)."""
