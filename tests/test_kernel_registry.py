"""How kernel ops launch (kernels/_registry.py): untraced calls run the body with
``wrap_triton`` switched off (so it hands back the plain kernel); calls under torch.compile
go through the registered op, with ``wrap_triton`` on (so torch can trace the launch).

The CUDA branch is exercised on CPU by pretending the process is not interpreting and
recording, for each launch, whether ``wrap_triton`` was on."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nvfp4_inductor.kernels import _registry  # noqa: E402


class _Kernel:
    """Stands in for a @triton.jit kernel: records launches."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda **kwargs: self.launches.append(("plain", grid))


@pytest.fixture
def cuda_mode(monkeypatch):
    """_registry as on CUDA (not interpreting); the kernels launched while wrap_triton is
    on (those that would go through its higher-order op) recorded instead of traced."""
    from torch._library.triton import is_wrap_triton_enabled

    wrapped = []

    def wrap_triton(kernel):
        if is_wrap_triton_enabled():
            wrapped.append(kernel)
        return kernel

    monkeypatch.setattr(_registry, "INTERPRET", False)
    monkeypatch.setattr(torch.library, "wrap_triton", wrap_triton)
    return wrapped


def _kernel_op(kernel):
    calls = []

    def body(x):
        calls.append("body")
        _registry.launch(kernel, (1,), x_ptr=x)
        return x

    op = _registry.KernelOp(lambda x: calls.append("op") or body(x), body)
    return op, calls


def test_direct_call_runs_the_body_with_a_plain_launch(cuda_mode):
    kernel = _Kernel()
    op, calls = _kernel_op(kernel)
    op(torch.zeros(2))
    assert calls == ["body"] and kernel.launches == [("plain", (1,))]
    assert cuda_mode == [], "a direct call must not go through wrap_triton's higher-order op"


def test_compiling_call_goes_through_the_op_and_wrap_triton(cuda_mode, monkeypatch):
    kernel = _Kernel()
    op, calls = _kernel_op(kernel)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    op(torch.zeros(2))
    assert calls == ["op", "body"] and cuda_mode == [kernel]


def test_direct_flag_is_restored_after_the_call(cuda_mode):
    kernel = _Kernel()
    op, _ = _kernel_op(kernel)
    op(torch.zeros(2))
    _registry.launch(kernel, (1,), x_ptr=torch.zeros(2))  # as from an op body the dispatcher runs
    assert cuda_mode == [kernel]


def test_fake_tensors_and_empty_grids_launch_nothing(cuda_mode):
    from torch._subclasses.fake_tensor import FakeTensorMode

    kernel = _Kernel()
    _registry.launch(kernel, (0,), x_ptr=torch.zeros(2))
    with FakeTensorMode():
        _registry.launch(kernel, (1,), x_ptr=torch.zeros(2))
    assert kernel.launches == [] and cuda_mode == []


def test_host_grid_helpers():
    assert [_registry.cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert [_registry.next_power_of_2(n) for n in (0, 1, 2, 3, 8, 9)] == [1, 1, 2, 4, 8, 16]
