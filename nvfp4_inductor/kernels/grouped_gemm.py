"""Grouped NVFP4 GEMM for fprop and dgrad on tensor cores without FP4 (SM80/SM90), and
under the Triton interpreter on CPU.

    out[t] = bf16(alpha_g * sum_k deq(a)[t, k] * deq(b_g)[n, k])     t in group g

Kernel ``_grouped_gemm_kernel``; launcher ``grouped_gemm``; op ``nvfp4_kernels::grouped_gemm``.
Reference twin: ``numerics.grouped_gemm_torch`` (same arguments, same return type).

Not the Triton lowering's fprop/dgrad since benchmarks/NOTES.md run P1: that is
``grouped_gemm_bf16.grouped_gemm_via_bf16`` (dequantize to bf16, then a bf16-operand GEMM,
1.3-2.25x faster on the H200), whose K loop the fused epilogue kernels share. This kernel
stays available and tested (tests/test_kernels_gemm.py) as the in-register alternative.

Operands. a: row-wise grouped copy, data (T, K/2) uint8, scales (T, K/16) E4M3, amax (G,);
b: per-expert copies (G, N, K/2), (G, N, K/16), amax (G,). deq() = e2m1 * e4m3 has at most
6 significant bits and lies in [2**-10, 2688], so it is exact in fp16 and in bf16 (SPEC 7).

Dequantization in registers, with integer ops only (no fp8 casts, PITFALLS):
* a code c (4 bits) placed as ``(c & 7) << 9 | (c & 8) << 12`` is the fp16 bit pattern of
  e2m1(c) * 2**-14 (the E2M1 exponent lands in fp16's exponent field, bias 15 instead of
  1; code 1 = 0.5 becomes the fp16 subnormal 2**-15, which is exact);
* an E4M3 scale s placed as ``(s & 0x7F) << 7`` is fp16(s) * 2**-8 (subnormals too);
  one exact fp16 multiply by 2**8 (per 16 elements) restores it;
* deq * 2**-14 = fp16 code value times fp16 scale: one multiply, exact (the product has
  <= 6 significant bits and is a multiple of 2**-24, the smallest fp16 subnormal).
The fp16 tensor cores (same rate and fp32 accumulation as bf16) then see exact operands
scaled by 2**-14 each; the epilogue multiplies the fp32 accumulator by 2**28 (exact) and
then by alpha_g = A_a,g * A_b,g / 2688**2 (computed as numerics.gemm_alpha: one IEEE
division), and rounds once to bf16 (integer round-to-nearest-even).

K order. The two nibbles of a byte hold elements 2i and 2i+1. Rather than interleaving
them, each K step issues two dots: low nibbles against low nibbles, high against high.
That permutes the order of the K sum (results are not bitwise equal to a matmul in
natural K order; they are deterministic: the same inputs always give the same bits).

Schedule. A persistent grid (one program per SM) walks the tiles of all groups:
group g owns cdiv(m_g, BM) * cdiv(N, BN) tiles, M fastest (consecutive programs share
b's N tile). Each program computes the tile prefix sums from the (G,) group sizes on the
device (no host sync, one launch for any routing); empty groups own no tiles, and rows
past a group's end are masked to zero.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import triton
import triton.language as tl

from ..constants import GEMM_ALPHA_DIVISOR
from ._nvfp4 import bf16_round
from ._registry import INTERPRET, kernel_op, launch, next_power_of_2

_ALPHA_DIVISOR: tl.constexpr = tl.constexpr(GEMM_ALPHA_DIVISOR)  # 2688**2, exact in fp32
_UNSCALE: tl.constexpr = tl.constexpr(2.0**28)  # undoes the 2**-14 of each fp16 operand


# ---------------------------------------------------------------------------------------
# Device helpers shared with grouped_gemm_wgrad.py


@triton.jit
def scale_fp16(s):
    """E4M3 scale bits (uint8 tile) -> the exact scale value in fp16 (scales are >= 0)."""
    bits = (s.to(tl.uint16) & 0x7F) << 7  # fp16 bits of s * 2**-8: exponent bias 15 vs 7
    return bits.to(tl.float16, bitcast=True) * 256.0  # exact (<= 448, subnormals become normal)


@triton.jit
def deq_nibbles(data, scale):
    """Packed E2M1 bytes (R, C) uint8 and the fp16 scale of each byte (R, C) ->
    (low nibbles, high nibbles), each (R, C) fp16 holding deq() * 2**-14 exactly."""
    w = data.to(tl.uint16)
    lo = ((w & 0x7) << 9) | ((w & 0x8) << 12)  # element 2i: e2m1 * 2**-14 as fp16 bits
    hi = ((w & 0x70) << 5) | ((w & 0x80) << 8)  # element 2i+1
    return lo.to(tl.float16, bitcast=True) * scale, hi.to(tl.float16, bitcast=True) * scale


@triton.jit
def expand_scales(s, R: tl.constexpr, BK: tl.constexpr):
    """(R, BK/16) per-block values -> (R, BK/2): byte i (elements 2i, 2i+1) takes block i // 8."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (R, BK // 16, 8)), (R, BK // 2))


@triton.jit
def gemm_alpha(a_amax_ptr, b_amax_ptr, g):
    """alpha_g = (A_a,g * A_b,g) / 2688**2, one IEEE division (numerics.gemm_alpha)."""
    product = tl.load(a_amax_ptr + g) * tl.load(b_amax_ptr + g)
    return tl.math.div_rn(product, tl.zeros_like(product) + _ALPHA_DIVISOR)


@triton.jit
def store_bf16(ptrs, acc, alpha, mask):
    """bf16((acc * 2**28) * alpha) with integer RNE (the interpreter's bf16 cast truncates)."""
    y = bf16_round((acc * _UNSCALE) * alpha)
    bits = (y.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
    tl.store(ptrs, bits.to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def tile_table(sizes_ptr, N, G, BLOCK_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The persistent schedule's tile table of all groups, from the (G,) group sizes on the
    device: group g owns cdiv(m_g, BM) * cdiv(N, BN) tiles. Returns (gi, sizes, m_tiles,
    n_tiles, tile_end, row_end, total) for ``tile_coords``."""
    gi = tl.arange(0, BLOCK_G)
    sizes = tl.load(sizes_ptr + gi, mask=gi < G, other=0).to(tl.int32)
    m_tiles = tl.cdiv(sizes, BM)
    n_tiles = tl.cdiv(N, BN)
    tile_end = tl.cumsum(m_tiles * n_tiles, 0)
    row_end = tl.cumsum(sizes, 0)
    total = tl.max(tile_end, 0)
    return gi, sizes, m_tiles, n_tiles, tile_end, row_end, total


@triton.jit
def tile_coords(tile, gi, sizes, m_tiles, n_tiles, tile_end, row_end):
    """tile -> (group g, M tile tm, N tile tn, group size, group's first row); M fastest."""
    g = tl.sum((tile_end <= tile).to(tl.int32), 0)
    sel = gi == g
    tile0 = tl.sum(tl.where(sel, tile_end - m_tiles * n_tiles, 0), 0)
    mt = tl.sum(tl.where(sel, m_tiles, 0), 0)
    size = tl.sum(tl.where(sel, sizes, 0), 0)
    row0 = tl.sum(tl.where(sel, row_end - sizes, 0), 0)
    local = tile - tile0
    return g, local % mt, local // mt, size, row0


@triton.jit
def _load_deq(a_ptrs, b_ptrs, as_ptrs, bs_ptrs, row_ok, col_ok, kh, kb, k0, K2, K16,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Load one K step of both operands (masked past K: zeros) and dequantize it."""
    kh_ok = (k0 // 2 + kh) < K2
    kb_ok = (k0 // 16 + kb) < K16
    a = tl.load(a_ptrs, mask=row_ok[:, None] & kh_ok[None, :], other=0)
    b = tl.load(b_ptrs, mask=col_ok[:, None] & kh_ok[None, :], other=0)
    sa = tl.load(as_ptrs, mask=row_ok[:, None] & kb_ok[None, :], other=0)
    sb = tl.load(bs_ptrs, mask=col_ok[:, None] & kb_ok[None, :], other=0)
    a_lo, a_hi = deq_nibbles(a, expand_scales(scale_fp16(sa), BM, BK))
    b_lo, b_hi = deq_nibbles(b, expand_scales(scale_fp16(sb), BN, BK))
    return a_lo, a_hi, b_lo, b_hi


# ---------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_scale_ptr, a_amax_ptr, b_ptr, b_scale_ptr, b_amax_ptr, sizes_ptr, out_ptr,
    N, K, G,
    BLOCK_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    gi, sizes, m_tiles, n_tiles, tile_end, row_end, total = tile_table(sizes_ptr, N, G, BLOCK_G, BM, BN)
    K2 = K // 2
    K16 = K // 16
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
        g, tm, tn, size, row0 = tile_coords(tile, gi, sizes, m_tiles, n_tiles, tile_end, row_end)
        rows = tm * BM + tl.arange(0, BM)
        cols = tn * BN + tl.arange(0, BN)
        row_ok = rows < size
        col_ok = cols < N
        arow = (row0 + rows).to(tl.int64)
        brow = g.to(tl.int64) * N + cols
        kh = tl.arange(0, BK // 2)
        kb = tl.arange(0, BK // 16)
        a_ptrs = a_ptr + arow[:, None] * K2 + kh[None, :]
        b_ptrs = b_ptr + brow[:, None] * K2 + kh[None, :]
        as_ptrs = a_scale_ptr + arow[:, None] * K16 + kb[None, :]
        bs_ptrs = b_scale_ptr + brow[:, None] * K16 + kb[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
            a_lo, a_hi, b_lo, b_hi = _load_deq(a_ptrs, b_ptrs, as_ptrs, bs_ptrs, row_ok, col_ok, kh, kb, k0, K2, K16, BM, BN, BK)
            acc = tl.dot(a_lo, tl.trans(b_lo), acc)
            acc = tl.dot(a_hi, tl.trans(b_hi), acc)
            a_ptrs += BK // 2
            b_ptrs += BK // 2
            as_ptrs += BK // 16
            bs_ptrs += BK // 16
        alpha = gemm_alpha(a_amax_ptr, b_amax_ptr, g)
        out_ptrs = out_ptr + arow[:, None] * N + cols[None, :]
        store_bf16(out_ptrs, acc, alpha, row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------
# Tile configuration (STYLE 13: a frozen choice tests and benchmarks can pin)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int  # output rows (tokens / N of wgrad) per tile
    block_n: int  # output columns per tile
    block_k: int  # K elements per step (block_k / 2 bytes), a multiple of 32
    num_warps: int
    num_stages: int
    num_programs: int  # persistent programs; 0 = one per SM (1 under the interpreter)


_OVERRIDE: dict[str, GemmConfig] = {}


def gemm_config(kind: str, device: torch.device) -> GemmConfig:
    """The tile config of `kind` ("fprop" or "wgrad"). None of these choices changes a
    result bit except block_k, which sets the K permutation (see the module docstring)."""
    if kind in _OVERRIDE:
        return _OVERRIDE[kind]
    if INTERPRET or device.type != "cuda":  # numpy: few, large programs; 2 exercise the stride
        return GemmConfig(32, 32, 64, 4, 1, 2)
    # fastest of benchmarks/grouped_gemm.py run 2 for fprop, dgrad and wgrad (H200)
    return GemmConfig(256, 128, 64, 8, 3, 0)


@contextlib.contextmanager
def pinned_configs(table: dict, **configs):
    """Pin entries of a kind -> tile-config `table` for a ``with`` block (tests, benchmarks)."""
    saved = dict(table)
    table.update(configs)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def override_config(**configs: GemmConfig):
    """``with override_config(fprop=GemmConfig(...), wgrad=...)``: pin tile configs."""
    return pinned_configs(_OVERRIDE, **configs)


def num_programs(cfg: GemmConfig, device: torch.device) -> int:
    if cfg.num_programs:
        return cfg.num_programs
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


# ---------------------------------------------------------------------------------------
# Op and launcher


@kernel_op("nvfp4_kernels::grouped_gemm")
def _grouped_gemm_op(
    a_data: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
    b_data: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor,
    group_sizes: torch.Tensor,
) -> torch.Tensor:
    """Scales as uint8 bits; every tensor contiguous. Returns (T, N) bf16."""
    tokens = a_data.shape[0]
    groups, n, half = b_data.shape
    out = a_data.new_empty(tokens, n, dtype=torch.bfloat16)
    if tokens == 0 or n == 0:
        return out
    if half == 0 or groups == 0:
        return out.zero_()
    cfg = gemm_config("fprop", a_data.device)
    programs = num_programs(cfg, a_data.device)
    launch(
        _grouped_gemm_kernel, (programs,),
        a_ptr=a_data, a_scale_ptr=a_scale, a_amax_ptr=a_amax, b_ptr=b_data, b_scale_ptr=b_scale,
        b_amax_ptr=b_amax, sizes_ptr=group_sizes, out_ptr=out, N=n, K=2 * half, G=groups,
        BLOCK_G=max(next_power_of_2(groups), 2), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        NUM_PROGRAMS=programs, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )
    return out


def _bits(scale: torch.Tensor) -> torch.Tensor:
    return (scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale).contiguous()


def check_gemm_operands(name, a_data, a_scale, b_data, b_scale, group_sizes) -> None:
    """The operand rules of every fprop/dgrad-shaped GEMM (plain, bf16-path and fused)."""
    if a_data.dim() != 2 or b_data.dim() != 3:
        raise ValueError(f"{name}: a_data must be (T, K/2) and b_data (G, N, K/2), got "
                         f"{tuple(a_data.shape)} and {tuple(b_data.shape)}")
    groups, n, half = b_data.shape
    if a_data.shape[1] != half or (2 * half) % 16:
        raise ValueError(f"{name}: K/2 of a ({a_data.shape[1]}) and b ({half}) must match, K % 16 == 0")
    if a_scale.shape != (a_data.shape[0], half // 8) or b_scale.shape != (groups, n, half // 8):
        raise ValueError(f"{name}: scales must be (T, K/16) and (G, N, K/16), got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    if group_sizes.shape != (groups,):
        raise ValueError(f"{name}: group_sizes must be ({groups},), got {tuple(group_sizes.shape)}")


def grouped_gemm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_amax: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    b_amax: torch.Tensor,
    group_sizes: torch.Tensor,
) -> torch.Tensor:
    """fprop / dgrad, the twin of ``numerics.grouped_gemm_torch``: a (T, K/2) uint8,
    (T, K/16) E4M3, amax (G,); b (G, N, K/2), (G, N, K/16), amax (G,); group sizes (G,) int
    on the device (any non-negative sizes summing to T). Returns (T, N) bf16."""
    check_gemm_operands("grouped_gemm", a_data, a_scale, b_data, b_scale, group_sizes)
    return _grouped_gemm_op(
        a_data.contiguous(), _bits(a_scale), a_amax.float().contiguous(),
        b_data.contiguous(), _bits(b_scale), b_amax.float().contiguous(), group_sizes.contiguous(),
    )
