"""Grouped amax in one pass: per group, max |x| (pre-RHT, for the row-wise copy) and
max |RHT(x^T)| (post-RHT, for the column-wise copy), with the quantizer's sign mask.

Kernel ``_group_amax_kernel``; launcher ``group_amax``; op ``nvfp4_kernels::group_amax``.
The reference is ``numerics.group_hadamard_amax_torch``.

Same tiling as ``group_cast`` (padded token axis, R = BM/16 runs of 16 tokens held as 16
(R, BK) tiles; see that module's docstring), but each program loops over K (K / k_split
columns), keeps running elementwise maxima, and ends with one ``atomic_max`` per run
into its group's amax. Group sizes stay on the device; empty groups keep amax 0 (the
outputs start at zero; a max is order-free, so the atomics give the reference's bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._nvfp4 import group_of_runs, load_token, rht16
from ._registry import kernel_op, launch
from .config import amax_config


@triton.jit
def _group_amax_kernel(
    x_ptr, sizes_ptr, pre_ptr, post_ptr,
    K, G, rows_total,
    PRE: tl.constexpr, POST: tl.constexpr, SIGN_MASK: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_G: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, K_SPLIT: tl.constexpr,
):
    R: tl.constexpr = BM // 16
    r0 = tl.program_id(0).to(tl.int64) * BM
    g, in_group, rs, poff, size, start, pad_end = group_of_runs(sizes_ptr, r0, rows_total, G, R, BLOCK_G)
    local0 = rs - poff
    acc_pre = tl.zeros((R, BK), dtype=tl.float32)
    acc_post = tl.zeros((R, BK), dtype=tl.float32)
    for k0 in range(tl.program_id(1) * BK, K, K_SPLIT * BK):
        ks = k0 + tl.arange(0, BK)
        if EVEN_K:
            k_ok = tl.full((BK,), 1, tl.int1)
        else:
            k_ok = ks < K
        x0, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 0, K, ks, k_ok)
        x1, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 1, K, ks, k_ok)
        x2, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 2, K, ks, k_ok)
        x3, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 3, K, ks, k_ok)
        x4, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 4, K, ks, k_ok)
        x5, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 5, K, ks, k_ok)
        x6, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 6, K, ks, k_ok)
        x7, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 7, K, ks, k_ok)
        x8, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 8, K, ks, k_ok)
        x9, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 9, K, ks, k_ok)
        x10, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 10, K, ks, k_ok)
        x11, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 11, K, ks, k_ok)
        x12, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 12, K, ks, k_ok)
        x13, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 13, K, ks, k_ok)
        x14, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 14, K, ks, k_ok)
        x15, _src, _ok = load_token(x_ptr, start, local0, size, in_group, 15, K, ks, k_ok)
        if PRE:
            acc_pre = tl.maximum(acc_pre, tl.abs(x0))
            acc_pre = tl.maximum(acc_pre, tl.abs(x1))
            acc_pre = tl.maximum(acc_pre, tl.abs(x2))
            acc_pre = tl.maximum(acc_pre, tl.abs(x3))
            acc_pre = tl.maximum(acc_pre, tl.abs(x4))
            acc_pre = tl.maximum(acc_pre, tl.abs(x5))
            acc_pre = tl.maximum(acc_pre, tl.abs(x6))
            acc_pre = tl.maximum(acc_pre, tl.abs(x7))
            acc_pre = tl.maximum(acc_pre, tl.abs(x8))
            acc_pre = tl.maximum(acc_pre, tl.abs(x9))
            acc_pre = tl.maximum(acc_pre, tl.abs(x10))
            acc_pre = tl.maximum(acc_pre, tl.abs(x11))
            acc_pre = tl.maximum(acc_pre, tl.abs(x12))
            acc_pre = tl.maximum(acc_pre, tl.abs(x13))
            acc_pre = tl.maximum(acc_pre, tl.abs(x14))
            acc_pre = tl.maximum(acc_pre, tl.abs(x15))
        if POST:
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, SIGN_MASK)
            acc_post = tl.maximum(acc_post, tl.abs(x0))
            acc_post = tl.maximum(acc_post, tl.abs(x1))
            acc_post = tl.maximum(acc_post, tl.abs(x2))
            acc_post = tl.maximum(acc_post, tl.abs(x3))
            acc_post = tl.maximum(acc_post, tl.abs(x4))
            acc_post = tl.maximum(acc_post, tl.abs(x5))
            acc_post = tl.maximum(acc_post, tl.abs(x6))
            acc_post = tl.maximum(acc_post, tl.abs(x7))
            acc_post = tl.maximum(acc_post, tl.abs(x8))
            acc_post = tl.maximum(acc_post, tl.abs(x9))
            acc_post = tl.maximum(acc_post, tl.abs(x10))
            acc_post = tl.maximum(acc_post, tl.abs(x11))
            acc_post = tl.maximum(acc_post, tl.abs(x12))
            acc_post = tl.maximum(acc_post, tl.abs(x13))
            acc_post = tl.maximum(acc_post, tl.abs(x14))
            acc_post = tl.maximum(acc_post, tl.abs(x15))
    if PRE:
        tl.atomic_max(pre_ptr + g, tl.max(acc_pre, axis=1), mask=in_group)
    if POST:
        tl.atomic_max(post_ptr + g, tl.max(acc_post, axis=1), mask=in_group)


@kernel_op("nvfp4_kernels::group_amax")
def group_amax(
    x: torch.Tensor, group_sizes: torch.Tensor, pre: bool, post: bool, sign_mask: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (pre-RHT amax, post-RHT amax), fp32 (G,) each, of x (T, K).

    capacity: the padded token count the groups fit in (numerics.columnwise_capacity(T, G),
    or T when every group size is a multiple of 16). An amax not asked for is all zeros.
    """
    x = x.contiguous()
    tokens, k = x.shape
    groups = group_sizes.shape[0]
    pre_amax = x.new_zeros(groups, dtype=torch.float32)
    post_amax = x.new_zeros(groups, dtype=torch.float32)
    if groups == 0 or k == 0 or tokens == 0 or not (pre or post):
        return pre_amax, post_amax
    cfg = amax_config(capacity, k)
    k_split = min(cfg.k_split, triton.cdiv(k, cfg.block_k))
    launch(
        _group_amax_kernel, (triton.cdiv(capacity, cfg.block_m), k_split),
        x_ptr=x, sizes_ptr=group_sizes.contiguous(),
        pre_ptr=pre_amax, post_ptr=post_amax, K=k, G=groups, rows_total=capacity,
        PRE=pre, POST=post, SIGN_MASK=sign_mask, BLOCK_G=max(triton.next_power_of_2(groups), 2),
        EVEN_K=k % cfg.block_k == 0, BM=cfg.block_m, BK=cfg.block_k, K_SPLIT=k_split, num_warps=cfg.num_warps,
    )
    return pre_amax, post_amax
