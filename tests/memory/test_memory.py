"""autoaccum.memory: the tracked counter (exact on CPU), the emulated budget, fake tensors, CUDA/NVML."""

import warnings

import pytest
import torch
from _probe_models import measure_phases, mlp, mlp_batch, mlp_loss
from torch._subclasses.fake_tensor import FakeTensorMode

import autoaccum
from autoaccum import TrackedMemory, emulated_budget, is_oom
from autoaccum.memory import CudaMeter, device_capacity, iter_tensors
from autoaccum.memory.capacity import cuda_capacity
from autoaccum.memory.cuda import _nvml

N = 1000


# -- exact counts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, itemsize", [(torch.float32, 4), (torch.float64, 8), (torch.bfloat16, 2),
                                             (torch.int64, 8), (torch.bool, 1)])
def test_an_allocation_of_n_elements_adds_n_times_the_item_size(dtype, itemsize):
    with TrackedMemory() as mem:
        x = torch.empty(N, dtype=dtype)
        assert mem.current_bytes == itemsize * N
        y = torch.zeros(3, N, dtype=dtype)
        assert mem.current_bytes == 4 * itemsize * N
        del x, y
        assert mem.current_bytes == 0
        assert mem.peak_bytes == 4 * itemsize * N


def test_views_and_in_place_ops_add_nothing():
    with TrackedMemory() as mem:
        x = torch.ones(4, N)
        views = [x.view(N, 4), x[1:], x.t(), x.reshape(-1), x.unsqueeze(0), x.narrow(1, 0, 10), x.detach()]
        x.add_(1).mul_(2).relu_()
        x[0].zero_()
        torch.sigmoid(x, out=x)
        assert mem.current_bytes == 16 * N
        assert mem.peak_bytes == 16 * N
        del views


def test_freed_tensors_decrease_the_count_when_their_storage_dies():
    with TrackedMemory() as mem:
        x = torch.ones(N)
        y = torch.ones(2 * N)
        v = x[:10]
        del x
        assert mem.current_bytes == 12 * N  # the view keeps x's storage alive
        del v
        assert mem.current_bytes == 8 * N
        del y
        assert mem.current_bytes == 0
        storage_ref = torch.ones(N).untyped_storage()  # a storage handle alone keeps the bytes live
        assert mem.current_bytes == 4 * N
        del storage_ref
        assert mem.current_bytes == 0


def test_temporaries_count_in_the_peak_only():
    with TrackedMemory() as mem:
        x = torch.ones(N)
        y = (x * 2 + 1).sum()  # x*2 and +1 are freed as soon as sum has run
        assert mem.current_bytes == 4 * N + 4
        assert mem.peak_bytes == 4 * N + 4 * N + 4 * N  # x, x*2, x*2+1 alive together
        mem.reset_peak()
        assert mem.peak_bytes == mem.current_bytes
        del y


def test_tensors_from_before_count_only_when_tracked_and_only_once():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    expected = sum(t.numel() * t.element_size() for t in iter_tensors([model, optimizer]))
    params = sum(p.numel() * 4 for p in model.parameters())
    assert expected == params * 4 + 4 * len(list(model.parameters()))  # weights, grads, 2 moments, steps
    with TrackedMemory() as mem:
        assert mem.current_bytes == 0
        mem.track(model, optimizer)
        assert mem.current_bytes == expected
        mem.track(model, optimizer, list(model.parameters()))
        assert mem.current_bytes == expected
    outside = torch.ones(N)  # made while no meter is active: never counted
    assert mem.current_bytes == expected
    del outside



class _LazyTable(torch.nn.Module):
    """Builds a positional table at its first forward and keeps it as a plain attribute (Lightning's demo
    transformer does so): no parameter, no buffer, on the device all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.table: torch.Tensor | None = None
        self._cache: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.ones(1024, 8)
            self._cache = (torch.zeros(512, 8),)
        return self.proj(x) + self.table[: x.shape[0]] + self._cache[0][: x.shape[0]]


def test_tensors_a_forward_cached_as_module_attributes_count_when_tracked():
    """The emulated device counted parameters, buffers and optimizer state only: a table made in the probe's first
    forward and kept as an attribute was never counted in training (8 MiB off under Lightning's demo). Tracked
    now, once each; the control is the same model before its first forward."""
    model = _LazyTable()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert TrackedMemory().track(model).current_bytes == weights  # nothing cached yet
    model(torch.randn(4, 8))
    assert TrackedMemory().track(model).current_bytes == weights + (1024 + 512) * 8 * 4
    assert TrackedMemory().track(model, model).current_bytes == weights + (1024 + 512) * 8 * 4  # once

def test_counts_are_repeatable():
    readings = set()
    for _ in range(3):
        readings.add(measure_phases(mlp(), mlp_batch(), mlp_loss, 64))
    assert len(readings) == 1


# -- emulated budget ------------------------------------------------------------------------------

def _phases(b: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, tuple, dict[str, int]]:
    """A fresh MLP, its AdamW (no state yet), a batch, and the live bytes at the start of the step
    and the peaks of forward, backward and the first optimizer step (counted without a budget)."""
    model, batch = mlp(64, 256), mlp_batch(64)(b)
    optimizer = torch.optim.AdamW(model.parameters())
    probe_model = mlp(64, 256)
    probe_opt = torch.optim.AdamW(probe_model.parameters())
    with TrackedMemory().track(probe_model, probe_opt, batch) as mem:
        start = mem.current_bytes
        loss = mlp_loss(probe_model, batch)
        forward = mem.peak_bytes
        mem.reset_peak()
        loss.backward()
        backward = mem.peak_bytes
        del loss
        mem.reset_peak()
        probe_opt.step()
        step = mem.peak_bytes
    return model, optimizer, batch, {"start": start, "forward": forward, "backward": backward, "step": step}


def _step_until_oom(model, optimizer, batch, budget: int) -> tuple[str, TrackedMemory, str | None]:
    """Run one step under ``budget``; the phase it stopped in and the OOM message, if any.
    The exception itself is not kept: its traceback would keep the failed step's tensors alive."""
    phase, message = "forward", None
    with emulated_budget(budget, model, optimizer, batch) as mem:
        try:
            loss = mlp_loss(model, batch)
            phase = "backward"
            loss.backward()
            del loss
            phase = "step"
            optimizer.step()
            phase = "done"
        except torch.OutOfMemoryError as exc:
            assert is_oom(exc) and type(exc) is torch.OutOfMemoryError
            message = str(exc)
    return phase, mem, message


@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_the_emulated_budget_raises_oom_where_a_device_would(where):
    model, optimizer, batch, peaks = _phases(b=1 if where == "step" else 512)
    # each case: a budget the phases before it fit in and this phase crosses
    before = {"forward": peaks["start"], "backward": peaks["forward"],
              "step": max(peaks["forward"], peaks["backward"])}[where]
    assert peaks[where] > before  # the model is built so that this phase holds the peak
    budget = (before + peaks[where]) // 2
    phase, mem, message = _step_until_oom(model, optimizer, batch, budget)
    assert phase == where
    assert message.startswith("CUDA out of memory. Tried to allocate ") and "emulated by autoaccum" in message
    assert mem.oom_count == 1
    assert mem.last_oom_needed_bytes > budget >= mem.last_oom_needed_bytes - peaks[where]
    # what the failed phase allocated is gone again; only grads/state it already handed over remain
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()
    assert mem.current_bytes == peaks["start"]


def test_the_same_budget_with_room_to_spare_runs_the_whole_step():
    model, optimizer, batch, peaks = _phases(b=512)
    phase, mem, _ = _step_until_oom(model, optimizer, batch, max(peaks.values()))
    assert phase == "done" and mem.oom_count == 0
    assert mem.peak_bytes == max(peaks.values())


def test_emulated_budget_takes_strings_and_rejects_bad_budgets():
    with emulated_budget("1 KiB") as mem:
        torch.empty(256)  # exactly 1 KiB: fits
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 4 B. \[emulated by autoaccum: "
                                                         r"1 KiB in use of a budget of 1 KiB"):
            torch.empty(256), torch.empty(1)  # noqa: B018 -- the second crosses
    assert mem.budget_bytes == 1024
    with pytest.raises(ValueError, match="Invalid budget"):
        emulated_budget(0)
    with pytest.raises(ValueError, match="Invalid budget 'lots'"):
        TrackedMemory(budget_bytes="lots")


def test_existing_tensors_never_raise_even_over_budget():
    big = torch.ones(10 * N)
    with emulated_budget(100, big) as mem:
        assert mem.current_bytes == 40 * N
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(1)


# -- fake tensors: estimates without allocating ---------------------------------------------------

def test_the_counter_runs_under_fake_tensor_mode_without_allocating():
    with FakeTensorMode():
        with TrackedMemory() as mem:
            x = torch.empty(2**28)  # 1 GiB, but fake: no memory
            assert mem.current_bytes == 2**30
            y = x.view(2**14, 2**14).t()
            assert mem.current_bytes == 2**30
            del x, y
            assert mem.current_bytes == 0


def test_a_fake_training_step_estimates_the_real_peak():
    model = mlp()
    real = measure_phases(model, mlp_batch(), mlp_loss, 128)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = measure_phases(model, mlp_batch(), mlp_loss, 128)  # copies the model as fake tensors
    assert fake == pytest.approx(real, rel=1e-3)


# -- device capacity, NVML, CUDA ------------------------------------------------------------------

def test_cpu_capacity_comes_from_psutil():
    capacity = device_capacity(torch.device("cpu"))
    assert capacity.source == "psutil"
    assert 0 < capacity.available_bytes <= capacity.total_bytes
    assert capacity.other_process_bytes is None


def test_missing_nvml_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _nvml.cache_clear()
        nvml = _nvml()  # None without a driver; the module with one: never an exception or a warning
    assert nvml is None or hasattr(nvml, "nvmlDeviceGetCount")


def test_cuda_meter_needs_a_cuda_device():
    with pytest.raises(ValueError, match="CudaMeter needs a cuda device, got cpu"):
        CudaMeter("cpu")


def test_tracked_memory_satisfies_the_meter_protocol():
    mem = TrackedMemory()
    assert mem.kind == "tracked" and mem.alloc_retries() == 0
    assert (mem.current_bytes, mem.peak_bytes) == (0, 0)
    assert autoaccum.TrackedMemory is TrackedMemory


@pytest.mark.gpu
def test_cuda_meter_reads_the_allocator():
    device = torch.device("cuda")
    meter = CudaMeter(device)
    with meter:
        meter.reset_peak()
        base = meter.current_bytes
        x = torch.empty(2**20, device=device)  # 4 MiB
        assert meter.current_bytes - base >= 4 * 2**20
        del x
        assert meter.current_bytes == base
        assert meter.peak_bytes - base >= 4 * 2**20
        assert meter.peak_reserved_bytes >= meter.peak_bytes
        meter.reset_peak()
        assert meter.peak_bytes - base < 4 * 2**20
    assert meter.alloc_retries() >= 0
    capacity = cuda_capacity(device)
    assert 0 < capacity.available_bytes <= capacity.total_bytes
    assert capacity.source in ("cuda", "cuda+nvml")
    assert capacity.other_process_bytes is None or capacity.other_process_bytes >= 0


@pytest.mark.gpu
def test_tracked_counter_and_emulated_budget_on_cuda_tensors():
    with TrackedMemory(budget_bytes=8 * 2**20) as mem:
        x = torch.empty(2**20, device="cuda")
        assert mem.current_bytes == 4 * 2**20
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**20, device="cuda")
        del x


@pytest.mark.gpu
def test_probe_on_cuda_uses_the_cuda_meter():
    model = mlp().cuda()
    report = autoaccum.probe(model=model, loss_fn=mlp_loss, make_batch=lambda b: tuple(
        t.cuda() for t in mlp_batch()(b)), target_batch=64)
    assert report.meter == "cuda" and not report.is_estimate
    assert report.device.startswith("cuda") and report.budget_source in ("cuda", "cuda+nvml")
    assert report.max_fitting_micro_batch == 64


@pytest.mark.gpu
def test_cuda_estimate_is_near_the_measured_peaks():
    """A fake-tensor estimate of a CUDA model, with the libraries' bytes added, lands within 15% of
    the peaks real CUDA steps measure (without them it was short by cuBLAS's workspace)."""
    from autoaccum.probe.estimate import cuda_library_bytes

    model = mlp().cuda()
    batch = lambda b: tuple(t.cuda() for t in mlp_batch()(b))  # noqa: E731
    measured = autoaccum.probe(model=model, loss_fn=mlp_loss, make_batch=batch, target_batch=64, cache=False)
    estimated = autoaccum.probe(model=model, loss_fn=mlp_loss, make_batch=batch, target_batch=64, cache=False,
                                estimate=True)
    assert cuda_library_bytes(torch.device("cuda", torch.cuda.current_device())) >= 0
    real = {c.micro_batch: c.peak_bytes for c in measured.candidates if c.status == "ok"}
    guess = {c.micro_batch: c.peak_bytes for c in estimated.candidates if c.status == "ok"}
    shared = sorted(set(real) & set(guess))
    assert shared, (real, guess)
    for b in shared:
        assert abs(guess[b] - real[b]) <= 0.15 * real[b], (b, guess[b], real[b])


def test_other_libraries_take_the_emulated_oom_for_a_real_one():
    """Accelerate's find_executable_batch_size and Lightning's OOM check match message text, not types:
    an emulated OOM must read like a CUDA one for them to react (a laptop can then test their code)."""
    pytest.importorskip("accelerate")
    from accelerate.utils import find_executable_batch_size

    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        with emulated_budget(40 * 1000 * 4):  # room for 40 rows of 1000 floats
            torch.ones(batch_size, 1000).sum()
        return batch_size

    fitted = train()
    assert tried[0] == 64 and len(tried) > 1 and fitted == tried[-1] and fitted <= 40  # it shrank and retried
    lightning_memory = pytest.importorskip("lightning.pytorch.utilities.memory")
    with pytest.raises(torch.OutOfMemoryError) as info, emulated_budget(1000):
        torch.ones(1000)
    assert lightning_memory.is_oom_error(info.value)


def test_the_default_cuda_budget_respects_the_per_process_memory_fraction(monkeypatch):
    """A process capped with torch.cuda.set_per_process_memory_fraction was planned for the whole card.
    The allocator's numbers are stubbed: the rule is arithmetic, testable without a GPU."""
    import autoaccum.memory.capacity as capacity

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * gib)
    monkeypatch.setattr(capacity, "nvml_other_process_bytes", lambda device: 16 * gib)
    fractions = {"value": 1.0}
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fractions["value"],
                        raising=False)
    device = torch.device("cuda", 0)
    whole = capacity.cuda_capacity(device)
    assert whole.available_bytes == 64 * gib and whole.source == "cuda+nvml"  # free + our own cache
    fractions["value"] = 0.25
    capped = capacity.cuda_capacity(device)
    assert capped.available_bytes == 20 * gib and "per-process fraction 0.25" in capped.source
    fractions["value"] = 0.9  # a cap above what is free changes nothing
    assert capacity.cuda_capacity(device).available_bytes == 64 * gib


def test_estimate_offset_adds_library_bytes_to_every_peak():
    """An estimate for a CUDA model adds what cuBLAS/cuDNN keep (fake tensors never allocate it)."""
    from autoaccum.probe.estimate import with_offset
    from autoaccum.probe.report import Candidate

    base = Candidate(micro_batch=4, status="ok", peak_bytes=1000, fwd_bwd_peak_bytes=900, opt_peak_bytes=1000)
    failed = Candidate(micro_batch=8, status="oom", peak_bytes=None, fwd_bwd_peak_bytes=None, opt_peak_bytes=None)
    shifted, still_failed = with_offset((base, failed), 64)
    assert (shifted.peak_bytes, shifted.fwd_bwd_peak_bytes, shifted.opt_peak_bytes) == (1064, 964, 1064)
    assert shifted.micro_batch == 4 and still_failed == failed
