"""autoaccum.memory.recovery.is_oom: the one place that decides whether an exception is an out-of-memory."""

import pytest
import torch

from autoaccum import TrackedMemory, is_oom


@pytest.mark.parametrize("exc, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (torch.OutOfMemoryError("anything at all"), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes."), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),  # torch < 2.1
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"), False),
    (ValueError("CUDA out of memory"), False),  # not a RuntimeError: something else went wrong
    (MemoryError(), False),  # a Python host allocation, not a device one
    (KeyboardInterrupt(), False),
])
def test_is_oom(exc, expected):
    assert is_oom(exc) is expected


def test_a_runtime_error_subclass_with_an_oom_message_is_not_oom():
    class CompileError(RuntimeError):
        pass

    assert not is_oom(CompileError("DefaultCPUAllocator: can't allocate memory"))


def test_the_emulated_budget_raises_what_is_oom_recognises():
    with pytest.raises(torch.OutOfMemoryError) as info:
        with TrackedMemory(budget_bytes=1000):
            torch.empty(1000)
    assert is_oom(info.value)
