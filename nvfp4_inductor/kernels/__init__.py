"""Triton kernels for NVFP4 quantization (numerics.md 1-4), bit-exact twins of numerics.py.

    quantize, group_quantize, quantize_weights, group_hadamard_amax,
    activation_group_quantize                                          (see api.py)
    available(device) -> bool
    set_launch_allocator(): Triton's allocator for the calling thread (TMA descriptors)
    TRACEABLE: whether torch.compile can trace the launches (``wrap_triton``): not for
        interpreted kernels, which run on the host

Ops registered (torch.library, namespace ``nvfp4_kernels``): ``group_amax``, ``group_cast``
(``_registry.py`` says how: ``triton_op`` on CUDA, an opaque ``custom_op`` running the
interpreted kernel under TRITON_INTERPRET=1). Importing this package without Triton
works; the functions then raise NotImplementedError and ``available`` is False.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError:  # CPU-only installs without Triton
    triton = None

if triton is None:
    _MISSING = "nvfp4_inductor.kernels needs Triton (pip install triton; on CPU also set TRITON_INTERPRET=1)"

    def available(device) -> bool:
        return False

    def _missing(*args, **kwargs):
        raise NotImplementedError(_MISSING)

    quantize = group_quantize = quantize_weights = group_hadamard_amax = activation_group_quantize = _missing
    TRACEABLE = False

    def set_launch_allocator() -> None:  # no kernel to launch
        pass
else:
    from ._registry import INTERPRET
    from .api import (activation_group_quantize, available, group_hadamard_amax, group_quantize, quantize,
                      quantize_weights)
    from .grouped_gemm_bf16 import set_launch_allocator

    TRACEABLE = not INTERPRET

__all__ = ["TRACEABLE", "activation_group_quantize", "available", "group_hadamard_amax", "group_quantize", "quantize",
           "quantize_weights", "set_launch_allocator"]
