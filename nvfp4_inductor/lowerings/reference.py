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


def _row_as_deq(q):
    """`q` with its row-wise copy replaced by its deq() values (bf16) and an empty scale."""
    q.rowwise_data = operand_values(q.rowwise_data, q.rowwise_scale).to(torch.bfloat16)
    q.rowwise_scale = q.rowwise_scale.new_empty(0)
    return q


def group_quantize(x, group_sizes, cast):
    keywords = cast.keywords()
    rowwise_deq = keywords.pop("rowwise_deq")
    q = numerics.group_quantize_torch(x, group_sizes, **keywords)
    return _row_as_deq(q) if rowwise_deq and q.rowwise_data is not None else q


def group_hadamard_amax(x, group_sizes, cast):
    return numerics.group_hadamard_amax_torch(x, group_sizes, cast.sign_mask)


def quantize_weights(w, *, block_2d=True, rowwise_deq=False):
    q = numerics.quantize_weights_torch(w, block_2d=block_2d)
    return _row_as_deq(q) if rowwise_deq else q


STEPS = Steps(
    quantize=numerics.quantize_torch,
    group_quantize=group_quantize,
    group_hadamard_amax=group_hadamard_amax,
    quantize_weights=quantize_weights,
    grouped_gemm=numerics.grouped_gemm_torch,
    grouped_gemm_wgrad=numerics.grouped_gemm_wgrad_torch,
    activation_forward=activation_forward,
    activation_backward=activation_backward,
    deq_operands=True,
    d_after_dgrad=True,  # D rebuilt after the dgrad, whose bf16 operand copies are gone by then
)
