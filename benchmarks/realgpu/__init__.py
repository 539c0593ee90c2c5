"""Real GPU (issue 16): the code of ``benchmarks/real_gpu.py``.

The data flows through the modules in this order: ``models`` (the four models, their data and the
memory each row is squeezed to) -> ``squeeze`` (the three squeezes) -> ``brute`` (real accumulated
steps, and the brute-force search over them) -> ``parts`` (estimate, each squeeze's probe, brute force
and fit, the throughput sweep, the optional search) -> ``runner`` (one model's parts in order, saved as
they finish: resumable) -> ``report`` (the rows, the issue's targets, the table, RESULTS.md) -> ``cli``.
"""
