"""Head-to-head (issue 7): autoaccum against the tools users would pick instead, measured in one run.

Run it as ``python benchmarks/compare.py``. The method (what each system does, the memory budget,
the runs, the columns and the measurement choices) is written up in benchmarks/RESULTS.md, section
"Head-to-head (issue 7)", subsection "Method".

The data flows through the modules in this order: ``workloads`` (models, data, loss) -> ``recorder``
(what each optimizer step saw) -> ``context`` (what a run gets and gives back) -> ``budget`` (the
memory budget and its calibration) -> ``systems`` (one module per system, and the registry) ->
``reference`` (full-batch training) -> ``report`` (summaries, table, RESULTS.md) -> ``runner`` (the
whole comparison) -> ``cli``.
"""
