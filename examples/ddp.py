"""``autoaccum.fit`` on several processes: the same script, launched with torchrun.

    torchrun --nproc-per-node 2 examples/ddp.py      # 2 ranks (CPU: gloo; GPUs: nccl, one per rank)
    python examples/ddp.py                           # 1 process: the same training, the same result

fit finds torchrun's environment, creates the process group, wraps the model in DDP, gives each
rank its own disjoint share of every global batch of 256, and agrees one plan (each rank probes
its own device under the emulated budget; the smallest micro-batch wins). Every micro-batch runs
under ``no_sync``; an OOM on any rank becomes a shrink on every rank; gradients are summed once
per optimizer step. Logs come from rank 0 only. Runs on CPU in seconds.
"""

import logging

import torch
import torch.distributed as dist
from torch import nn

import autoaccum
from autoaccum import distributed


def main() -> None:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("autoaccum.fit").setLevel(logging.INFO)  # fit logs its plan and summary on rank 0
    torch.manual_seed(0)  # the same data and initial weights on every rank (DDP broadcasts rank 0's anyway)
    x = torch.randn(4096, 20)
    y = (x @ torch.randn(20, 4)).argmax(dim=1)
    model = nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 4))

    result = autoaccum.fit(model, (x, y), target_batch=256, budget="256KiB", epochs=2, lr=3e-3, progress=False)

    info = distributed.world_info()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if info.world_size > 1:  # every rank holds the same weights: compare each rank's with rank 0's
        reference = weights.clone()
        dist.broadcast(reference, src=0)
        same = torch.tensor([int(torch.equal(reference, weights))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if info.rank == 0:
            print(f"{info.world_size} ranks, identical weights on every rank: {bool(same.item())}")
    if info.rank == 0:
        print(f"plan: {result.plan.describe()} · {result.optimizer_steps} steps · final loss {result.final_loss:.4f}")
    if distributed.is_distributed():
        # At exit (README, Many GPUs): destroy the group once this script's own collectives are done.
        # It joins gloo's worker threads, so none of them frees a tensor while the interpreter shuts down.
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
