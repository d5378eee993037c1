"""Pieces shared by the grouped GEMM kernels (grouped_gemm_bf16.py, grouped_gemm_fp4.py,
grouped_gemm_act.py, grouped_gemm_dact.py): the persistent schedules, the alpha epilogue,
the plain GEMM launchers' output and exits (``grouped_gemm_out``), the operand checks.

Schedules. A persistent grid (``num_programs``: one program per SM on CUDA) walks the
output tiles, M fastest (consecutive programs share b's N tile); fprop-shaped kernels in
bands of ``Bf16GemmConfig.band_m`` M tiles, so the programs running at once share a few
of a's M tiles and many of b's N tiles, which then stay in L2.
* fprop/dgrad (``tile_table`` / ``tile_coords``): group g owns cdiv(m_g, BM) * cdiv(N, BN)
  tiles; each program computes the tile prefix sums from the (G,) group sizes on the
  device (no host sync, one launch for any routing); empty groups own no tiles.
* wgrad (``wgrad_tile``): every group owns the same cdiv(N, BN) * cdiv(M, BM) tiles, so
  tile -> (group, tile) is a division; a tile's K range is its group's padded tokens.

Epilogue (``gemm_out_bits`` / ``store_bf16``): out = bf16(acc * alpha_g) with integer
round-to-nearest-even (the interpreter's bf16 cast truncates), alpha_g =
A_a,g * A_b,g / 2688**2 as ``numerics.gemm_alpha`` computes it (one IEEE division).
(Until the in-register dequant GEMMs were removed it was bf16((acc * 2**28) * alpha_g), the
bf16-operand kernels passing acc * 2**-28; both multiplies were exact -- a non-zero acc of
deq() products is at least 2**-20 in magnitude, far from fp32's subnormals -- so dropping
them changed no bit.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import BLOCK, GEMM_ALPHA_DIVISOR
from ..formats import is_deq_values
from ..sizes import is_zero
from ._nvfp4 import bf16_round

_ALPHA_DIVISOR: tl.constexpr = tl.constexpr(GEMM_ALPHA_DIVISOR)  # 2688**2, exact in fp32


# ---------------------------------------------------------------------------------------
# Epilogue


@triton.jit
def gemm_alpha(a_amax_ptr, b_amax_ptr, g):
    """alpha_g = (A_a,g * A_b,g) / 2688**2, one IEEE division (numerics.gemm_alpha)."""
    product = tl.load(a_amax_ptr + g) * tl.load(b_amax_ptr + g)
    return tl.math.div_rn(product, tl.zeros_like(product) + _ALPHA_DIVISOR)


@triton.jit
def gemm_out_bits(acc, alpha):
    """bf16(acc * alpha) as uint16 bits, round to nearest even (``_nvfp4.bf16_round``)."""
    y = bf16_round(acc * alpha)
    return (y.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)


@triton.jit
def store_bf16(ptrs, acc, alpha, mask):
    """Store bf16(acc * alpha) (``gemm_out_bits``)."""
    tl.store(ptrs, gemm_out_bits(acc, alpha).to(tl.bfloat16, bitcast=True), mask=mask)


# ---------------------------------------------------------------------------------------
# Schedules


@triton.jit
def tile_table(sizes, N, G, BLOCK_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The persistent schedule's tile table of all groups, from the group sizes on the
    device ((BLOCK_G,), zeros past G, loaded by the kernel itself: ``_nvfp4.load_token``
    says why): group g owns cdiv(m_g, BM) * cdiv(N, BN) tiles. Returns (gi, sizes,
    m_tiles, n_tiles, tile_end, row_end, total) for ``tile_coords``."""
    gi = tl.arange(0, BLOCK_G)
    sizes = sizes.to(tl.int32)
    m_tiles = tl.cdiv(sizes, BM)
    n_tiles = tl.cdiv(N, BN)
    tile_end = tl.cumsum(m_tiles * n_tiles, 0)
    row_end = tl.cumsum(sizes, 0)
    total = tl.max(tile_end, 0)
    return gi, sizes, m_tiles, n_tiles, tile_end, row_end, total


@triton.jit
def tile_coords(tile, gi, sizes, m_tiles, n_tiles, tile_end, row_end, BAND: tl.constexpr):
    """tile -> (group g, M tile tm, N tile tn, group size, group's first row). Within a
    group, M fastest over bands of BAND M tiles (0: the group's whole M): band by band,
    each band's N tiles in turn."""
    g = tl.sum((tile_end <= tile).to(tl.int32), 0)
    sel = gi == g
    tile0 = tl.sum(tl.where(sel, tile_end - m_tiles * n_tiles, 0), 0)
    mt = tl.sum(tl.where(sel, m_tiles, 0), 0)
    size = tl.sum(tl.where(sel, sizes, 0), 0)
    row0 = tl.sum(tl.where(sel, row_end - sizes, 0), 0)
    local = tile - tile0
    if BAND == 0:
        return g, local % mt, local // mt, size, row0
    first = local // (BAND * n_tiles) * BAND  # the band's first M tile
    in_band = local % (BAND * n_tiles)
    rows = tl.minimum(mt - first, BAND)  # the last band may be short
    return g, first + in_band % rows, in_band // rows, size, row0


@triton.jit
def wgrad_tile(tile, N, M, BN: tl.constexpr, BM: tl.constexpr):
    """tile -> (group g, M tile tm, N tile tn): every group owns cdiv(N, BN) * cdiv(M, BM)
    tiles, M fastest. (The kernel loads g's K range itself: ``_nvfp4.load_token`` says why.)"""
    m_tiles = tl.cdiv(M, BM)
    per_group = tl.cdiv(N, BN) * m_tiles
    g = tile // per_group
    local = tile % per_group
    return g, local % m_tiles, local // m_tiles


def num_programs(cfg, device: torch.device) -> int:
    """Persistent programs of a launch: ``cfg.num_programs``, or one per SM (1 off CUDA)."""
    if cfg.num_programs:
        return cfg.num_programs
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def grouped_gemm_out(like: torch.Tensor, shape: tuple, k, groups: int, config, kind: str):
    """The bf16 output of a plain grouped GEMM (the bf16 and FP4 launchers, fprop and
    wgrad) of `shape`, each entry a sum over `k` in one of `groups` groups, on `like`'s
    device, and its launch's tiles: -> (out, cfg, programs), where ``cfg = config(kind,
    device)`` and ``programs = num_programs(cfg, device)``; (out, None, 0) when no launch is
    needed: out empty (left as allocated), or every entry an empty sum (K or G 0: zeros).
    The sizes are asked with ``sizes.is_zero``, which takes no guard on a data-dependent one."""
    out = like.new_empty(shape, dtype=torch.bfloat16)
    if any(is_zero(size) for size in shape):
        return out, None, 0
    if is_zero(k) or groups == 0:
        return out.zero_(), None, 0
    cfg = config(kind, out.device)
    return out, cfg, num_programs(cfg, out.device)


# ---------------------------------------------------------------------------------------
# Operand checks of the NVFP4 entry points


def _width(data) -> int:
    """The logical width of an operand: packed uint8 (..., C/2), or deq() values bf16 (..., C)."""
    return data.shape[-1] if is_deq_values(data) else 2 * data.shape[-1]


def _check_scale(name, which, data, scale) -> None:
    """A packed operand's scale is (..., C/16); a deq() operand's is not read."""
    if not is_deq_values(data) and scale.shape != (*data.shape[:-1], _width(data) // BLOCK):
        raise ValueError(f"{name}: {which}'s scale must be {(*data.shape[:-1], _width(data) // BLOCK)}, "
                         f"got {tuple(scale.shape)}")


def check_gemm_operands(name, a_data, a_scale, b_data, b_scale, group_sizes) -> None:
    """The operand rules of every fprop/dgrad-shaped GEMM (plain and fused); either operand
    may be packed or its deq() values (``formats.operand_values``)."""
    if a_data.dim() != 2 or b_data.dim() != 3:
        raise ValueError(f"{name}: a_data must be (T, K/2) and b_data (G, N, K/2), got "
                         f"{tuple(a_data.shape)} and {tuple(b_data.shape)}")
    groups = b_data.shape[0]
    if _width(a_data) != _width(b_data) or _width(b_data) % BLOCK:
        raise ValueError(f"{name}: K of a ({_width(a_data)}) and b ({_width(b_data)}) must match (data K/2 bytes "
                         f"packed, K bf16 values as deq()), K % 16 == 0")
    _check_scale(name, "a", a_data, a_scale)
    _check_scale(name, "b", b_data, b_scale)
    if group_sizes.shape != (groups,):
        raise ValueError(f"{name}: group_sizes must be ({groups},), got {tuple(group_sizes.shape)}")


def check_wgrad_operands(name, a_data, a_scale, b_data, b_scale, padded_offsets) -> None:
    """The operand rules of every wgrad-shaped GEMM."""
    if a_data.dim() != 2 or b_data.dim() != 2 or a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"{name}: a_data (N, P/2) and b_data (M, P/2) must share P, got "
                         f"{tuple(a_data.shape)} and {tuple(b_data.shape)}")
    half = a_data.shape[1]
    blocks = 2 * half // BLOCK
    if (2 * half) % BLOCK or a_scale.shape != (a_data.shape[0], blocks) or b_scale.shape != (b_data.shape[0], blocks):
        raise ValueError(f"{name}: scales must be (N, P/16) and (M, P/16) with P % 16 == 0, got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)} for P = {2 * half}")
    if padded_offsets.dim() != 1 or padded_offsets.shape[0] < 1:
        raise ValueError(f"{name}: padded_offsets must be (G+1,), got {tuple(padded_offsets.shape)}")
