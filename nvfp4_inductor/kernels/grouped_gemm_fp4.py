"""Grouped NVFP4 GEMMs on Blackwell's FP4 tensor cores (SM10x), through Triton's
``tl.dot_scaled``: the packed E2M1 codes and E4M3 block scales of this package's containers
go straight to ``tcgen05.mma ... kind::mxf4nvf4`` with 16-element blocks, no dequantize pass.

    grouped_gemm_fp4        fprop / dgrad, the twin of numerics.grouped_gemm_torch
    grouped_gemm_wgrad_fp4  wgrad,         the twin of numerics.grouped_gemm_wgrad_torch

Same arguments and return types as the step table's ``grouped_gemm`` / ``grouped_gemm_wgrad``
(``lowerings/steps.py``), so a step table can take them as they are: the triton_fp4
target's (``lowerings/triton.FP4_STEPS``, SM10x, chosen only after its self-check on the
GPU passed, ``lowerings/fp4_self_check.py``; docs/decisions.md, "FP4 tensor-core GEMMs on
SM10x: Triton's dot_scaled").

What it assumes:
* **Operands packed, K-major, as the containers hold them** (docs/numerics.md 1): data
  (rows, K/2) uint8, element 2i in the low nibble (``tl.dot_scaled``'s packing too); scales
  (rows, K/16) E4M3 bits, plain row-major (no 128x4 swizzle: the kernel loads a (BM, BK/16)
  scale tile per K step itself). fprop/dgrad: a a row-wise grouped copy, b a per-expert copy
  (G, N, K/2); wgrad: both column-wise grouped copies (N, P/2), (M, P/2), K = the padded token
  axis (5.1). Both operands of every GEMM are K-major, which ``kind::mxf4nvf4`` requires (it
  takes no transposed operand). deq() operands (``formats.is_deq_values``) are refused: a step
  table using these GEMMs sets ``Steps.deq_operands=False``.
* **Scales non-negative, never the NaN code**: the hardware reads block scales as UE4M3; our
  casts write s >= 0 and never 0x7F (numerics.md 2.2).
* **Triton 3.6 or later on an SM100 / SM103 GPU.** Triton 3.6 takes the block size (16) from
  the scale tile's dtype (float8e4nv; uint8 would mean E8M0, 32), 3.9 from its shape
  ([BM, BK/16]); the kernel passes float8e4nv tiles of that shape, which both read as NVFP4.
  tests/test_native_fp4.py compiles both kernels for sm_100 on the CPU and finds
  ``kind::mxf4nvf4`` with 16-element blocks in the PTX (3.9 ``block16``; 3.6, run by hand,
  ``scale_vec::4X``). Consumer Blackwell (SM12x) lowers ``dot_scaled`` to other instructions,
  not checked here.
* **Numerics** (numerics.md 5.4, 7): every product deq(a) * deq(b) is exact; the tensor core
  sums them into an fp32 accumulator in its own order (so a target built on these GEMMs
  agrees with the reference to fp32-accumulation level, numerics.md 7: the bound of
  tests/test_kernels_gemm_bf16.py); alpha_g multiplies the fp32 accumulator and one RNE
  rounding gives bf16 (``gemm_common.store_bf16``), as on the Triton target. Whether the
  accumulator keeps full fp32 precision across the instruction's K (Hopper's FP8 MMA does
  not) is what only an SM10x GPU can measure.

Under the Triton interpreter (CI, the CPU) the one instruction is replaced (``NATIVE`` off,
``_fp4_mma``): triton 3.9's interpreter reads float8e4nv scales of ``dot_scaled`` as E8M0
(2**(byte - 127)), and 3.6's has no ``dot_scaled`` at all. The replacement decodes the same
tiles exactly and sums each K step in fp64 (exact, as ``grouped_gemm_bf16._mma`` does), so
everything else of the kernel -- schedule, group tables, data and scale tile addressing,
K tails, clamped rows, empty groups, the alpha epilogue -- runs in CI, and its outputs equal
the Triton target's bf16-operand GEMMs bit for bit at the same BK (tests/test_native_fp4.py).

Schedules: ``gemm_common``'s (persistent; fprop tiles from the device-side group sizes,
wgrad tiles by division). Loads: pointers, rows past a group's end (or past N) clamped to a
valid row and never stored, the K tail masked to code 0 with scale 0 (a +0 product). Tiles:
``fp4_gemm_config``, not measured on any GPU yet.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..constants import BLOCK
from ..formats import is_deq_values
from ..tensor import Operand
from ._nvfp4 import e2m1_value, e4m3_decode
from ._registry import INTERPRET, kernel_op, launch, next_power_of_2
from .gemm_common import (check_gemm_operands, check_wgrad_operands, gemm_alpha, grouped_gemm_out, store_bf16,
                          tile_coords, tile_table, wgrad_tile)


# ---------------------------------------------------------------------------------------
# Tiles


@dataclasses.dataclass(frozen=True)
class Fp4GemmConfig:
    block_m: int  # output rows (tokens; N of the wgrad) per tile
    block_n: int  # output columns per tile
    block_k: int  # elements of K per step (block_k / 2 bytes, block_k / 16 scales), a power of 2 >= 32
    num_warps: int
    num_stages: int
    num_programs: int = 0  # persistent programs; 0 = one per SM (1 off CUDA)
    band_m: int = 0  # fprop tile order: M tiles per band (gemm_common.tile_coords); 0 = a group's all

    def __post_init__(self):
        if self.block_k < 2 * BLOCK or self.block_k & (self.block_k - 1):
            raise ValueError(f"Fp4GemmConfig.block_k must be a power of 2 >= {2 * BLOCK} (whole scale blocks, "
                             f"a power-of-2 scale tile), got {self.block_k}")


def fp4_gemm_config(kind: str, device: torch.device) -> Fp4GemmConfig:
    """Tiles of `kind` ("fprop" or "wgrad"). Off CUDA (the interpreter): the bf16 GEMMs'
    interpreter tiles (``config.bf16_gemm_config``), so the two kernels sum the same K steps.
    On CUDA: a first guess for SM100 (128-row tiles, 256 elements = 4 ``mxf4nvf4`` K steps a
    load, as Triton's block-scaled matmul tutorial), never measured."""
    if INTERPRET or device.type != "cuda":
        return Fp4GemmConfig(32, 32, 32, 4, 1, 2)
    if kind == "fprop":
        return Fp4GemmConfig(128, 128, 256, 4, 3, band_m=8)
    return Fp4GemmConfig(128, 128, 256, 4, 3)


# ---------------------------------------------------------------------------------------
# The K loop


@triton.jit
def _deq_tile(data, scale, R: tl.constexpr, BK: tl.constexpr):
    """(R, BK/2) packed codes, (R, BK/16) E4M3 bits -> (R, BK) fp64 deq() values (exact:
    ``formats.block_values``)."""
    lo = e2m1_value(data.to(tl.int32) & 0xF)  # element 2i
    hi = e2m1_value(data.to(tl.int32) >> 4)  # element 2i + 1
    codes = tl.reshape(tl.join(lo, hi), (R, BK))
    s = tl.reshape(tl.broadcast_to(e4m3_decode(scale.to(tl.int32))[:, :, None], (R, BK // 16, 16)), (R, BK))
    return (codes * s).to(tl.float64)  # the fp32 product is exact (<= 6 significant bits)


@triton.jit
def _fp4_mma(a, sa, b, sb, acc, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NATIVE: tl.constexpr):
    """acc + deq(a) . deq(b)^T for one K step: a (BM, BK/2) and b (BN, BK/2) packed E2M1,
    sa (BM, BK/16) and sb (BN, BK/16) E4M3 bits (uint8).

    NATIVE: one ``tl.dot_scaled`` on the FP4 tensor cores, the scales as float8e4nv tiles
    (the module docstring says why that dtype). Otherwise (the interpreter) the exact sum of
    the step's BK products in fp64 (deq() products are multiples of 2**-20 below 2**23, a
    sum of BK < 2**10 of them fits 53 bits), rounded to fp32 once and added to acc: as
    ``grouped_gemm_bf16._mma`` under the interpreter."""
    if NATIVE:
        return tl.dot_scaled(a, sa.to(tl.float8e4nv, bitcast=True), "e2m1",
                             tl.trans(b), sb.to(tl.float8e4nv, bitcast=True), "e2m1", acc)
    av = _deq_tile(a, sa, BM, BK)
    bv = _deq_tile(b, sb, BN, BK)
    return acc + tl.dot(av, tl.trans(bv), out_dtype=tl.float64).to(tl.float32)


@triton.jit
def _fp4_tile_acc(a_ptr, sa_ptr, b_ptr, sb_ptr, a_rows, b_rows, k_start, k_end, K,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr,
                  EVEN_K: tl.constexpr, NATIVE: tl.constexpr):
    """The fp32 accumulator of a[a_rows] . b[b_rows]^T over K elements [k_start, k_end),
    natural K order, both operands (rows, K/2) bytes + (rows, K/16) scales row-major.
    k_start and k_end are multiples of 16; EVEN_K: every step is whole (no mask)."""
    kh = tl.arange(0, BK // 2)
    ks = tl.arange(0, BK // 16)
    a_rows = a_rows.to(tl.int64)
    b_rows = b_rows.to(tl.int64)
    sa_ptr = sa_ptr.to(tl.pointer_type(tl.uint8))  # an E4M3 tensor or its uint8 bits: read as bits
    sb_ptr = sb_ptr.to(tl.pointer_type(tl.uint8))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BK, num_stages=NUM_STAGES):
        bytes_ = k0 // 2 + kh
        blocks = k0 // 16 + ks
        a_at = a_ptr + a_rows[:, None] * (K // 2) + bytes_[None, :]
        b_at = b_ptr + b_rows[:, None] * (K // 2) + bytes_[None, :]
        sa_at = sa_ptr + a_rows[:, None] * (K // 16) + blocks[None, :]
        sb_at = sb_ptr + b_rows[:, None] * (K // 16) + blocks[None, :]
        if EVEN_K:
            a, b, sa, sb = tl.load(a_at), tl.load(b_at), tl.load(sa_at), tl.load(sb_at)
        else:  # past k_end: code 0 with scale 0, a +0 product
            byte_ok = (bytes_ < k_end // 2)[None, :]
            block_ok = (blocks < k_end // 16)[None, :]
            a = tl.load(a_at, mask=byte_ok, other=0)
            b = tl.load(b_at, mask=byte_ok, other=0)
            sa = tl.load(sa_at, mask=block_ok, other=0)
            sb = tl.load(sb_at, mask=block_ok, other=0)
        acc = _fp4_mma(a, sa, b, sb, acc, BM, BN, BK, NATIVE)
    return acc


# ---------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _grouped_gemm_fp4_kernel(
    a_ptr, sa_ptr, a_amax_ptr, b_ptr, sb_ptr, b_amax_ptr, sizes_ptr, out_ptr,
    N, K, G,
    BLOCK_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, BAND: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """a (T, K/2) + (T, K/16), b (G, N, K/2) + (G, N, K/16): out (T, N) bf16 =
    alpha_g * deq(a_g) . deq(b_g)^T."""
    sizes = tl.load(sizes_ptr + tl.arange(0, BLOCK_G), mask=tl.arange(0, BLOCK_G) < G, other=0)
    gi, sizes, m_tiles, n_tiles, tile_end, row_end, total = tile_table(sizes, N, G, BLOCK_G, BM, BN)
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
        g, tm, tn, size, row0 = tile_coords(tile, gi, sizes, m_tiles, n_tiles, tile_end, row_end, BAND)
        rows = tm * BM + tl.arange(0, BM)
        cols = tn * BN + tl.arange(0, BN)
        a_rows = row0 + tl.minimum(rows, size - 1)  # clamped: those output rows are not stored
        b_rows = g.to(tl.int64) * N + tl.minimum(cols, N - 1)
        acc = _fp4_tile_acc(a_ptr, sa_ptr, b_ptr, sb_ptr, a_rows, b_rows, 0, K, K,
                            BM, BN, BK, NUM_STAGES, EVEN_K, NATIVE)
        alpha = gemm_alpha(a_amax_ptr, b_amax_ptr, g)
        out_ptrs = out_ptr + (row0 + rows).to(tl.int64)[:, None] * N + cols[None, :]
        store_bf16(out_ptrs, acc, alpha, (rows < size)[:, None] & (cols < N)[None, :])


@triton.jit
def _grouped_gemm_wgrad_fp4_kernel(
    a_ptr, sa_ptr, a_amax_ptr, b_ptr, sb_ptr, b_amax_ptr, offsets_ptr, out_ptr,
    N, M, P, G,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr, NATIVE: tl.constexpr,
):
    """a (N, P/2) + (N, P/16), b (M, P/2) + (M, P/16): out (G, N, M) bf16, out[g] =
    alpha_g * deq(a)[:, p_g:p_g+1] . deq(b)[:, p_g:p_g+1]^T (zeros for an empty group)."""
    for tile in tl.range(tl.program_id(0), G * tl.cdiv(N, BN) * tl.cdiv(M, BM), NUM_PROGRAMS):
        g, tm, tn = wgrad_tile(tile, N, M, BN, BM)
        k_start = tl.multiple_of(tl.load(offsets_ptr + g).to(tl.int32), 16)
        k_end = tl.multiple_of(tl.load(offsets_ptr + g + 1).to(tl.int32), 16)
        rows_a = tn * BN + tl.arange(0, BN)  # output rows (N)
        rows_b = tm * BM + tl.arange(0, BM)  # output columns (M)
        acc = _fp4_tile_acc(a_ptr, sa_ptr, b_ptr, sb_ptr, tl.minimum(rows_a, N - 1), tl.minimum(rows_b, M - 1),
                            k_start, k_end, P, BN, BM, BK, NUM_STAGES, False, NATIVE)
        alpha = gemm_alpha(a_amax_ptr, b_amax_ptr, g)
        out_ptrs = out_ptr + (g.to(tl.int64) * N + rows_a)[:, None] * M + rows_b[None, :]
        store_bf16(out_ptrs, acc, alpha, (rows_a < N)[:, None] & (rows_b < M)[None, :])


# ---------------------------------------------------------------------------------------
# Ops


@kernel_op("nvfp4_kernels::grouped_gemm_fp4")
def _grouped_gemm_fp4_op(
    a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
    b_amax: torch.Tensor, group_sizes: torch.Tensor,
) -> torch.Tensor:
    """Packed operands as ``grouped_gemm_fp4`` takes them, contiguous; amax (G,) fp32 -> (T, N) bf16."""
    tokens, half = a_data.shape
    groups, n, _ = b_data.shape
    out, cfg, programs = grouped_gemm_out(a_data, (tokens, n), half, groups, fp4_gemm_config, "fprop")
    if cfg is None:
        return out
    launch(
        _grouped_gemm_fp4_kernel, (programs,),
        a_ptr=a_data, sa_ptr=a_scale, a_amax_ptr=a_amax, b_ptr=b_data, sb_ptr=b_scale, b_amax_ptr=b_amax,
        sizes_ptr=group_sizes, out_ptr=out, N=n, K=2 * half, G=groups, BLOCK_G=max(next_power_of_2(groups), 2),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, NUM_PROGRAMS=programs, NUM_STAGES=cfg.num_stages,
        EVEN_K=(2 * half) % cfg.block_k == 0, BAND=cfg.band_m, NATIVE=not INTERPRET, num_warps=cfg.num_warps,
    )
    return out


@kernel_op("nvfp4_kernels::grouped_gemm_wgrad_fp4")
def _grouped_gemm_wgrad_fp4_op(
    a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
    b_amax: torch.Tensor, padded_offsets: torch.Tensor,
) -> torch.Tensor:
    """Packed operands as ``grouped_gemm_wgrad_fp4`` takes them, contiguous -> (G, N, M) bf16."""
    n, half = a_data.shape
    m = b_data.shape[0]
    groups = padded_offsets.shape[0] - 1
    out, cfg, programs = grouped_gemm_out(a_data, (groups, n, m), half, groups, fp4_gemm_config, "wgrad")
    if cfg is None:
        return out
    # the kernel's BN tiles a's rows (N), BM tiles b's rows (M), as the bf16 wgrad's
    launch(
        _grouped_gemm_wgrad_fp4_kernel, (programs,),
        a_ptr=a_data, sa_ptr=a_scale, a_amax_ptr=a_amax, b_ptr=b_data, sb_ptr=b_scale, b_amax_ptr=b_amax,
        offsets_ptr=padded_offsets, out_ptr=out, N=n, M=m, P=2 * half, G=groups,
        BM=cfg.block_n, BN=cfg.block_m, BK=cfg.block_k, NUM_PROGRAMS=programs, NUM_STAGES=cfg.num_stages,
        NATIVE=not INTERPRET, num_warps=cfg.num_warps,
    )
    return out


# ---------------------------------------------------------------------------------------
# The step-table entry points


def _check_packed(name: str, **operands) -> None:
    """Each operand's data is packed E2M1 (uint8) and its scale E4M3 (float8_e4m3fn or uint8 bits)."""
    for which, (data, scale) in operands.items():
        if is_deq_values(data):
            raise ValueError(f"{name}: {which}_data must be packed E2M1 codes (uint8), got its deq() values "
                             f"(bf16 {tuple(data.shape)}); a step table with these GEMMs sets deq_operands=False")
        if data.dtype != torch.uint8:
            raise ValueError(f"{name}: {which}_data must be uint8 (two E2M1 codes a byte), got {data.dtype}")
        if scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError(f"{name}: {which}_scale must be float8_e4m3fn (or its uint8 bits), got {scale.dtype}")


def _check_amax(name: str, groups: int, **amaxes) -> None:
    for which, amax in amaxes.items():
        if amax.shape != (groups,):
            raise ValueError(f"{name}: {which}_amax must be ({groups},), one per group, got {tuple(amax.shape)}")


def grouped_gemm_fp4(
    a: Operand,
    b: Operand,
    group_sizes: torch.Tensor,
) -> torch.Tensor:
    """fprop / dgrad, the twin of ``numerics.grouped_gemm_torch``: a (T, K/2) uint8, (T, K/16)
    E4M3, amax (G,); b (G, N, K/2), (G, N, K/16), amax (G,); group sizes (G,) on the device.
    Returns (T, N) bf16. Reads the operands where they are (no copy when contiguous)."""
    (a_data, a_scale, a_amax), (b_data, b_scale, b_amax) = a, b
    name = "grouped_gemm_fp4"
    check_gemm_operands(name, a_data, a_scale, b_data, b_scale, group_sizes)
    _check_packed(name, a=(a_data, a_scale), b=(b_data, b_scale))
    _check_amax(name, b_data.shape[0], a=a_amax, b=b_amax)
    return _grouped_gemm_fp4_op(a_data.contiguous(), a_scale.contiguous(), a_amax.float().contiguous(),
                                b_data.contiguous(), b_scale.contiguous(), b_amax.float().contiguous(),
                                group_sizes.contiguous())


def grouped_gemm_wgrad_fp4(
    a: Operand,
    b: Operand,
    padded_offsets: torch.Tensor,
) -> torch.Tensor:
    """wgrad, the twin of ``numerics.grouped_gemm_wgrad_torch``: a (N, P/2) uint8, (N, P/16)
    E4M3, amax (G,); b (M, P/2), (M, P/16), amax (G,); padded_offsets (G+1,), multiples of 16,
    on the device. Returns (G, N, M) bf16 (zeros for an empty group)."""
    (a_data, a_scale, a_amax), (b_data, b_scale, b_amax) = a, b
    name = "grouped_gemm_wgrad_fp4"
    check_wgrad_operands(name, a_data, a_scale, b_data, b_scale, padded_offsets)
    _check_packed(name, a=(a_data, a_scale), b=(b_data, b_scale))
    _check_amax(name, padded_offsets.shape[0] - 1, a=a_amax, b=b_amax)
    return _grouped_gemm_wgrad_fp4_op(a_data.contiguous(), a_scale.contiguous(), a_amax.float().contiguous(),
                                      b_data.contiguous(), b_scale.contiguous(), b_amax.float().contiguous(),
                                      padded_offsets.contiguous())
