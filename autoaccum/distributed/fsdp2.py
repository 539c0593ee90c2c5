"""FSDP2's side of the accumulation window: every FSDP module unsharded once at the window's start,
no resharding and no reduce-scatter inside it, one reduce-scatter (SUM) after the ranks agreed.
The protocol around it is described in the package docstring (``autoaccum.distributed``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from autoaccum.distributed.process_group import _all_reduce

__all__: list[str] = []  # internal: DistributedSync drives it


class _FSDP2Window:
    """FSDP2 without collectives inside the accumulation window (see the package docstring).

    Public FSDP2 calls do the configuration (``set_requires_gradient_sync``, ``unshard``, ``reshard``,
    ``reset_iter_state``, ``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``,
    ``set_reduce_scatter_unused_params``). Three things have no public form in torch 2.13 and touch
    FSDP2's internals, here only: switching resharding off for the window and back (restoring each
    parameter group's own setting), clearing the unsharded gradients of a failed attempt, and running
    FSDP2's end-of-backward reduction (``_root_post_backward_final_callback``) once after the window.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.managed = {id(fp.sharded_param) for g in self._groups() for fp in g.fsdp_params}
        for name in ("reset_iter_state", "set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params"):
            if not hasattr(self.modules[0], name):
                raise RuntimeError(f"FSDP2 under autoaccum needs FSDPModule.{name} (torch >= 2.13); this is torch "
                                   f"{torch.__version__}. Upgrade torch, or wrap the model in DDP instead")
        # FSDP2 modules with no FSDP2 ancestor: the roots that own a backward's final reduction
        inner = {id(sub) for m in self.modules for sub in m.modules() if sub is not m}
        self.roots = [m for m in self.modules if id(m) not in inner]
        for m in self.modules:
            # The guard weights each micro-batch by its share of the global batch: SUM over ranks, no
            # division (gloo cannot run the PREMUL_SUM a divide factor uses); a parameter a rank did
            # not use adds zeros instead of leaving the ranks' reduce-scatters mismatched.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            m.set_reduce_scatter_unused_params(True, recurse=False)
        self.dirty = False  # a window ended by an exception: FSDP2's iteration state needs a reset
        self.saved: list[tuple[Any, Any, bool]] | None = None

    def _groups(self) -> list[Any]:
        return [g for m in self.modules for g in m._get_fsdp_state()._fsdp_param_groups]

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        self._open()
        yield

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Forward passes without gradients and without collectives: the same unsharded window (one
        all-gather at its start), resharded at its end. Without it each module's forward all-gathers,
        and an OOM in mid-forward on one rank sends it to the status exchange while the others wait
        in the next module's all-gather, until the process group's timeout."""
        self._open()
        try:
            yield
        finally:
            for root in self.roots:
                root.set_requires_gradient_sync(True)
            self._restore()  # local: frees the unsharded parameters, no collective

    def _open(self) -> None:
        if self.dirty:
            for root in self.roots:
                root.reset_iter_state()  # FSDP2's documented recovery after a forward/backward raised
            self.dirty = False
        for root in self.roots:
            root._get_fsdp_state()._lazy_init()  # what the first forward would do; unshard() needs it
            root.set_requires_gradient_sync(False)
        if self.saved is None:
            self.saved = [(g, g.post_forward_mesh_info, g.reshard_after_backward) for g in self._groups()]
        for g, _, _ in self.saved:
            g.post_forward_mesh_info = None  # no reshard after forward
            g.reshard_after_backward = False
        for m in self.modules:
            m.unshard()  # the window's only collective, before any user code runs
        for g, _, _ in self.saved:
            for fp in g.fsdp_params:  # what a failed attempt accumulated
                fp.unsharded_param.grad = None
                fp.unsharded_accumulated_grad = None

    def reduce(self, group: Any) -> None:
        # As for DDP: a parameter no rank used ends with no gradient (FSDP2 would reduce-scatter zeros).
        fsdp_params = [fp for g in self._groups() for fp in g.fsdp_params]
        local = [fp.unsharded_param.grad is not None or fp.unsharded_accumulated_grad is not None
                 for fp in fsdp_params]
        present = _all_reduce(torch.tensor(local, dtype=torch.int32), dist.ReduceOp.MAX, group).tolist()
        for root in self.roots:
            root.set_requires_gradient_sync(True)
            # Runs post_backward (reduce-scatter of the accumulated unsharded gradients) for every
            # parameter group, then waits for the reductions: FSDP2's own end of a backward.
            root._get_fsdp_state()._root_post_backward_final_callback()
        self._restore()
        for fp, used in zip(fsdp_params, present):
            if not used:
                fp.sharded_param.grad = None

    def _restore(self) -> None:
        if self.saved is not None:
            for g, post_forward, after_backward in self.saved:
                g.post_forward_mesh_info, g.reshard_after_backward = post_forward, after_backward
            self.saved = None
        for m in self.modules:
            m.reshard()
