"""The reference target's steps: pure PyTorch from ``numerics.py`` and ``activations.py``.

It is the eager path on CPU and the definition every other target is tested against.
GEMMs are fp32 matmuls of exact deq() values (``torch._grouped_mm``), alpha applied to
the fp32 result, then rounded to bf16.
"""

from .. import numerics
from ..activations import activation_backward, activation_forward
from .steps import Steps

STEPS = Steps(
    quantize=numerics.quantize_torch,
    group_quantize=numerics.group_quantize_torch,
    group_hadamard_amax=numerics.group_hadamard_amax_torch,
    quantize_weights=numerics.quantize_weights_torch,
    grouped_gemm=numerics.grouped_gemm_torch,
    grouped_gemm_wgrad=numerics.grouped_gemm_wgrad_torch,
    activation_forward=activation_forward,
    activation_backward=activation_backward,
)
