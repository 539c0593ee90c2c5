"""Measure -> model -> plan: real training steps at a few micro-batch sizes (``run``), the passes
themselves (``passes``), the search over sizes and lengths, the report, its cache, the fake-tensor
estimate and the plot."""

from autoaccum.probe.run import probe

__all__ = ["probe"]
