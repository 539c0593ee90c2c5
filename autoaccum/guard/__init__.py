"""The OOM guard on top of the exact step (``autoaccum.step``): ``guard`` (``OOMGuard``: replay a step on
the same samples after an OOM), ``policy`` (how the plan changes: shrink, memory savers, grow back,
thrash) and ``growth`` (what a size is predicted to need, from what clean steps took)."""
