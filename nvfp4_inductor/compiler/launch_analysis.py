"""torch's analysis of a traced kernel launch, done once per distinct launch instead of per call.

Where launches are traced (``target_ops.py``), torch finds the tensors each launch writes by
generating the kernel's Triton IR and walking it. It does this afresh for every launch,
several times per launch: AOTAutograd's two passes over the forward and the joint graph,
then Inductor's lowering and its graph checks. Generating the IR is most of a fused
layer's compile time (about 0.1 s per call on a CPU core; a layer's 25 launches, each
analysed about four times), and it repeats for every layer although layers of one shape
launch the same kernels with the same arguments.

The analysis depends only on the Triton IR torch generates (``generate_ttir``): the kernel,
its constexprs' and None arguments' values (constants of the IR), its tensors' dtypes (torch
replaces each by an empty one of that dtype), and of each integer what Triton's
specialisation sees: its type (i32, i64 or u64 by its range), equality to 1 and
divisibility by 16 (symbolic sizes are a placeholder 2). An integer's value is not in the
IR, so launches that differ only in sizes share an answer (one layer's step: 17 analyses
instead of 29). While a ``launches_analysed_once`` block runs, a launch seen before is
answered from a table keyed on exactly that (one table per process, kept between blocks:
a later compile of the same layers analyses nothing). torch has no hook for this, so the
block swaps torch's function (``identify_accessed_tensors``; ``identify_mutated_tensors``
before torch 2.13) in its module and puts it back after; callers look it up there at call
time. A launch the key cannot describe (real tensors, TMA descriptors, unhashable values)
is analysed as before. ``counters["nvfp4"]`` (torch._dynamo.utils) counts the analyses run
("launch_analyses") and those answered from the table ("launch_analyses_reused").
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator, Optional

import sympy
import torch
from torch._dynamo.utils import counters
from torch._higher_order_ops import triton_kernel_wrap
from torch._subclasses.fake_tensor import FakeTensor

# torch's name for the analysis, newest first; both take (kernel, kwargs, tma_descriptor_metadata)
_ANALYSIS_NAMES = ("identify_accessed_tensors", "identify_mutated_tensors")
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)

_analysed: dict[tuple, Any] = {}  # launch key -> torch's answer
_depth = 0


def _tensor_dtype(value) -> Optional[torch.dtype]:
    """The dtype of a traced tensor argument (a fake tensor, or Inductor's IR node), else None."""
    if isinstance(value, FakeTensor):
        return value.dtype
    from torch._inductor.ir import TensorBox

    return value.get_dtype() if isinstance(value, TensorBox) else None


def launch_key(kernel, kwargs: dict[str, Any], tma_descriptor_metadata) -> Optional[tuple]:
    """What torch's analysis of this launch depends on, or None where that is not known."""
    if tma_descriptor_metadata:
        return None
    from triton.runtime.autotuner import Autotuner  # (Triton is there: a launch is analysed)

    if isinstance(kernel, Autotuner):
        # torch wraps every launch that passes launch options (num_warps, ...) in a fresh
        # one-config Autotuner, and analyses its function with the first config's arguments
        kwargs = {**kwargs, **kernel.configs[0].kwargs} if kernel.configs else kwargs
        kernel = kernel.fn
    params = getattr(kernel, "params", None)  # (an interpreted kernel has none: its integers keep their values)
    constexprs = {p.name for p in params if p.is_constexpr} if params is not None else None
    parts = []
    for name, value in sorted(kwargs.items()):
        dtype = _tensor_dtype(value)
        if dtype is not None:
            parts.append((name, "tensor", dtype))
        elif isinstance(value, torch.Tensor):
            return None  # a real tensor is passed through to Triton as it is
        elif isinstance(value, _SYMBOLIC):
            parts.append((name, "symbolic"))
        elif type(value) is int and constexprs is not None and name not in constexprs:
            parts.append((name, int, int_specialisation(value)))
        else:
            try:
                hash(value)
            except TypeError:
                return None
            parts.append((name, type(value), value))
    return (kernel, tuple(parts))


def int_specialisation(value: int) -> tuple:
    """What Triton's IR holds of an integer argument (what its binder specialises on): its
    type, and whether it is 1 (then a constant) or divisible by 16 (an attribute)."""
    width = "i32" if -2**31 <= value < 2**31 else "i64" if -2**63 <= value < 2**63 else "u64"
    return width, value == 1, value % 16 == 0


def _memoized(analyse: Callable) -> Callable:
    def analyse_once(kernel, kwargs, tma_descriptor_metadata):
        key = launch_key(kernel, kwargs, tma_descriptor_metadata)
        if key is not None and key in _analysed:
            counters["nvfp4"]["launch_analyses_reused"] += 1
            return copy.deepcopy(_analysed[key])  # callers own their answer, as from torch
        counters["nvfp4"]["launch_analyses"] += 1
        answer = analyse(kernel, kwargs, tma_descriptor_metadata)
        if key is not None:
            _analysed[key] = copy.deepcopy(answer)
        return answer

    analyse_once.__wrapped__ = analyse
    return analyse_once


def forget() -> None:
    """Empty the table (tests that count analyses as a fresh process would)."""
    _analysed.clear()


@contextlib.contextmanager
def launches_analysed_once() -> Iterator[None]:
    """Inside the block (re-entrant), torch's launch analysis answers repeated launches from
    the table; outside it, torch's own function runs."""
    global _depth
    names = [n for n in _ANALYSIS_NAMES if hasattr(triton_kernel_wrap, n)]
    if _depth == 0:
        for name in names:
            setattr(triton_kernel_wrap, name, _memoized(getattr(triton_kernel_wrap, name)))
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            for name in names:
                setattr(triton_kernel_wrap, name, getattr(triton_kernel_wrap, name).__wrapped__)
