"""Grouped amax in one pass: per group, max |x| (pre-RHT, for the row-wise copy) and
max |RHT(x^T)| (post-RHT, for the column-wise copy), with the quantizer's sign mask.

Kernel ``_group_amax_kernel``; launcher ``group_amax``; op ``nvfp4_kernels::group_amax``.
The reference is ``numerics.group_hadamard_amax_torch``.

Same tiling as ``group_cast`` (padded token axis, R = BM/16 runs of 16 tokens held as 16
(R, BK) tiles; see that module's docstring), but each program loops over K (K / k_split
columns), keeps running elementwise maxima, and ends with one ``atomic_max`` per run
into its group's amax. The post-RHT maxima are taken over the unrounded FWHT outputs and
finished once per run (``_nvfp4.rht_round``: x0.25 and the bf16 rounding are monotone and
odd, so they commute with max |.|), which saves ~5 instructions per element. Group sizes
stay on the device; empty groups keep amax 0 (the outputs start at zero; a max is
order-free, so the atomics give the reference's bits).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..sizes import is_zero
from ._nvfp4 import columns, fold_run_amax, group_of_runs, rht_round, stacked_runs
from ._registry import cdiv, kernel_op, launch, next_power_of_2, stacked_groups
from .config import amax_config


@triton.jit
def _group_amax_kernel(
    x_ptr, sizes_ptr, pre_ptr, post_ptr,
    K, G, rows_total,
    PRE: tl.constexpr, POST: tl.constexpr, SIGN_MASK: tl.constexpr, STACKED: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_G: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, K_SPLIT: tl.constexpr,
):
    R: tl.constexpr = BM // 16
    r0 = tl.program_id(0).to(tl.int64) * BM
    if STACKED:  # G groups of rows_total / G rows: no sizes to load, no search
        g, in_group, rs, poff, size, start = stacked_runs(r0, rows_total, G, R)
    else:  # loaded here, not in a helper (_nvfp4.load_token)
        gi = tl.arange(0, BLOCK_G)
        sizes = tl.load(sizes_ptr + gi, mask=gi < G, other=0)
        g, in_group, rs, poff, size, start, _ = group_of_runs(sizes, r0, rows_total, G, R, BLOCK_G)
    local0 = rs - poff
    acc_pre = tl.zeros((R, BK), dtype=tl.float32)
    acc_post = tl.zeros((R, BK), dtype=tl.float32)
    for k0 in range(tl.program_id(1) * BK, K, K_SPLIT * BK):
        ks, k_ok = columns(k0, K, BK, EVEN_K)
        acc_pre, acc_post = fold_run_amax(x_ptr, start, local0, size, in_group, K, ks, k_ok, SIGN_MASK,
                                          acc_pre, acc_post, PRE, POST)
    if PRE:
        tl.atomic_max(pre_ptr + g, tl.max(acc_pre, axis=1), mask=in_group)
    if POST:
        tl.atomic_max(post_ptr + g, rht_round(tl.max(acc_post, axis=1)), mask=in_group)


def _output(x: torch.Tensor, groups: int, wanted: bool) -> torch.Tensor:
    """An amax output: zeros (the atomic maxima start there), or empty when not asked for."""
    return x.new_zeros(groups, dtype=torch.float32) if wanted else x.new_empty(0, dtype=torch.float32)


@kernel_op("nvfp4_kernels::group_amax")
def group_amax(
    x: torch.Tensor, group_sizes: Optional[torch.Tensor], pre: bool, post: bool, sign_mask: int, capacity: int,
    stacked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (pre-RHT amax, post-RHT amax), fp32 (G,) each, of x (T, K).

    capacity: the padded token count the groups fit in (numerics.columnwise_capacity(T, G),
    or T when every group size is a multiple of 16). stacked: x is G = T / capacity groups
    of `capacity` rows each (an expert weight stack, ``quantize_weights``) and group_sizes
    is None. An amax not asked for is an empty (0,) tensor: no zero fill (a launch on
    CUDA) for what nobody reads.
    """
    x = x.contiguous()
    tokens, k = x.shape
    groups = stacked_groups(tokens, capacity) if stacked else group_sizes.shape[0]
    pre_amax, post_amax = _output(x, groups, pre), _output(x, groups, post)
    if groups == 0 or k == 0 or is_zero(tokens) or not (pre or post):
        return pre_amax, post_amax
    rows_total = tokens if stacked else capacity  # the rows the grid covers
    cfg = amax_config(rows_total, k)
    k_split = min(cfg.k_split, cdiv(k, cfg.block_k))
    launch(
        _group_amax_kernel, (cdiv(rows_total, cfg.block_m), k_split),
        x_ptr=x, sizes_ptr=None if stacked else group_sizes.contiguous(),
        pre_ptr=pre_amax if pre else None, post_ptr=post_amax if post else None, K=k, G=groups, rows_total=rows_total,
        PRE=pre, POST=post, SIGN_MASK=sign_mask, STACKED=stacked, BLOCK_G=max(next_power_of_2(groups), 2),
        EVEN_K=k % cfg.block_k == 0, BM=cfg.block_m, BK=cfg.block_k, K_SPLIT=k_split, num_warps=cfg.num_warps,
    )
    return pre_amax, post_amax
