"""Real GPU: the code of ``benchmarks/real_gpu.py``.

The data flows through the modules in this order: ``models`` (the models, their data and budgets) ->
``squeeze`` (the three squeezes) -> ``brute`` (real accumulated steps, brute-force searches) -> ``loops``
(fit against a hand-written loop) -> ``parts`` (estimate, probe, brute force and fit under a squeeze, the
sweep, the optional search) -> ``runner`` (one model's parts in order, saved as they finish) -> ``report``
(the default rows' table and targets) and ``table40`` (the issue40 rows') -> ``cli``.
"""
