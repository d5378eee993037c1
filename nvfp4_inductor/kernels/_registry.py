"""How kernel ops are registered and launched: decided once, when this module is imported.

Two modes:

* CUDA (the default): each op is a ``torch.library.triton_op`` and launches through
  ``wrap_triton``, so under ``torch.compile`` Inductor sees the kernel launches and plans
  their buffers itself.
* Triton interpreter (``TRITON_INTERPRET=1`` when Triton was imported, read from
  ``triton.knobs``): each op is an opaque ``torch.library.custom_op`` whose body runs the
  interpreted kernel on CPU tensors (``triton_op`` cannot be traced under the interpreter,
  and on torch 2.11 ``wrap_triton`` raises for interpreted kernels).

In both modes the op body is also its fake impl: ``launch`` does nothing on FakeTensors,
so the body only allocates outputs there.

Outside tracing (Dynamo's, or AOTAutograd's when it inlines a fused op's body), a call
skips the dispatcher and runs the same body directly
(``KernelOp``): these ops are mostly called from inside other ops' implementations
(compiler/fused.py, the lowerings), where nothing traces them and each trip through the
custom-op layers costs ~35 us of host time (measured on the CI CPU; a training step
makes ~30 such calls), which shapes with little GPU work per step cannot hide.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Optional

import torch
import triton
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch._subclasses.fake_tensor import FakeTensor

from ..sizes import is_zero


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # triton without knobs


INTERPRET = _interpreting()
_recorded: Optional[list] = None  # where ``recording_launches`` collects launches on FakeTensors


def launch(kernel, grid, **kwargs) -> None:
    """Launch `kernel` on `grid` with keyword arguments; no-op on FakeTensors or empty grids.

    A pointer the launch does not use (its constexpr flags keep the kernel from touching
    it) is passed as None, not as some other tensor: Triton makes a None argument a
    constant of the compiled kernel, so the launcher passes no tensor for it, and
    Inductor's generated call for a traced launch shows -1 there (its mark for such a
    constant) instead of a tensor that reads as an operand."""
    if any(isinstance(v, FakeTensor) for v in kwargs.values()):
        if _recorded is not None:
            _recorded.append((kernel, tuple(grid), kwargs))
        return
    if any(is_zero(g) for g in grid):  # (a data-dependent grid is launched: Triton skips it when empty)
        return
    (kernel if INTERPRET else torch.library.wrap_triton(kernel))[grid](**kwargs)


@contextlib.contextmanager
def recording_launches() -> Iterator[list]:
    """Inside the block, each launch on FakeTensors (which ``launch`` skips) is appended to
    the list yielded, as (kernel, grid, keyword arguments): the kernels a body would run on
    those shapes, known without tracing it (compiler/early_compile.py)."""
    global _recorded
    before, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = before


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b) for grids. (``triton.cdiv`` is a ConstexprFunction in recent
    Triton: ~5 us a call from host code, and a launch makes several.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side smallest power of 2 >= n (1 for n <= 1), for constexpr block sizes."""
    return 1 << max(n - 1, 0).bit_length()


def stacked_groups(rows: int, rows_per_group: int) -> int:
    """G of a stack of G groups of `rows_per_group` rows each (an expert weight stack)."""
    if rows_per_group <= 0 or rows % rows_per_group:
        raise ValueError(f"a stack of {rows} rows is not groups of {rows_per_group} rows")
    return rows // rows_per_group


def _functionalizing() -> bool:
    """Whether AOTAutograd is tracing (its FunctionalTensorMode is on): a body that calls
    this op is being inlined into a compiled graph (``target_ops.py``), so the launch
    must reach the graph through the op."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None


class KernelOp:
    """A registered kernel op: the op while torch.compile traces (so the graph holds it,
    or on CUDA Inductor sees its launches), its body called directly otherwise."""

    def __init__(self, op, body):
        self.op, self.body = op, body
        functools.update_wrapper(self, body)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or _functionalizing():
            return self.op(*args, **kwargs)
        # as triton_op's own eager path does: with wrap_triton off, ``launch`` gets the plain
        # kernel back (an untraced wrap_triton call would dispatch a higher-order op per
        # launch, costing far more host time than the launch)
        if not is_wrap_triton_enabled():  # already off: a call from inside another body
            return self.body(*args, **kwargs)
        with set_wrap_triton_enabled(False):
            return self.body(*args, **kwargs)


def kernel_op(name: str):
    """Register `fn` as the op ``name`` ("nvfp4_kernels::...") in the mode of this process."""

    def register(fn):
        if INTERPRET:
            op = torch.library.custom_op(name, fn, mutates_args=())
            op.register_fake(fn)  # same body: launch() skips FakeTensors
        else:
            op = torch.library.triton_op(name, fn, mutates_args=())
        return KernelOp(op, fn)

    return register
