"""Grouped GEMMs on bf16 deq() copies: how NVFP4 operands reach Hopper's bf16 tensor cores
(SM90 has no FP4 ones).

    grouped_gemm_via_bf16        = dequantize_bf16_pair(a, b) -> _grouped_gemm_bf16_kernel
    grouped_gemm_wgrad_via_bf16  = dequantize_bf16_pair(a, b) -> _grouped_gemm_wgrad_bf16_kernel

Two launches each: one dequantizes both operands (their packed widths are equal), one
multiplies. Where a dgrad's packed weight stack would make a bf16 copy large beside the
token operand's (``slice_rows``), the weight's copy is made a slice of rows at a time, each
slice's dequantize and GEMM launched before the next, the token operand dequantized with
the first slice (2 x slices launches; the same bits, each output element the same dot).

Twins: ``numerics.grouped_gemm_torch`` / ``grouped_gemm_wgrad_torch`` (same arguments and
return types; results equal up to fp32 accumulation order). The bf16 copies are transient
(made and freed inside the call, never saved for backward). Both are the Triton lowering's
GEMMs: 1.3-2.25x faster on the H200 than dequantizing in registers inside the K loop, a
path since removed (docs/decisions.md, "GEMM operands: dequantize, then bf16 GEMM"). The fprop K loop is one helper,
``bf16_tile_acc``, called by ``_grouped_gemm_bf16_kernel`` and by the fused epilogue
kernels (grouped_gemm_act.py, grouped_gemm_dact.py), so fused and unfused C/G are equal
bit for bit whatever tile each uses (the K order is natural in all of them).

Numerics: deq() is exact in bf16 (dequantize.py), the tensor cores multiply exactly and
accumulate in fp32 in natural K order, alpha_g (``gemm_common.gemm_alpha``, one IEEE
division) multiplies the fp32 accumulator and one RNE rounding gives bf16
(``gemm_common.store_bf16``): out = bf16(acc * alpha_g). Both meet the fp64 bound of
tests/test_kernels_gemm_bf16.py.

Schedules: gemm_common.py's (``tile_table`` / ``tile_coords``: persistent, group tiles
from the device-side group sizes, M fastest within bands of ``band_m`` M tiles;
``wgrad_tile``). Tiles:
``config.bf16_gemm_config``. Operand loads, two variants (``Bf16GemmConfig.tma``):
* pointers (the wgrad's default): rows past a group's end (or past N) are clamped to a
  valid row instead of masked (those output rows/columns are not stored), so only the K
  tail is masked, and only when K % BK != 0 (fprop) or at each group's last K step (wgrad);
  Triton pipelines the loads with cp.async over ``num_stages``.
* TMA (``tma=True``, CUDA only; the default of the fprop, act and dact kernels, 3-19% faster
  there: docs/decisions.md, "Tile choices"): per-tile device-side tensor descriptors
  (``tl.make_tensor_descriptor``) whose shape ends at the group's last row (fprop) or the
  group's last padded token (wgrad), so the copy engine zero-fills past it; the
  descriptors live in a global scratch buffer Triton asks its allocator for (``use_tma``).
Both give the same bits: the same products in the same K order, and the rows each fills
differently are never stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import is_deq_values
from ..sizes import copy_slices
from ..tensor import Operand
from ._registry import INTERPRET, kernel_op, launch, next_power_of_2
from .config import Bf16GemmConfig, bf16_gemm_config
from .dequantize import bf16_operands, dequantize_bf16_pair, weight_slices
from .gemm_common import (check_gemm_operands, check_wgrad_operands, gemm_alpha, grouped_gemm_out, store_bf16,
                          tile_coords, tile_table, wgrad_tile)

_UPCAST: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def _mma(a, b, acc):
    """acc + a . b^T. The interpreter (triton 3.9) multiplies bf16 tiles as their integer
    bits, so there the exact bf16 values go through fp64, and each K step's dot is exact:
    deq() products are multiples of 2**-20 below 2**23, so a sum of BK < 2**10 of them
    has at most 53 bits, whatever order numpy's BLAS sums them in; it is rounded to fp32
    once and added to acc. (Through fp32, the BLAS's order depends on the output's column
    position in the tile, and the fused SwiGLU kernel places C's up columns F + j at
    other positions than the unfused GEMM does when F % BN != 0.)"""
    if _UPCAST:
        return acc + tl.dot(a.to(tl.float64), tl.trans(b).to(tl.float64), out_dtype=tl.float64).to(tl.float32)
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def bf16_tile_acc(a_ptr, b_ptr, a_base, a_len, a_off, b_base, b_len, b_off, K,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """The fp32 accumulator of one (BM, BN) output tile of a . b^T in natural K order:
    a's rows a_base + a_off + [0, BM) of a (*, K) bf16 matrix, b's rows b_base + b_off +
    [0, BN) of a (*, K) one, each operand seen as the a_len (b_len) rows from a_base
    (b_base); rows past that end are clamped (pointers) or zero-filled (TMA), and their
    output rows/columns must not be stored. The one K loop (``bf16_tile_accs``) of the
    fprop/dgrad kernel and of the fused epilogue kernels (grouped_gemm_act.py,
    grouped_gemm_dact.py), so their accumulators are equal bit for bit for equal operands
    and config."""
    acc, _ = bf16_tile_accs(a_ptr, b_ptr, a_base, a_len, a_off, b_base, b_base, b_len, b_off, K,
                            BM, BN, BK, NUM_STAGES, EVEN_K, TMA, False)
    return acc


@triton.jit
def bf16_tile_accs(a_ptr, b_ptr, a_base, a_len, a_off, b_base, b2_base, b_len, b_off, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, PAIR: tl.constexpr):
    """``bf16_tile_acc``'s accumulator, and with PAIR a second one of the same a tile times
    b's rows from b2_base (SwiGLU's up half beside its gate half): each a tile is loaded once
    for both, and each accumulator takes the same MMAs in the same K order as it would alone
    (without PAIR the second is a (1, 1) placeholder)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PAIR:
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        acc2 = tl.zeros((1, 1), dtype=tl.float32)
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr + a_base.to(tl.int64) * K, shape=[a_len, K], strides=[K, 1],
                                           block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr + b_base.to(tl.int64) * K, shape=[b_len, K], strides=[K, 1],
                                           block_shape=[BN, BK])
        if PAIR:
            b2_desc = tl.make_tensor_descriptor(b_ptr + b2_base.to(tl.int64) * K, shape=[b_len, K], strides=[K, 1],
                                                block_shape=[BN, BK])
        for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
            a = a_desc.load([a_off, k0])
            acc = _mma(a, b_desc.load([b_off, k0]), acc)
            if PAIR:
                acc2 = _mma(a, b2_desc.load([b_off, k0]), acc2)
    else:
        kk = tl.arange(0, BK)
        arow = (a_base + tl.minimum(a_off + tl.arange(0, BM), a_len - 1)).to(tl.int64)  # clamped: not stored
        brow = tl.minimum(b_off + tl.arange(0, BN), b_len - 1).to(tl.int64)
        a_ptrs = a_ptr + arow[:, None] * K + kk[None, :]
        b_ptrs = b_ptr + (b_base + brow)[:, None] * K + kk[None, :]
        b2_ptrs = b_ptr + (b2_base + brow)[:, None] * K + kk[None, :]
        for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
            if EVEN_K:
                a = tl.load(a_ptrs)
                acc = _mma(a, tl.load(b_ptrs), acc)
                if PAIR:
                    acc2 = _mma(a, tl.load(b2_ptrs), acc2)
            else:
                k_ok = (k0 + kk) < K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                acc = _mma(a, tl.load(b_ptrs, mask=k_ok[None, :], other=0.0), acc)
                if PAIR:
                    acc2 = _mma(a, tl.load(b2_ptrs, mask=k_ok[None, :], other=0.0), acc2)
            a_ptrs += BK
            b_ptrs += BK
            b2_ptrs += BK
    return acc, acc2


# ---------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _grouped_gemm_bf16_kernel(
    a_ptr, a_amax_ptr, b_ptr, b_amax_ptr, sizes_ptr, out_ptr,
    N, K, G, out_stride, out_col,
    BLOCK_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    BAND: tl.constexpr,
):
    """a (T, K) bf16, b (G, N, K) bf16: alpha_g * a_g . b_g^T (T, N) bf16 into columns
    out_col + [0, N) of out, rows out_stride apart (the whole out: N, 0)."""
    sizes = tl.load(sizes_ptr + tl.arange(0, BLOCK_G), mask=tl.arange(0, BLOCK_G) < G, other=0)
    gi, sizes, m_tiles, n_tiles, tile_end, row_end, total = tile_table(sizes, N, G, BLOCK_G, BM, BN)
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
        g, tm, tn, size, row0 = tile_coords(tile, gi, sizes, m_tiles, n_tiles, tile_end, row_end, BAND)
        rows = tm * BM + tl.arange(0, BM)
        cols = tn * BN + tl.arange(0, BN)
        row_ok = rows < size
        col_ok = cols < N
        acc = bf16_tile_acc(a_ptr, b_ptr, row0, size, tm * BM, g.to(tl.int64) * N, N, tn * BN, K,
                            BM, BN, BK, NUM_STAGES, EVEN_K, TMA)
        alpha = gemm_alpha(a_amax_ptr, b_amax_ptr, g)
        out_ptrs = out_ptr + (row0 + rows).to(tl.int64)[:, None] * out_stride + (out_col + cols)[None, :]
        store_bf16(out_ptrs, acc, alpha, row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_gemm_wgrad_bf16_kernel(
    a_ptr, a_amax_ptr, b_ptr, b_amax_ptr, offsets_ptr, out_ptr,
    N, M, P, G,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr,
):
    """a (N, P) bf16, b (M, P) bf16, out (G, N, M) bf16: out[g] = alpha_g * a[:, p_g:p_g+1] . b[:, ...]^T."""
    for tile in tl.range(tl.program_id(0), G * tl.cdiv(N, BN) * tl.cdiv(M, BM), NUM_PROGRAMS):
        g, tm, tn = wgrad_tile(tile, N, M, BN, BM)
        k_start = tl.multiple_of(tl.load(offsets_ptr + g).to(tl.int32), 16)
        k_end = tl.multiple_of(tl.load(offsets_ptr + g + 1).to(tl.int32), 16)
        rows_a = tn * BN + tl.arange(0, BN)  # output rows (N)
        rows_b = tm * BM + tl.arange(0, BM)  # output columns (M)
        a_ok = rows_a < N
        b_ok = rows_b < M
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        if TMA:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, k_end], strides=[P, 1], block_shape=[BN, BK])
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[M, k_end], strides=[P, 1], block_shape=[BM, BK])
            for k0 in tl.range(k_start, k_end, BK, num_stages=NUM_STAGES):
                a = a_desc.load([tn * BN, k0])
                b = b_desc.load([tm * BM, k0])
                acc = _mma(a, b, acc)
        else:
            kk = tl.arange(0, BK)
            a_rows = tl.minimum(rows_a, N - 1).to(tl.int64)  # clamped: not stored
            b_rows = tl.minimum(rows_b, M - 1).to(tl.int64)
            a_ptrs = a_ptr + a_rows[:, None] * P + (k_start + kk)[None, :]
            b_ptrs = b_ptr + b_rows[:, None] * P + (k_start + kk)[None, :]
            for k0 in tl.range(k_start, k_end, BK, num_stages=NUM_STAGES):
                k_ok = (k0 + kk) < k_end  # the group's last step: zeros past its tokens
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
                acc = _mma(a, b, acc)
                a_ptrs += BK
                b_ptrs += BK
        alpha = gemm_alpha(a_amax_ptr, b_amax_ptr, g)
        out_ptrs = out_ptr + (g.to(tl.int64) * N + rows_a)[:, None] * M + rows_b[None, :]
        store_bf16(out_ptrs, acc, alpha, a_ok[:, None] & b_ok[None, :])


# ---------------------------------------------------------------------------------------
# TMA descriptors


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-side tensor descriptors, from torch's caching allocator
    (stream-ordered, and from the graph's pool under CUDA graph capture)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def set_launch_allocator() -> None:
    """Give the calling thread Triton's allocator for the descriptors' scratch. Triton keeps
    it in a ContextVar, one per thread, and autograd runs a backward on a thread of its own,
    so it is set at every launch (``use_tma``), as Inductor's launcher does, and by the
    backend before each graph it runs without Inductor (traced launches run there as
    ``wrap_triton`` calls, which set none)."""
    triton.set_allocator(_scratch)


def use_tma(cfg: Bf16GemmConfig, device: torch.device, k: int) -> bool:
    """Whether a launch on `device` takes the TMA loads of `cfg` (CUDA only, K > 0); sets up
    the descriptors' allocator when it does. Shared with the fused epilogue kernels."""
    tma = cfg.tma and device.type == "cuda" and not INTERPRET and k > 0
    if tma:
        set_launch_allocator()
    return tma


# ---------------------------------------------------------------------------------------
# Ops on bf16 operands


def _fprop_launches(tokens: int, k: int, a_amax: torch.Tensor, b_amax: torch.Tensor, group_sizes: torch.Tensor,
                    groups: int, n: int, slice_rows: int, make) -> torch.Tensor:
    """The body of both fprop ops: out (T, n) bf16 = alpha_g * a_g . b_g^T, a (T, K) bf16,
    made `slice_rows` of out's columns at a time, each slice's b (G, rows, K) bf16 from
    ``make(first, rows)`` -> (a, b), b dropped before the next."""
    out, cfg, programs = grouped_gemm_out(b_amax, (tokens, n), k, groups, bf16_gemm_config, "fprop")
    if cfg is None:
        return out
    tma = use_tma(cfg, out.device, k)
    for first in range(0, n, slice_rows):
        a, b = make(first, min(slice_rows, n - first))
        launch(
            _grouped_gemm_bf16_kernel, (programs,),
            a_ptr=a, a_amax_ptr=a_amax, b_ptr=b, b_amax_ptr=b_amax, sizes_ptr=group_sizes, out_ptr=out,
            N=b.shape[1], K=k, G=groups, out_stride=n, out_col=first, BLOCK_G=max(next_power_of_2(groups), 2),
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, NUM_PROGRAMS=programs, NUM_STAGES=cfg.num_stages,
            EVEN_K=k % cfg.block_k == 0, TMA=tma, BAND=cfg.band_m, num_warps=cfg.num_warps,
        )
        del b  # before the next slice's buffer is allocated
    return out


@kernel_op("nvfp4_kernels::grouped_gemm_bf16")
def _grouped_gemm_bf16_op(
    a: torch.Tensor, a_amax: torch.Tensor, b: torch.Tensor, b_amax: torch.Tensor, group_sizes: torch.Tensor,
) -> torch.Tensor:
    """a (T, K) bf16, b (G, N, K) bf16 (deq() values), amax (G,) fp32; contiguous. -> (T, N) bf16."""
    groups, n, _ = b.shape
    return _fprop_launches(*a.shape, a_amax, b_amax, group_sizes, groups, n, n, lambda first, rows: (a, b))


@kernel_op("nvfp4_kernels::grouped_gemm_bf16_slices")
def _grouped_gemm_bf16_slices_op(
    a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
    b_amax: torch.Tensor, group_sizes: torch.Tensor, slice_rows: int,
) -> torch.Tensor:
    """``_grouped_gemm_bf16_op`` with b a packed weight stack, (G, N, K/2) uint8 and
    (G, N, K/16) E4M3 scales, contiguous: its bf16 copy is made `slice_rows` of its N
    rows (out's columns) at a time, each slice dequantized into a buffer of its own and
    multiplied into its columns of out before the next is made (a freed buffer is what the
    next one takes). a: (T, K) bf16 deq() values (a_scale unread), or packed (T, K/2) +
    (T, K/16), then dequantized with the first slice (``dequantize.weight_slices``).
    -> (T, N) bf16, equal bit for bit to the whole copy's GEMM."""
    groups, n, half = b_data.shape
    return _fprop_launches(a_data.shape[0], 2 * half, a_amax, b_amax, group_sizes, groups, n, slice_rows,
                           weight_slices(b_data, b_scale, a_data, a_scale))


@kernel_op("nvfp4_kernels::grouped_gemm_wgrad_bf16")
def _grouped_gemm_wgrad_bf16_op(
    a: torch.Tensor, a_amax: torch.Tensor, b: torch.Tensor, b_amax: torch.Tensor, padded_offsets: torch.Tensor,
) -> torch.Tensor:
    """a (N, P) bf16, b (M, P) bf16 (deq() values), amax (G,), offsets (G+1,); contiguous -> (G, N, M)."""
    n, p = a.shape
    m = b.shape[0]
    groups = padded_offsets.shape[0] - 1
    out, cfg, programs = grouped_gemm_out(a, (groups, n, m), p, groups, bf16_gemm_config, "wgrad")
    if cfg is None:
        return out
    tma = use_tma(cfg, a.device, p)
    # the kernel's BN tiles a's rows (N), BM tiles b's rows (M)
    launch(
        _grouped_gemm_wgrad_bf16_kernel, (programs,),
        a_ptr=a, a_amax_ptr=a_amax, b_ptr=b, b_amax_ptr=b_amax, offsets_ptr=padded_offsets, out_ptr=out,
        N=n, M=m, P=p, G=groups, BM=cfg.block_n, BN=cfg.block_m, BK=cfg.block_k,
        NUM_PROGRAMS=programs, NUM_STAGES=cfg.num_stages, TMA=tma, num_warps=cfg.num_warps,
    )
    return out


# ---------------------------------------------------------------------------------------
# The NVFP4 entry points: dequantize -> bf16 GEMM


def grouped_gemm_via_bf16(
    a: Operand,
    b: Operand,
    group_sizes: torch.Tensor,
) -> torch.Tensor:
    """fprop / dgrad, the twin of ``numerics.grouped_gemm_torch``: a (T, K/2) uint8, (T, K/16)
    E4M3, amax (G,); b (G, N, K/2), (G, N, K/16), amax (G,); group sizes (G,) on the device.
    Returns (T, N) bf16. The bf16 deq() copies of a and b live only inside this call; a
    packed b (a weight stack) whose copy is large beside a's is copied a slice of its N rows
    at a time (``slice_rows``)."""
    (a_data, a_scale, a_amax), (b_data, b_scale, b_amax) = a, b
    check_gemm_operands("grouped_gemm", a_data, a_scale, b_data, b_scale, group_sizes)
    a_amax, b_amax, group_sizes = a_amax.float().contiguous(), b_amax.float().contiguous(), group_sizes.contiguous()
    groups, n = b_data.shape[:2]
    rows = slice_rows(a_data.shape[0], groups, n, bf16_gemm_config("fprop", a_data.device))
    if is_deq_values(b_data) or rows == n:
        a, b = bf16_operands(a_data, a_scale, b_data, b_scale)
        return _grouped_gemm_bf16_op(a, a_amax, b, b_amax, group_sizes)
    return _grouped_gemm_bf16_slices_op(a_data.contiguous(), a_scale.contiguous(), a_amax, b_data.contiguous(),
                                        b_scale.contiguous(), b_amax, group_sizes, rows)


def grouped_gemm_wgrad_via_bf16(
    a: Operand,
    b: Operand,
    padded_offsets: torch.Tensor,
) -> torch.Tensor:
    """wgrad, the twin of ``numerics.grouped_gemm_wgrad_torch``: a (N, P/2) uint8, (N, P/16)
    E4M3, amax (G,); b (M, P/2), (M, P/16), amax (G,); padded_offsets (G+1,), multiples of 16,
    on the device. Returns (G, N, M) bf16 (zeros for an empty group). The bf16 deq() copies
    live only inside this call."""
    (a_data, a_scale, a_amax), (b_data, b_scale, b_amax) = a, b
    check_wgrad_operands("grouped_gemm_wgrad", a_data, a_scale, b_data, b_scale, padded_offsets)
    a, b = dequantize_bf16_pair(a_data, a_scale, b_data, b_scale)
    return _grouped_gemm_wgrad_bf16_op(a, a_amax.float().contiguous(), b, b_amax.float().contiguous(),
                                       padded_offsets.contiguous())


def slice_rows(tokens, groups: int, rows: int, cfg: Bf16GemmConfig) -> int:
    """Rows of each of a weight stack's `groups` experts of `rows` rows (out's columns) whose
    bf16 copy is made at a time beside the copy of `tokens` token rows: ``sizes.copy_slices``
    slices of at least ``cfg.min_slice_rows`` rows, each a whole number of the GEMM's
    ``cfg.block_n``-column tiles (`rows`: the whole copy at once)."""
    slices = copy_slices(tokens, groups, rows, cfg.min_slice_rows)
    return min(max(-(-rows // slices // cfg.block_n), 1) * cfg.block_n, rows) if slices > 1 else rows
