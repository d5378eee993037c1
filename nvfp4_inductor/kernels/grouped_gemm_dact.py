"""fc2 dgrad with the activation backward in its epilogue, bit for bit the unfused chain

    G = kernels.grouped_gemm_via_bf16(dYq, W2 col)             (T, F) bf16, never stored
    dC, dp, D = kernels.activation.activation_backward(G, C, p, act, regenerate=...)

Kernels ``_grouped_gemm_dact_kernel`` (the GEMM and the elementwise epilogue, writing
dprob partials) and ``_dp_sum_kernel`` (the partials' sums); launcher
``grouped_gemm_dact``; op ``nvfp4_kernels::grouped_gemm_dact``. Reference: that chain
(numerics.grouped_gemm_torch, activations.activation_backward), up to the GEMM's fp32
summation order, which is grouped_gemm_via_bf16's.

Why the bits match:
* G: the launcher dequantizes dY's and W2's copies to transient bf16 deq() copies
  (``dequantize_bf16_pair``, one launch, or W2's a slice of rows at a time, dY's with the
  first, each slice's columns of G in a launch of their own, as ``grouped_gemm_via_bf16``
  does); the kernel runs grouped_gemm_via_bf16's K loop (``grouped_gemm_bf16.bf16_tile_acc``,
  natural K order; tiles from ``bf16_gemm_config("dact")`` via
  ``grouped_gemm_act.epilogue_config``), then bf16(acc * alpha_g) with RNE
  (``gemm_common.gemm_out_bits``), widened from its bits.
* dC, D: ``activation._act_bwd_kernel``'s operations in its order, with its helpers
  (``_mul_rn`` where a product feeds an addition, so no FMA contraction on the GPU).
  SwiGLU: G has F columns and dC 2F; program (tm, tn) reads C's gate and up columns
  j and F + j for its G columns j and writes dC at both, so halves always match.
* dp = activations.row_sum(G * f): each tile sums its runs of 16 columns with the
  halving tree (``activation._run_sums``) and stores them as partials (T, F/16) fp32;
  ``_dp_sum_kernel`` adds each row's partials to a zero total left to right. No atomics:
  the order is fixed whatever the tiling.

Needs F % 16 == 0 when probs are given (row_sum's runs), as activation_backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import is_deq_values
from ..sizes import is_zero
from ..tensor import Operand
from ._nvfp4 import to_float32
from ._registry import INTERPRET, cdiv, kernel_op, launch, next_power_of_2
from .activation import _act_code, _clamp, _run_sums, act_bwd_tile, is_gated
from .dequantize import bf16_operands, weight_slices
from .gemm_common import check_gemm_operands, gemm_alpha, gemm_out_bits, num_programs, tile_coords, tile_table
from .grouped_gemm_act import epilogue_config, widen
from .grouped_gemm_bf16 import bf16_tile_acc, slice_rows, use_tma


@triton.jit
def _halves(acc, BM: tl.constexpr, BN: tl.constexpr):
    """A (BM, BN) tile's column halves [0, BN/2) and [BN/2, BN)."""
    return tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _dact_epilogue(acc, alpha, p, c_ptr, dc_ptr, part_ptr, d_ptr, arow, row_ok, col0, col_end, F, NR, clamp,
                   ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, REGEN: tl.constexpr,
                   GPU: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr):
    """The epilogue of columns [col0, col0 + BW) of a tile, those below col_end (<= F): G's
    bits, the activation backward (stores dC, D), and dprob's partials of those columns'
    runs of 16."""
    cols = col0 + tl.arange(0, BW)
    mask = row_ok[:, None] & (cols < col_end)[None, :]
    g = widen(gemm_out_bits(acc, alpha))
    gf = act_bwd_tile(g, p, c_ptr, dc_ptr, d_ptr, arow, cols, mask, F, clamp, ACT, GATED, HAS_PROBS, REGEN, GPU)
    if HAS_PROBS:
        runs = _run_sums(gf, BM, BW)
        run = col0 // 16 + tl.arange(0, BW // 16)
        tl.store(part_ptr + arow[:, None] * NR + run[None, :], runs,
                 mask=row_ok[:, None] & (run < col_end // 16)[None, :])


@triton.jit
def _dact_epilogue_half(acc, alpha, p, c_ptr, dc_ptr, part_ptr, d_ptr, arow, row_ok, col0, col_end, F, NR, clamp,
                        ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, REGEN: tl.constexpr,
                        GPU: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr, PARTS: tl.constexpr):
    """The epilogue of a half tile (BM, BW) at column col0, whole (PARTS 1) or in its two
    halves one after the other (PARTS 2)."""
    if PARTS == 1:
        _dact_epilogue(acc, alpha, p, c_ptr, dc_ptr, part_ptr, d_ptr, arow, row_ok, col0, col_end, F, NR, clamp,
                       ACT, GATED, HAS_PROBS, REGEN, GPU, BM, BW)
    else:
        first, second = _halves(acc, BM, BW)
        _dact_epilogue(first, alpha, p, c_ptr, dc_ptr, part_ptr, d_ptr, arow, row_ok, col0, col_end, F, NR,
                       clamp, ACT, GATED, HAS_PROBS, REGEN, GPU, BM, BW // 2)
        _dact_epilogue(second, alpha, p, c_ptr, dc_ptr, part_ptr, d_ptr, arow, row_ok, col0 + BW // 2, col_end, F,
                       NR, clamp, ACT, GATED, HAS_PROBS, REGEN, GPU, BM, BW // 2)


@triton.jit
def _grouped_gemm_dact_kernel(
    a_ptr, a_amax_ptr, b_ptr, b_amax_ptr, sizes_ptr, c_ptr, p_ptr,
    dc_ptr, part_ptr, d_ptr,
    F, K, G, clamp, col_start, FS,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, REGEN: tl.constexpr, GPU: tl.constexpr,
    BLOCK_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    SPLIT: tl.constexpr, BAND: tl.constexpr,
):
    """a (T, K) bf16 (dY's deq()), b (G, FS, K) bf16 (rows col_start + [0, FS) of each of W2's
    column-wise deq() copies): G's columns col_start + [0, FS) of F. SPLIT 2 or 4: the
    epilogue runs on the tile's column halves or quarters one after the other (fewer live
    registers than the whole tile's C, dC and D tiles at once)."""
    NR = F // 16  # dprob partials per row
    col_end = col_start + FS
    sizes = tl.load(sizes_ptr + tl.arange(0, BLOCK_G), mask=tl.arange(0, BLOCK_G) < G, other=0)
    gi, sizes, m_tiles, n_tiles, tile_end, row_end, total = tile_table(sizes, FS, G, BLOCK_G, BM, BN)
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
        grp, tm, tn, size, row0 = tile_coords(tile, gi, sizes, m_tiles, n_tiles, tile_end, row_end, BAND)
        rows = tm * BM + tl.arange(0, BM)
        row_ok = rows < size
        arow = (row0 + rows).to(tl.int64)
        acc = bf16_tile_acc(a_ptr, b_ptr, row0, size, tm * BM, grp.to(tl.int64) * FS, FS, tn * BN, K,
                            BM, BN, BK, NUM_STAGES, EVEN_K, TMA)
        col0 = col_start + tn * BN
        alpha = gemm_alpha(a_amax_ptr, b_amax_ptr, grp)
        if HAS_PROBS:
            p = to_float32(tl.load(p_ptr + arow, mask=row_ok, other=0.0))[:, None]
        else:
            p = 1.0  # unused
        if SPLIT == 1:
            _dact_epilogue(acc, alpha, p, c_ptr, dc_ptr, part_ptr, d_ptr, arow, row_ok, col0, col_end, F, NR,
                           clamp, ACT, GATED, HAS_PROBS, REGEN, GPU, BM, BN)
        else:
            left, right = _halves(acc, BM, BN)
            _dact_epilogue_half(left, alpha, p, c_ptr, dc_ptr, part_ptr, d_ptr, arow, row_ok, col0, col_end, F, NR,
                                clamp, ACT, GATED, HAS_PROBS, REGEN, GPU, BM, BN // 2, SPLIT // 2)
            _dact_epilogue_half(right, alpha, p, c_ptr, dc_ptr, part_ptr, d_ptr, arow, row_ok, col0 + BN // 2,
                                col_end, F, NR, clamp, ACT, GATED, HAS_PROBS, REGEN, GPU, BM, BN // 2, SPLIT // 2)


@triton.jit
def _dp_sum_kernel(part_ptr, dp_ptr, T, NR, BM: tl.constexpr):
    """dp[t] = ((0 + part[t, 0]) + part[t, 1]) + ...: activations.row_sum's run totals."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    ok = rows < T
    rows64 = rows.to(tl.int64)
    total = tl.zeros((BM,), dtype=tl.float32)
    for j in range(NR):
        total = total + tl.load(part_ptr + rows64 * NR + j, mask=ok, other=0.0)
    tl.store(dp_ptr + rows, total, mask=ok)


def _dact_launches(k, a_amax, b_amax, group_sizes, c, probs, act, clamp, regenerate, f, slice_rows, make):
    """The body of both dact ops: (dC, dp, D) from G's columns made `slice_rows` at a time,
    each slice's b (G, rows, K) bf16 from ``make(first, rows)`` -> (a, b), b dropped before
    the next."""
    tokens = c.shape[0]
    dc = c.new_empty(c.shape, dtype=torch.bfloat16)
    dp = c.new_empty(tokens if probs is not None else 0, dtype=torch.float32)
    d = c.new_empty((tokens, f) if regenerate else (0,), dtype=torch.bfloat16)
    if is_zero(tokens) or f == 0 or group_sizes.shape[0] == 0:  # no experts; K == 0 runs
        return dc, dp, d
    part = c.new_empty((tokens, f // 16) if probs is not None else (0,), dtype=torch.float32)
    cfg = epilogue_config("dact", act, c.device)
    programs = num_programs(cfg, c.device)
    for first in range(0, f, slice_rows):
        a, b = make(first, min(slice_rows, f - first))
        groups = b.shape[0]
        launch(
            _grouped_gemm_dact_kernel, (programs,),
            a_ptr=a, a_amax_ptr=a_amax, b_ptr=b, b_amax_ptr=b_amax, sizes_ptr=group_sizes, c_ptr=c,
            p_ptr=probs, dc_ptr=dc, part_ptr=part if probs is not None else None, d_ptr=d if regenerate else None,
            F=f, K=k, G=groups, clamp=clamp, col_start=first, FS=b.shape[1],
            ACT=act, GATED=is_gated(act), HAS_PROBS=probs is not None, REGEN=regenerate, GPU=not INTERPRET,
            BLOCK_G=max(next_power_of_2(groups), 2), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
            NUM_PROGRAMS=programs, NUM_STAGES=cfg.num_stages, EVEN_K=k % cfg.block_k == 0,
            TMA=use_tma(cfg, c.device, k), SPLIT=cfg.epilogue_split, BAND=cfg.band_m,
            num_warps=cfg.num_warps,
        )
        del b  # before the next slice's buffer is allocated
    if probs is not None:
        launch(_dp_sum_kernel, (cdiv(tokens, 128),), part_ptr=part, dp_ptr=dp, T=tokens, NR=f // 16,
               BM=128, num_warps=4)
    return dc, dp, d


@kernel_op("nvfp4_kernels::grouped_gemm_dact")
def _grouped_gemm_dact_op(
    a: torch.Tensor, a_amax: torch.Tensor, b: torch.Tensor, b_amax: torch.Tensor,
    group_sizes: torch.Tensor, c: torch.Tensor, probs: Optional[torch.Tensor], act: int, clamp: float,
    regenerate: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a (T, K) bf16, b (G, F, K) bf16 (deq() values), contiguous. Returns (dC (T, F1) bf16,
    dp (T,) fp32 or an empty (0,), D (T, F) bf16 or an empty (0,))."""
    f = b.shape[1]
    return _dact_launches(a.shape[1], a_amax, b_amax, group_sizes, c, probs, act, clamp, regenerate, f, f,
                          lambda first, rows: (a, b))


@kernel_op("nvfp4_kernels::grouped_gemm_dact_slices")
def _grouped_gemm_dact_slices_op(
    a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
    b_amax: torch.Tensor, group_sizes: torch.Tensor, c: torch.Tensor, probs: Optional[torch.Tensor], act: int,
    clamp: float, regenerate: bool, slice_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_grouped_gemm_dact_op`` with b W2's packed column-wise copies, (G, F, K/2) uint8 and
    (G, F, K/16) E4M3 scales, contiguous, whose bf16 copy is made `slice_rows` of its F
    rows (G's columns) at a time, and a dY's deq() values or packed copy, as
    ``grouped_gemm_bf16._grouped_gemm_bf16_slices_op`` takes them."""
    return _dact_launches(2 * b_data.shape[2], a_amax, b_amax, group_sizes, c, probs, act, clamp, regenerate,
                          b_data.shape[1], slice_rows, weight_slices(b_data, b_scale, a_data, a_scale))


def grouped_gemm_dact(
    a: Operand,
    b: Operand,
    group_sizes: torch.Tensor,
    c: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    tanh_clamp_scale: Optional[float] = None,
    *,
    regenerate: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """fc2 dgrad + activation backward: (dC, dp or None, D or None), bit for bit

        G = grouped_gemm_via_bf16(a, b, group_sizes)
        activation.activation_backward(G, c, probs, activation, tanh_clamp_scale, regenerate=regenerate)

    a: dY's row-wise grouped copy (T, H/2), (T, H/16), amax (G,); b: W2's column-wise
    copies (G, F, H/2), (G, F, H/16), amax (G,); c: the saved pre-activation (T, F1) bf16.
    The bf16 deq() copies of a and b (``dequantize_bf16_pair``) live only inside this call;
    W2's, when large beside dY's, is made a slice of its F rows at a time
    (``grouped_gemm_bf16.slice_rows``)."""
    (a_data, a_scale, a_amax), (b_data, b_scale, b_amax) = a, b
    check_gemm_operands("grouped_gemm_dact", a_data, a_scale, b_data, b_scale, group_sizes)
    act, clamp = _act_code(activation), _clamp(activation, tanh_clamp_scale)
    f = b_data.shape[1]
    f1 = 2 * f if is_gated(act) else f
    if c.dtype != torch.bfloat16 or c.shape != (a_data.shape[0], f1):
        raise ValueError(f"grouped_gemm_dact: c must be ({a_data.shape[0]}, {f1}) bf16, got {c.dtype} {tuple(c.shape)}")
    if probs is not None and probs.shape != (a_data.shape[0],):
        raise ValueError(f"grouped_gemm_dact: probs must be ({a_data.shape[0]},), got {tuple(probs.shape)}")
    if probs is not None and f % 16:
        raise ValueError(f"grouped_gemm_dact: dp sums runs of 16 columns; F = {f} is not a multiple of 16")
    a_amax, b_amax, group_sizes = a_amax.float().contiguous(), b_amax.float().contiguous(), group_sizes.contiguous()
    c, probs = c.contiguous(), probs.contiguous() if probs is not None else None
    rows = slice_rows(a_data.shape[0], b_data.shape[0], f, epilogue_config("dact", act, a_data.device))
    if is_deq_values(b_data) or rows == f:
        a, b = bf16_operands(a_data, a_scale, b_data, b_scale)
        dc, dp, d = _grouped_gemm_dact_op(a, a_amax, b, b_amax, group_sizes, c, probs, act, clamp, bool(regenerate))
    else:
        dc, dp, d = _grouped_gemm_dact_slices_op(a_data.contiguous(), a_scale.contiguous(), a_amax,
                                                 b_data.contiguous(), b_scale.contiguous(), b_amax, group_sizes, c,
                                                 probs, act, clamp, bool(regenerate), rows)
    return dc, (dp if probs is not None else None), (d if regenerate else None)
