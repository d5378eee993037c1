"""Public quantizers: validate, run the ``nvfp4::`` op, wrap the result."""

from __future__ import annotations

from typing import Optional

import torch

from . import ops  # noqa: F401  (registers torch.ops.nvfp4)
from .constants import RHT_DEFAULT_SIGN_MASK
from .distributed import check_quantize_operand
from .recipe import QuantizeOptions
from .tensor import NVFP4GroupedTensor, NVFP4Tensor
from .validate import check_amax_arg, check_group_sizes_meta, check_quantize_args, check_same_device


def _present(tensors, rowwise: bool, columnwise: bool) -> list:
    keep = [rowwise] * 3 + [columnwise] * 3
    return [t if k else None for t, k in zip(tensors, keep)]


def quantize(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    rht: bool = False,
    sign_mask: int = RHT_DEFAULT_SIGN_MASK,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    rowwise_amax: Optional[torch.Tensor] = None,
    columnwise_amax: Optional[torch.Tensor] = None,
    sr_per_rank: bool = True,
) -> NVFP4Tensor:
    """Quantize an (M, K) tensor to NVFP4 (numerics.md 1-4).

    rowwise / columnwise: which copies to make (column-wise = the quantization of x^T,
    for wgrad). rht: random Hadamard transform of the column-wise copy only (bf16 x).
    block_2d: 16x16 tiles (weights). stochastic_rounding: Philox-driven SR, seeded from
    the generator of x's device. rowwise_amax / columnwise_amax: fp32 scalars to use instead of
    computing the amaxes (the column-wise one is post-RHT when `rht`). sr_per_rank: fold
    the torch.distributed rank into the stochastic-rounding seed (``Recipe.sr_per_rank``).
    sign_mask: the RHT's 16 signs (``Recipe.sign_mask``).
    """
    check_quantize_args(x, QuantizeOptions(rowwise, columnwise, rht, sign_mask), block_2d=block_2d, grouped=False)
    check_amax_arg("rowwise_amax", rowwise_amax, 1)
    check_amax_arg("columnwise_amax", columnwise_amax, 1)
    check_same_device(x, rowwise_amax=rowwise_amax, columnwise_amax=columnwise_amax)
    check_quantize_operand(x, stochastic_rounding=stochastic_rounding, sr_per_rank=sr_per_rank)
    out = torch.ops.nvfp4.quantize(
        x, rowwise, columnwise, rht, sign_mask, block_2d, stochastic_rounding, rowwise_amax, columnwise_amax,
        None, sr_per_rank,
    )
    return NVFP4Tensor(*_present(out, rowwise, columnwise))


def group_quantize(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    rht: bool = False,
    sign_mask: int = RHT_DEFAULT_SIGN_MASK,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    rowwise_amax: Optional[torch.Tensor] = None,
    columnwise_amax: Optional[torch.Tensor] = None,
    sr_per_rank: bool = True,
) -> NVFP4GroupedTensor:
    """Quantize a (T, K) tensor whose rows are G groups of sizes `group_sizes` (an int
    tensor on x's device), each group with its own amaxes (numerics.md 4). Options as
    ``quantize``; amaxes, if supplied, are fp32 (G,). Group sizes may be anything >= 0
    summing to T (rows past a group's end count as zeros in its column-wise copy)."""
    check_quantize_args(x, QuantizeOptions(rowwise, columnwise, rht, sign_mask), block_2d=block_2d, grouped=True)
    check_group_sizes_meta(group_sizes)
    check_amax_arg("rowwise_amax", rowwise_amax, group_sizes.shape[0])
    check_amax_arg("columnwise_amax", columnwise_amax, group_sizes.shape[0])
    check_same_device(x, group_sizes=group_sizes, rowwise_amax=rowwise_amax, columnwise_amax=columnwise_amax)
    check_quantize_operand(x, stochastic_rounding=stochastic_rounding, sr_per_rank=sr_per_rank)
    out = torch.ops.nvfp4.group_quantize(
        x, group_sizes, rowwise, columnwise, rht, sign_mask, stochastic_rounding, rowwise_amax, columnwise_amax,
        None, sr_per_rank,
    )
    return NVFP4GroupedTensor(*_present(out[:6], rowwise, columnwise), out[6], group_sizes.to(torch.int64))
