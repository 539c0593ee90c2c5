"""Real GPU (issues 16 and 40): the code of ``benchmarks/real_gpu.py``.

The data flows through the modules in this order: ``models`` (the models, their data and the memory
each row is squeezed to) -> ``squeeze`` (the three squeezes) -> ``brute`` (real accumulated steps, and
the brute-force searches over them) -> ``loops`` (fit against a hand-written loop, issue 40) -> ``parts``
(estimate, each squeeze's probe, brute force and fit, the throughput sweep, the optional search) ->
``runner`` (one model's parts in order, saved as they finish: resumable) -> ``report`` (issue 16's rows,
targets, table, RESULTS.md) and ``table40`` (issue 40's) -> ``cli``.
"""
