"""The reference target's steps: pure PyTorch from ``numerics.py`` and ``activations.py``.

It is the eager path on CPU and the definition every other target is tested against.
GEMMs are fp32 matmuls of exact deq() values (``torch._grouped_mm``), alpha applied to
the fp32 result, then rounded to bf16.
"""

import torch

from .. import numerics
from ..activations import activation_backward, activation_forward
from ..formats import operand_values
from .steps import Steps


def _as_deq(q, copy: str):
    """`q` with its `copy` ("rowwise" / "columnwise") replaced by its deq() values (bf16) and
    an empty scale."""
    data, scale = getattr(q, f"{copy}_data"), getattr(q, f"{copy}_scale")
    setattr(q, f"{copy}_data", operand_values(data, scale).to(torch.bfloat16))
    setattr(q, f"{copy}_scale", scale.new_empty(0))
    return q


def group_quantize(x, group_sizes, *, rowwise_deq=False, columnwise_deq=False, **options):
    q = numerics.group_quantize_torch(x, group_sizes, **options)
    if rowwise_deq and q.rowwise_data is not None:
        q = _as_deq(q, "rowwise")
    return _as_deq(q, "columnwise") if columnwise_deq and q.columnwise_data is not None else q


def quantize_weights(w, *, block_2d=True, rowwise_deq=False):
    q = numerics.quantize_weights_torch(w, block_2d=block_2d)
    return _as_deq(q, "rowwise") if rowwise_deq else q


STEPS = Steps(
    quantize=numerics.quantize_torch,
    group_quantize=group_quantize,
    group_hadamard_amax=numerics.group_hadamard_amax_torch,
    quantize_weights=quantize_weights,
    grouped_gemm=numerics.grouped_gemm_torch,
    grouped_gemm_wgrad=numerics.grouped_gemm_wgrad_torch,
    activation_forward=activation_forward,
    activation_backward=activation_backward,
    deq_operands=True,
)
