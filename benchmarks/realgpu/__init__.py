"""Real GPU: the code of ``benchmarks/real_gpu.py``.

The data flows through the modules in this order: ``models`` (the rows' models, their data and budgets)
-> ``squeeze`` (the memory left to this process) -> ``brute`` (real accumulated steps, the brute-force
search) -> ``loops`` (fit against the hand-written loop) -> ``parts`` (the estimate; the probe, brute force
and fit under the squeeze; the sweep) -> ``runner`` (one model's parts in order, saved as they finish) ->
``table`` (the table and targets) -> ``cli``.
"""
