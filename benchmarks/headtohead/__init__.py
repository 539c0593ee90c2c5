"""Head-to-head: autoaccum against the tools users would pick instead, measured in one run.

Run it as ``python benchmarks/compare.py``. The data flows through the modules in this order:
``workloads`` (models, data, loss) -> ``recorder`` (what each optimizer step saw) -> ``context`` (what a
run gets and gives back) -> ``budget`` (the memory budget and its calibration) -> ``systems`` (one module
per system, and the registry) -> ``reference`` (full-batch training) -> ``report`` (summaries, table) ->
``savers`` (where one sample does not fit: fit against a hand-configured run in one process) -> ``runner``
(the whole comparison) -> ``cli``.
"""
