"""``fit`` and its parts: its options (``config``), where its plan comes from (``plans``), the loop,
evaluation, learning-rate rules (``lr``), checkpoints and resuming, and what a run reports."""
