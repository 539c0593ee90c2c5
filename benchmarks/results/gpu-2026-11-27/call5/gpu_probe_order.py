"""Scratch (not committed): is the on-device copy's 1 MiB at micro 192 the copy's, or the later run's?
Probes as the GPU test does: warm, host A, copy, host B, copy B; prints each run's candidates."""
import importlib
import sys

import torch

sys.path.insert(0, "tests")
from _probe_models import mlp, mlp_batch, mlp_loss  # noqa: E402

from autoaccum import probe  # noqa: E402

run_mod = importlib.import_module("autoaccum.probe.run")
model = mlp(in_dim=512, hidden=2048, out_dim=16).cuda()


def run(room):
    run_mod.WARM_UP_ROOM = room
    before = torch.cuda.memory_allocated()
    r = probe(model=model, loss_fn=mlp_loss, make_batch=mlp_batch(512, 16), target_batch=1024, budget="256MiB",
              headroom=0.1)
    return before, [(c.micro_batch, c.status, c.fwd_bwd_peak_bytes, c.opt_peak_bytes) for c in r.candidates]


for name, room in [("warm", 10 ** 9), ("host_a", 10 ** 9), ("copy_a", 4), ("host_b", 10 ** 9), ("copy_b", 4)]:
    before, cands = run(room)
    print(name, "allocated before", before, cands, flush=True)
