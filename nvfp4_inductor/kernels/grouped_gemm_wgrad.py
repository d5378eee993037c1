"""Grouped NVFP4 weight-gradient GEMM: per group, a contraction over its padded tokens.

    out[g] = bf16(alpha_g * sum_{p_g <= k < p_{g+1}} deq(a)[n, k] * deq(b)[m, k])

Kernel ``_grouped_gemm_wgrad_kernel``; launcher ``grouped_gemm_wgrad``; op
``nvfp4_kernels::grouped_gemm_wgrad``. Reference twin: ``numerics.grouped_gemm_wgrad_torch``.

Operands are the column-wise grouped copies (NVFP4GroupedTensor): a data (N, P/2) uint8,
scales (N, P/16) E4M3, post-RHT amax (G,); b (M, P/2), (M, P/16), amax (G,); the padded
offsets p (G+1,) int64, multiples of 16, on the device. Both operands are K-major along
the padded token axis, so the dequantization and epilogue are those of grouped_gemm.py
(see its docstring: exact fp16 operands scaled by 2**-14, two dots per K step over the
low and high nibbles, alpha and one bf16 rounding in the epilogue).

Schedule: persistent; every group owns the same cdiv(N, BN) * cdiv(M, BM) output tiles
(M fastest), so tile -> (group, tile) is a division; each tile loops over its group's K
range [p_g, p_{g+1}) in BK steps (masked at the end). An empty group writes zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._registry import kernel_op, launch
from .grouped_gemm import (_bits, deq_nibbles, expand_scales, gemm_alpha, gemm_config, num_programs, scale_fp16,
                           store_bf16)


@triton.jit
def wgrad_tile(tile, offsets_ptr, N, M, BN: tl.constexpr, BM: tl.constexpr):
    """tile -> (group g, M tile tm, N tile tn, K range [k_start, k_end) of group g): every
    group owns cdiv(N, BN) * cdiv(M, BM) tiles, M fastest."""
    m_tiles = tl.cdiv(M, BM)
    per_group = tl.cdiv(N, BN) * m_tiles
    g = tile // per_group
    local = tile % per_group
    k_start = tl.multiple_of(tl.load(offsets_ptr + g).to(tl.int32), 16)
    k_end = tl.multiple_of(tl.load(offsets_ptr + g + 1).to(tl.int32), 16)
    return g, local % m_tiles, local // m_tiles, k_start, k_end


@triton.jit
def _grouped_gemm_wgrad_kernel(
    a_ptr, a_scale_ptr, a_amax_ptr, b_ptr, b_scale_ptr, b_amax_ptr, offsets_ptr, out_ptr,
    N, M, P, G,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    per_group = tl.cdiv(N, BN) * tl.cdiv(M, BM)
    P2 = P // 2
    P16 = P // 16
    for tile in tl.range(tl.program_id(0), G * per_group, NUM_PROGRAMS):
        g, tm, tn, k_start, k_end = wgrad_tile(tile, offsets_ptr, N, M, BN, BM)
        rows_a = tn * BN + tl.arange(0, BN)  # rows of a = output rows (N)
        rows_b = tm * BM + tl.arange(0, BM)  # rows of b = output columns (M)
        a_ok = rows_a < N
        b_ok = rows_b < M
        kh = tl.arange(0, BK // 2)
        kb = tl.arange(0, BK // 16)
        a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * P2 + (k_start // 2 + kh)[None, :]
        b_ptrs = b_ptr + rows_b.to(tl.int64)[:, None] * P2 + (k_start // 2 + kh)[None, :]
        as_ptrs = a_scale_ptr + rows_a.to(tl.int64)[:, None] * P16 + (k_start // 16 + kb)[None, :]
        bs_ptrs = b_scale_ptr + rows_b.to(tl.int64)[:, None] * P16 + (k_start // 16 + kb)[None, :]
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BK, num_stages=NUM_STAGES):
            kh_ok = (k0 // 2 + kh) < k_end // 2
            kb_ok = (k0 // 16 + kb) < k_end // 16
            a = tl.load(a_ptrs, mask=a_ok[:, None] & kh_ok[None, :], other=0)
            b = tl.load(b_ptrs, mask=b_ok[:, None] & kh_ok[None, :], other=0)
            sa = tl.load(as_ptrs, mask=a_ok[:, None] & kb_ok[None, :], other=0)
            sb = tl.load(bs_ptrs, mask=b_ok[:, None] & kb_ok[None, :], other=0)
            a_lo, a_hi = deq_nibbles(a, expand_scales(scale_fp16(sa), BN, BK))
            b_lo, b_hi = deq_nibbles(b, expand_scales(scale_fp16(sb), BM, BK))
            acc = tl.dot(a_lo, tl.trans(b_lo), acc)
            acc = tl.dot(a_hi, tl.trans(b_hi), acc)
            a_ptrs += BK // 2
            b_ptrs += BK // 2
            as_ptrs += BK // 16
            bs_ptrs += BK // 16
        alpha = gemm_alpha(a_amax_ptr, b_amax_ptr, g)
        out_ptrs = out_ptr + (g.to(tl.int64) * N + rows_a)[:, None] * M + rows_b[None, :]
        store_bf16(out_ptrs, acc, alpha, a_ok[:, None] & b_ok[None, :])


@kernel_op("nvfp4_kernels::grouped_gemm_wgrad")
def _grouped_gemm_wgrad_op(
    a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
    b_data: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor,
    padded_offsets: torch.Tensor,
) -> torch.Tensor:
    """Scales as uint8 bits; every tensor contiguous. Returns (G, N, M) bf16."""
    n, half = a_data.shape
    m = b_data.shape[0]
    groups = padded_offsets.shape[0] - 1
    out = a_data.new_empty(groups, n, m, dtype=torch.bfloat16)
    if out.numel() == 0:
        return out
    if half == 0:
        return out.zero_()
    cfg = gemm_config("wgrad", a_data.device)
    programs = num_programs(cfg, a_data.device)
    # the kernel's BN tiles a's rows (N) and BM tiles b's rows (M)
    launch(
        _grouped_gemm_wgrad_kernel, (programs,),
        a_ptr=a_data, a_scale_ptr=a_scale, a_amax_ptr=a_amax, b_ptr=b_data, b_scale_ptr=b_scale,
        b_amax_ptr=b_amax, offsets_ptr=padded_offsets, out_ptr=out, N=n, M=m, P=2 * half, G=groups,
        BM=cfg.block_n, BN=cfg.block_m, BK=cfg.block_k,
        NUM_PROGRAMS=programs, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )
    return out


def check_wgrad_operands(name, a_data, a_scale, b_data, b_scale, padded_offsets) -> None:
    """The operand rules of every wgrad-shaped GEMM (plain and bf16-path)."""
    if a_data.dim() != 2 or b_data.dim() != 2 or a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"{name}: a_data (N, P/2) and b_data (M, P/2) must share P, got "
                         f"{tuple(a_data.shape)} and {tuple(b_data.shape)}")
    half = a_data.shape[1]
    if (2 * half) % 16 or a_scale.shape != (a_data.shape[0], half // 8) or b_scale.shape != (b_data.shape[0], half // 8):
        raise ValueError(f"{name}: scales must be (N, P/16) and (M, P/16) with P % 16 == 0, got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)} for P = {2 * half}")
    if padded_offsets.dim() != 1 or padded_offsets.shape[0] < 1:
        raise ValueError(f"{name}: padded_offsets must be (G+1,), got {tuple(padded_offsets.shape)}")


def grouped_gemm_wgrad(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_amax: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    b_amax: torch.Tensor,
    padded_offsets: torch.Tensor,
) -> torch.Tensor:
    """wgrad, the twin of ``numerics.grouped_gemm_wgrad_torch``: a (N, P/2) uint8, (N, P/16)
    E4M3, amax (G,); b (M, P/2), (M, P/16), amax (G,); padded_offsets (G+1,) int, multiples
    of 16, on the device. Returns (G, N, M) bf16 (zeros for an empty group)."""
    check_wgrad_operands("grouped_gemm_wgrad", a_data, a_scale, b_data, b_scale, padded_offsets)
    return _grouped_gemm_wgrad_op(
        a_data.contiguous(), _bits(a_scale), a_amax.float().contiguous(),
        b_data.contiguous(), _bits(b_scale), b_amax.float().contiguous(), padded_offsets.contiguous(),
    )
