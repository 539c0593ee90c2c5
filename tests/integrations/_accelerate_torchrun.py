"""An Accelerate loop on two spawned gloo processes as plain ``torchrun`` starts it on CPU, kept apart from the test
module so the processes import no transformers: ``Accelerator()`` without ``cpu=True`` (or ``ACCELERATE_USE_CPU``)
reports one process (``DistributedType.NO``) and leaves the loader unsharded, while the process group holds two."""

from __future__ import annotations

import os

import torch
from _mlp_rows import mlp, samples, token_loss


def _loop(guard_for) -> dict:
    """``accelerator.prepare``, ``guard_for``, one epoch; what Accelerate reported, and the refusal or what each
    global batch held on this rank."""
    import accelerate

    accelerator = accelerate.Accelerator()
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(samples(padded=True), batch_size=8)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    out = {"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes}
    try:
        guard = guard_for(accelerator, model, optimizer, micro_batch=4)
    except ValueError as exc:
        return {**out, "refused": str(exc)}
    seen = []
    for batch in loader:
        seen.append(batch["ids"].tolist())
        guard.accumulate(batch, token_loss)
        optimizer.step()
        optimizer.zero_grad()
    return {**out, "refused": None, "seen": seen, "world_size": guard.guard.plan.world_size}


def torchrun_loop(rank: int, world_size: int) -> dict:
    """Under torchrun's environment (the group exists: the harness made it): ``Accelerator()`` as is, then, as the
    refusal says, with ``ACCELERATE_USE_CPU=1`` (the negative control: Accelerate takes the group)."""
    from accelerate.state import AcceleratorState, GradientState

    from autoaccum.integrations.accelerate import guard_for

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    os.environ.pop("ACCELERATE_USE_CPU", None)
    plain = _loop(guard_for)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ["ACCELERATE_USE_CPU"] = "1"
    return {"plain": plain, "use_cpu": _loop(guard_for)}
