"""What the overlapped step's per-tensor host work costs alone, in one process (issue 15, the ranks row).

The guard's step on 2 ranks trails the hand loop by a fixed part and a part per parameter tensor
(``ddp_versions.py --depth``, benchmarks/RESULTS.md). This times, per parameter tensor and without a
process group, the pieces of work the overlapped step does for every tensor in every step, side by
side with what each would replace:

- ``hook_register_remove``: registering the post-accumulate-grad hook that starts the buckets in the
  last backward and removing it after (``autoaccum.distributed.overlap``: once a step);
- ``backward_with_idle_hook``: a backward of ``--tensors`` small layers with such a hook left on each
  parameter (it returns at once) against the same backward without hooks: what keeping the hooks
  registered across micro-batches costs per backward instead;
- ``backward_empty_hook_dict``: the same backward after a hook was registered and removed (the
  parameter keeps an empty hook dictionary) against parameters that never had one, and
  ``backward_hook_dict_reset`` with that dictionary set back to None as well;
- ``copy_back_checked`` / ``copy_back_assign``: handing a summed gradient over as a view of the flat
  buffer, with the stride check ``copy_back`` makes, and the assignment alone;
- ``version_record_check``: what replaced most hooks (sixth session's lead, built in the seventh):
  each gradient of a bucket sent during the backward and its version counter recorded at the send,
  and compared after the backward (``_OverlappedReduce._late_params``);
- ``random_getstate``: Python's RNG state, captured once a step for an exact replay;
- ``move_to_pair`` / ``map_tensors_pair``: a micro-batch of two tensors already on the device through
  ``autoaccum.batch.move_to`` (returned as it is) and through the walk it did before (the containers
  rebuilt), once per micro-batch;
- ``loss_sum_tensor`` / ``loss_sum_host``: a micro-batch's loss added to the step's float64 loss sum,
  as a tensor (``add_(loss.detach(), alpha=size)``, what ``accumulate`` does on other devices) and on the
  host (``loss.item() * size`` added to a float, what it does for a CPU model), once per micro-batch;
- ``zero_grad_6`` / ``clear_6``: the gradients of 6 parameter tensors (the ddp_bench model's) dropped
  through ``optimizer.zero_grad(set_to_none=True)`` and directly (``p.grad = None``, what the guard does
  after the optimizer step), once per step (each timed call sets them first; that alone is timed too and
  taken off).

Medians of ``--repeats`` timings, alternating the compared variants. Prints a table, then one JSON
document. Not part of the test run.

    python benchmarks/host_costs.py [--tensors 100] [--repeats 30]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import timeit
from collections.abc import Callable

import torch

from autoaccum.batch import map_tensors, move_to


def _params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(n)]


def _time(fn: Callable[[], object], number: int) -> float:
    """Seconds per call: the best of 3 runs of ``number`` calls."""
    return min(timeit.repeat(fn, number=number, repeat=3)) / number


def _alternating(variants: dict[str, Callable[[], object]], before: dict[str, Callable[[], None]], repeats: int,
                 number: int) -> dict[str, float]:
    """Median microseconds per call of each variant, timed in alternating order (``before[name]()`` first)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(repeats):
        for name in (list(variants) if i % 2 else list(reversed(variants))):
            before[name]()
            times[name].append(_time(variants[name], number) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100, help="parameter tensors (16 x 16 each)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    for name in ("tensors", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    n = args.tensors
    params = _params(n)

    def register_remove() -> None:
        for handle in [p.register_post_accumulate_grad_hook(_idle) for p in params]:
            handle.remove()

    x = torch.randn(8, 16)
    plain, hooked = _params(n), _params(n)
    for p in hooked:
        p.register_post_accumulate_grad_hook(_idle)
    fresh, emptied, reset = _params(n), _params(n), _params(n)
    for p in emptied + reset:
        p.register_post_accumulate_grad_hook(_idle).remove()
    for p in reset:
        p._post_accumulate_grad_hooks = None  # the Python side as it was before any hook

    def backward(ps: list[torch.nn.Parameter]) -> Callable[[], None]:
        def run() -> None:
            sum((x @ p).sum() for p in ps).backward()
        return run

    flat = torch.empty(n * 256)
    views = [flat[i * 256:(i + 1) * 256].view(16, 16) for i in range(n)]
    grads = [torch.randn(16, 16) for _ in range(n)]

    def set_local_grads() -> None:
        for p, g in zip(params, grads):
            p.grad = g

    def checked() -> None:
        for p, v in zip(params, views):
            if p.grad is not None and p.grad.stride() != v.stride():
                p.grad.copy_(v)
            else:
                p.grad = v

    def assign() -> None:
        for p, v in zip(params, views):
            p.grad = v

    def version_record_check() -> None:
        current = [p.grad for p in params]
        versions = [-1 if g is None else g._version for g in current]
        late = []
        for p, g, v in zip(params, current, versions):
            now = p.grad
            if now is not g or (now is not None and now._version != v):
                late.append(p)

    nothing: Callable[[], None] = lambda: None  # noqa: E731
    hooks = _alternating({"hook_register_remove": register_remove}, {"hook_register_remove": nothing},
                         args.repeats, 200)
    idle = _alternating({"without_hooks": backward(plain), "with_idle_hooks": backward(hooked)},
                        {"without_hooks": nothing, "with_idle_hooks": nothing}, args.repeats, 20)
    empty = _alternating({"never_hooked": backward(fresh), "empty_hook_dict": backward(emptied),
                          "hook_dict_reset": backward(reset)},
                         {"never_hooked": nothing, "empty_hook_dict": nothing, "hook_dict_reset": nothing},
                         args.repeats, 20)
    # each timed call re-assigns the same views; the local gradients are put back before each timing
    copy_back = _alternating({"checked": checked, "assign": assign},
                             {"checked": set_local_grads, "assign": set_local_grads}, args.repeats, 200)
    versions = _alternating({"version_record_check": version_record_check},
                            {"version_record_check": set_local_grads}, args.repeats, 200)
    cpu = torch.device("cpu")
    pair = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    moves = _alternating({"move_to_pair": lambda: move_to(pair, cpu),
                          "map_tensors_pair": lambda: map_tensors(pair, lambda t: t if t.device == cpu else t.to(cpu))},
                         {"move_to_pair": nothing, "map_tensors_pair": nothing}, args.repeats, 2000)
    rng = _alternating({"random_getstate": random.getstate}, {"random_getstate": nothing}, args.repeats, 2000)
    loss = torch.nn.Parameter(torch.tensor(2.5)) * 1.0  # a 0-dim float32 loss that requires grad
    tensor_sum, host_sum = torch.zeros((), dtype=torch.float64), [0.0]

    def add_on_host() -> None:
        host_sum[0] += loss.item() * 8

    loss_sums = _alternating({"loss_sum_tensor": lambda: tensor_sum.add_(loss.detach(), alpha=8),
                              "loss_sum_host": add_on_host},
                             {"loss_sum_tensor": nothing, "loss_sum_host": nothing}, args.repeats, 2000)
    six = _params(6)
    optimizer = torch.optim.SGD(six, lr=0.1)

    def set_six() -> None:
        for p, g in zip(six, grads):
            p.grad = g

    def clear_six() -> None:
        for p in six:
            p.grad = None

    def zero_grad_six() -> None:
        set_six()
        optimizer.zero_grad(set_to_none=True)

    def set_clear_six() -> None:
        set_six()
        clear_six()

    # each timed call sets the 6 gradients and drops them: the setting alone is timed too, and taken off
    timed = _alternating({"zero_grad_6": zero_grad_six, "clear_6": set_clear_six, "set_6": set_six},
                         {"zero_grad_6": nothing, "clear_6": nothing, "set_6": nothing}, args.repeats, 2000)
    clears = {name: timed[name] - timed["set_6"] for name in ("zero_grad_6", "clear_6")}
    per_tensor = {
        "hook_register_remove": hooks["hook_register_remove"] / n,
        "backward_with_idle_hook": (idle["with_idle_hooks"] - idle["without_hooks"]) / n,
        "backward_empty_hook_dict": (empty["empty_hook_dict"] - empty["never_hooked"]) / n,
        "backward_hook_dict_reset": (empty["hook_dict_reset"] - empty["never_hooked"]) / n,
        "copy_back_checked": copy_back["checked"] / n,
        "copy_back_assign": copy_back["assign"] / n,
        "version_record_check": versions["version_record_check"] / n,
    }
    result = {"benchmark": "host_costs", "tensors": n, "repeats": args.repeats,
              "us_per_tensor": per_tensor, "random_getstate_us": rng["random_getstate"],
              "move_us": moves, "loss_sum_us": loss_sums, "clear_us": clears,
              "backward_us": {**idle, **empty}, "torch": torch.__version__, "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if not args.json_only:
        print(f"{n} parameter tensors (16 x 16), one process, one thread; medians of {args.repeats} timings")
        for name, us in per_tensor.items():
            print(f"  {name:<28}{us:8.3f} us a tensor")
        print(f"  {'random.getstate()':<28}{rng['random_getstate']:8.3f} us a call")
        for name, us in {**moves, **loss_sums}.items():
            print(f"  {name:<28}{us:8.3f} us a micro-batch")
        for name, us in clears.items():
            print(f"  {name:<28}{us:8.3f} us a step")
        print("  backward of all layers (us): " + ", ".join(f"{k} {v:.1f}" for k, v in result["backward_us"].items()))
    print(json.dumps(result, indent=1))


def _idle(_p: torch.Tensor) -> None:
    """A hook that does nothing (a disarmed one)."""


if __name__ == "__main__":
    main()
