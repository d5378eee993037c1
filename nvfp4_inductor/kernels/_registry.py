"""How kernel ops are registered and launched: decided once, when this module is imported.

Two modes (torch_compile_backend_guide.md section 6.3):

* CUDA (the default): each op is a ``torch.library.triton_op`` and launches through
  ``wrap_triton``, so under ``torch.compile`` Inductor sees the kernel launches and plans
  their buffers itself.
* Triton interpreter (``TRITON_INTERPRET=1`` when Triton was imported, read from
  ``triton.knobs``): each op is an opaque ``torch.library.custom_op`` whose body runs the
  interpreted kernel on CPU tensors (``triton_op`` cannot be traced under the interpreter,
  and on torch 2.11 ``wrap_triton`` raises for interpreted kernels).

In both modes the op body is also its fake impl: ``launch`` does nothing on FakeTensors,
so the body only allocates outputs there.
"""

from __future__ import annotations

import os

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # triton without knobs


INTERPRET = _interpreting()


def launch(kernel, grid, **kwargs) -> None:
    """Launch `kernel` on `grid` with keyword arguments; no-op on FakeTensors or empty grids."""
    if any(isinstance(v, FakeTensor) for v in kwargs.values()):
        return
    if any(g == 0 for g in grid):
        return
    (kernel if INTERPRET else torch.library.wrap_triton(kernel))[grid](**kwargs)


def kernel_op(name: str):
    """Register `fn` as the op ``name`` ("nvfp4_kernels::...") in the mode of this process."""

    def register(fn):
        if INTERPRET:
            op = torch.library.custom_op(name, fn, mutates_args=())
            op.register_fake(fn)  # same body: launch() skips FakeTensors
            return op
        return torch.library.triton_op(name, fn, mutates_args=())

    return register
