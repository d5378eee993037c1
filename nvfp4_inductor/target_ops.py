"""Ops that a compiled graph holds as their steps, where their target allows it.

The backend's fused ops (and the GEMM ops its backward calls) are ``torch.library``
custom ops: at run time one Python body per op launches its target's kernels. Traced by
AOTAutograd, an op made with ``target_op`` instead becomes that body -- its kernel
launches (``wrap_triton``) and its integer and copy torch ops -- when the target it runs
says so (``Target.inline``). Inductor then launches the kernels from its own generated
code: no Python launcher and no custom-op layers per kernel on every step, buffers
planned with the rest of the graph, the kernels compiled in parallel with Inductor's
own, and the launches readable in the output code. This is how ``torch.library.triton_op``
works, decided per call from the op's ``target`` argument, because one op serves every
target: the reference's steps are torch arithmetic that Inductor would re-generate (other
bits), and cuDNN's call a library that cannot be traced, so those stay one opaque call.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from .lowerings import choose_target, get_target

_PLAIN_TENSOR_TYPES = (torch.Tensor, FunctionalTensor)
_ENABLED = True


@contextlib.contextmanager
def launches_traced(enabled: bool) -> Iterator[None]:
    """Inside the block, ops are inlined where their target allows (``enabled``) or kept
    whole everywhere: the backend's ``trace_launches`` option, around its compile."""
    global _ENABLED
    before, _ENABLED = _ENABLED, enabled
    try:
        yield
    finally:
        _ENABLED = before


def inlines(target: Optional[str], device) -> bool:
    """Whether an op running `target` (None: the device's default target) on `device` is
    traced as its steps."""
    chosen = get_target(target) if target is not None else choose_target(device)
    return _ENABLED and chosen.inline()


class _BodiesRun(TorchDispatchMode):
    """``bodies_run``'s mode: ops made with ``target_op`` run their bodies where their target
    inlines (as when AOTAutograd traces them); every other op runs as it would."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def bodies_run() -> Iterator[None]:
    """Inside the block, an op made with ``target_op`` whose target inlines runs its body,
    as when traced, without tracing: on fake tensors, the body's kernel launches are named
    (and skipped) without torch's functionalization and launch analysis
    (compiler/early_compile.py)."""
    with _BodiesRun():
        yield


def target_op(name: str):
    """``torch.library.custom_op(name, fn, mutates_args=())`` for a body whose ``target``
    argument names the target it runs, inlined when traced where that target allows."""

    def register(fn):
        op = torch.library.custom_op(name, fn, mutates_args=())
        signature = inspect.signature(fn)

        def functional_rule(mode, func, types, args, kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            device = next(v.device for v in bound.arguments.values() if isinstance(v, torch.Tensor))
            # (as triton_op: tensor subclasses other than the tracing wrappers keep the op)
            plain = all(issubclass(t, FakeTensor) or t in _PLAIN_TENSOR_TYPES for t in types)
            if plain and inlines(bound.arguments["target"], device):
                with mode:
                    return fn(*args, **kwargs)
            return mode.__torch_dispatch__(func, types, args, kwargs)

        op.register_torch_dispatch(FunctionalTensorMode, functional_rule)
        op.register_torch_dispatch(_BodiesRun, functional_rule)
        return op

    return register
