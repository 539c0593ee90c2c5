"""The Accelerate loop of test_integrations_accelerate on two spawned processes (gloo), kept apart from
that module so the processes import no transformers: an MLP with a token-level loss on padded rows."""

from __future__ import annotations

import os

import torch
from _audit import IdAudit
from _mlp_rows import mlp, samples, token_loss

GLOBAL = 16


def two_process_loop(rank: int, world_size: int) -> dict:
    """Each loader yields its share (8) of every global batch of 16. Rank 1 alone runs out of memory in
    step 3's second forward; both ranks replay that step."""
    import accelerate

    from autoaccum.integrations.accelerate import guard_for

    # as torchrun sets them; the process group exists already (the harness made it) and Accelerate takes it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    accelerator = accelerate.Accelerator(cpu=True)
    net = mlp()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(samples(padded=True), batch_size=GLOBAL // world_size)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    guard = guard_for(accelerator, model, optimizer, micro_batch=3)
    audit = IdAudit(model)
    audit.watch(optimizer)
    oom = {"armed": None}

    def loss_fn(m: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        audit.forward(batch["ids"].tolist())
        if oom["armed"] is not None:
            oom["armed"] -= 1
            if oom["armed"] == 0:
                oom["armed"] = None
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (injected by the test)")
        return token_loss(m, batch)  # through the DDP wrapper, inside the guard's no_sync window

    for step, batch in enumerate(loader, 1):
        oom["armed"] = 2 if step == 3 and rank == 1 else None
        guard.accumulate(batch, loss_fn)
        audit.step()
        optimizer.step()
        optimizer.zero_grad()
    return {"params": [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()],
            "steps": audit.steps, "wrapper": type(model).__name__, "plan": guard.guard.plan.to_dict(),
            "changes": [(c.step, c.reason) for c in guard.guard.changes]}
