"""Layout adapters between this package's NVFP4 tensors and the cuDNN frontend's grouped
GEMM wrappers (SM100): pure tensor functions, no frontend import, exact round trips.

Our side (docs/numerics.md 1 and 5): row-wise data (rows, K/2) uint8, two E2M1 codes per
byte (even element in the low nibble); block scales (rows, K/16) uint8 E4M3 bits, plain
row-major; tokens back to back by expert; per-expert weight stacks (G, N, K/2); SwiGLU's W1
rows [gate (F) | up (F)]; one fp32 amax per group or expert.

The wrappers' side (cudnn-frontend 1.32, contiguous M-grouped form):

* ``padded_offsets``: (G,) int32 cumulative *ends* of expert row blocks, each a multiple
  of ``m_aligned`` = 256; A has exactly ``padded_offsets[-1]`` rows. Our buffers are sized
  from shapes alone (no host read of the group sizes), so the last expert's block takes the
  slack up to the static capacity ``round_up(T + 255 G, 256)``; its extra rows are zeros
  with prob 0 (a compute cost of at most 255 G rows, no numerical effect).
* Scale factors in the 128x4 tile layout (cuBLAS "block scaling factors layout"): a
  contiguous (L, ceil(MN/128), ceil(SFK/4), 32, 4, 4) buffer, element (l, r, k) at
  [l, r // 128, k // 4, r % 32, (r // 32) % 4, k % 4]; the legacy kernel-facing view is
  ``.permute(3, 4, 1, 5, 2, 0)``. Padding rows / columns are zero scales.
  torch's ``SWIZZLE_32_4_4`` (``scaled_mm`` / ``scaled_grouped_mm``) is the same bytes,
  flattened.
* SwiGLU: gate and up rows of W1 (columns of C) alternate in 32-blocks
  [gate 0..31 | up 0..31 | gate 32..63 | up 32..63 | ...]; D comes back in natural order.
* alpha (G,) fp32 per expert: our ``numerics.gemm_alpha`` (A_a A_b / 2688^2). The dGLU
  kernels apply alpha to both sides (alpha^2 on the product), so they get
  sqrt(A_a A_b) / 2688 (docs/numerics.md 7: a contract difference, not bitwise).
* prob: (rows, 1, 1) fp32, zeros on padding rows.
* wgrad (``grouped_gemm_wgrad_wrapper_sm100``): A (M, tokens) and B (tokens, N), both
  token-major (B a transposed view), experts' tokens back to back at the (G,) int32
  ``offsets_tensor`` ends, here 256-aligned as for the row wrappers (our column-wise copies
  are 16-aligned: ``wgrad_layout`` moves each expert's 16-token blocks, RHT-mixed tail
  included, and the last expert takes the slack). Scale factors: each expert's
  (rows, tokens_e / 16) block in the 128x4 tile layout, experts back to back, expert e's
  from element round_up(rows, 128) * token_offset_e / 16 (the kernel's per-expert
  descriptor; the frontend tests' ``_wgrad_assemble_scales_2d2d``), viewed as
  (round_up(rows, 128), tokens / 16). ``global_scale_a * global_scale_b`` (fp32) multiplies
  the accumulator: (alpha, 1) gives our alpha exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..constants import BLOCK, FP4_E4M3_MAX
from ..numerics import gemm_alpha

M_ALIGNED = 256
SF_TILE_ROWS = 128
SF_TILE_COLS = 4
GLU_INTERLEAVE = 32


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------
# Expert row padding


def padded_capacity(tokens: int, groups: int, m_aligned: int = M_ALIGNED) -> int:
    """Rows of a padded A buffer, from shapes alone: every expert rounded up to m_aligned."""
    return _ceil(tokens + (m_aligned - 1) * groups, m_aligned) * m_aligned if groups else 0


def padded_offsets(group_sizes: torch.Tensor, tokens: int, m_aligned: int = M_ALIGNED) -> torch.Tensor:
    """The wrappers' ``padded_offsets``: (G,) int32 cumulative ends of each expert's block
    (sizes rounded up to m_aligned); the last end is the static capacity (slack to the last
    expert). Device-side, no host read."""
    sizes = group_sizes.to(torch.int64)
    ends = torch.cumsum((sizes + m_aligned - 1) // m_aligned * m_aligned, 0)
    if ends.numel():
        ends[-1] = padded_capacity(tokens, sizes.numel(), m_aligned)
    return ends.to(torch.int32)


def padded_rows(group_sizes: torch.Tensor, tokens: int, m_aligned: int = M_ALIGNED) -> torch.Tensor:
    """(T,) int64: where token row t sits in the padded layout."""
    sizes = group_sizes.to(torch.int64)
    ends = torch.cumsum(sizes, 0)
    starts = ends - sizes
    padded_ends = torch.cumsum((sizes + m_aligned - 1) // m_aligned * m_aligned, 0)
    padded_starts = padded_ends - (sizes + m_aligned - 1) // m_aligned * m_aligned
    rows = torch.arange(tokens, device=sizes.device)
    group = torch.searchsorted(ends, rows, right=True).clamp(max=max(sizes.numel() - 1, 0))
    return padded_starts[group] + rows - starts[group]


def pad_rows(x: torch.Tensor, rows: torch.Tensor, capacity: int, fill=0) -> torch.Tensor:
    """(T, ...) -> (capacity, ...): row t at rows[t], `fill` elsewhere."""
    out = x.new_full((capacity, *x.shape[1:]), fill)
    return out.index_copy(0, rows, x)


def unpad_rows(y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(capacity, ...) -> (T, ...): the inverse of ``pad_rows``."""
    return y.index_select(0, rows)


def prob_view(probs: Optional[torch.Tensor], rows: torch.Tensor, capacity: int) -> torch.Tensor:
    """The wrappers' prob_tensor: (capacity, 1, 1) fp32; ones for real rows without
    probs, zeros on padding rows."""
    p = torch.ones(rows.numel(), dtype=torch.float32, device=rows.device) if probs is None else probs.float()
    return pad_rows(p, rows, capacity).view(capacity, 1, 1)


# ---------------------------------------------------------------------------------------
# Scale factors: 128x4 tiles


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """(L, MN, SFK) or (MN, SFK) plain scales -> contiguous (L, ceil(MN/128), ceil(SFK/4),
    32, 4, 4) in the 128x4 tile layout (zeros where MN or SFK is padded)."""
    if scale.dim() == 2:
        scale = scale.unsqueeze(0)
    lead, mn, sfk = scale.shape
    rm, rk = _ceil(mn, SF_TILE_ROWS), _ceil(sfk, SF_TILE_COLS)
    padded = scale.new_zeros(lead, rm * SF_TILE_ROWS, rk * SF_TILE_COLS)
    padded[:, :mn, :sfk] = scale
    # rows r = (rm, 4, 32) as (r // 128, (r // 32) % 4, r % 32); columns k = (rk, 4)
    tiles = padded.view(lead, rm, 4, 32, rk, 4)
    return tiles.permute(0, 1, 4, 3, 2, 5).contiguous()


def unswizzle_scales(tiled: torch.Tensor, mn: int, sfk: int) -> torch.Tensor:
    """The inverse of ``swizzle_scales``: (L, MN, SFK)."""
    lead, rm, rk = tiled.shape[:3]
    plain = tiled.permute(0, 1, 4, 3, 2, 5).reshape(lead, rm * SF_TILE_ROWS, rk * SF_TILE_COLS)
    return plain[:, :mn, :sfk]


def kernel_view(tiled: torch.Tensor) -> torch.Tensor:
    """The legacy kernel-facing 6-D view (32, 4, rm, 4, rk, L) of a swizzled buffer."""
    return tiled.permute(3, 4, 1, 5, 2, 0)


def torch_blocked_scales(scale: torch.Tensor) -> torch.Tensor:
    """A (MN, SFK) scale matrix in torch's SWIZZLE_32_4_4 form: the 128x4 tile bytes, flat."""
    return swizzle_scales(scale).reshape(-1)


# ---------------------------------------------------------------------------------------
# SwiGLU gate/up interleave


def interleave_glu(w: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """[gate (F) | up (F)] along `dim` -> 32-blocks [gate_0 | up_0 | gate_1 | up_1 | ...]."""
    dim = dim % w.dim()
    two_f = w.shape[dim]
    if two_f % (2 * GLU_INTERLEAVE):
        raise ValueError(f"GLU interleave needs 2F % {2 * GLU_INTERLEAVE} == 0, got 2F = {two_f}")
    blocks = two_f // (2 * GLU_INTERLEAVE)
    split = w.reshape(*w.shape[:dim], 2, blocks, GLU_INTERLEAVE, *w.shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(w.shape)


def deinterleave_glu(w: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The inverse of ``interleave_glu``."""
    dim = dim % w.dim()
    blocks = w.shape[dim] // (2 * GLU_INTERLEAVE)
    split = w.reshape(*w.shape[:dim], blocks, 2, GLU_INTERLEAVE, *w.shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(w.shape)


# ---------------------------------------------------------------------------------------
# Per-expert scales


def alpha(a_amax: torch.Tensor, b_amax: torch.Tensor) -> torch.Tensor:
    """(G,) fp32 alpha for the wrappers that apply it once: exactly ``numerics.gemm_alpha``."""
    return gemm_alpha(a_amax, b_amax)


def dglu_alpha(a_amax: torch.Tensor, b_amax: torch.Tensor) -> torch.Tensor:
    """(G,) fp32 alpha for the dGLU wrappers, which apply it to both operand sides:
    sqrt(A_a A_b) / 2688, so alpha^2 ~ gemm_alpha (not bitwise)."""
    product = a_amax.float() * b_amax.float()
    return torch.sqrt(product) / torch.full_like(product, FP4_E4M3_MAX)


# ---------------------------------------------------------------------------------------
# Operands


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn / float4_e2m1fn_x2 storage as uint8 (CPU index ops do not take them)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def fp4_view(data: torch.Tensor) -> torch.Tensor:
    """uint8 packed E2M1 (even element in the low nibble) as torch.float4_e2m1fn_x2."""
    return data.view(torch.float4_e2m1fn_x2)


def e4m3_view(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bits as torch.float8_e4m3fn (no conversion)."""
    return _bytes(scale).view(torch.float8_e4m3fn)


def batch_view(t: torch.Tensor) -> torch.Tensor:
    """(M, N) row-major -> the wrappers' (M, N, L=1) view with the batch stride a contiguous
    (L, M, N) tensor has: strides (N, 1, M*N). ``t.unsqueeze(-1)`` would give (N, 1, 1): the
    wrappers that read their tensors' strides as given (the Hadamard fc1 and the dGLU, which
    describe A and C without canonical strides) reject that as not k-major / n-major."""
    return t.unsqueeze(0).permute(1, 2, 0)


def activation_operand(data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, capacity: int):
    """A row-wise grouped copy (T, K/2), (T, K/16) -> the wrappers' a_tensor (capacity, K/2)
    float4_e2m1fn_x2 and sfa_tensor (1, capacity/128, ceil(K/64), 32, 4, 4) float8_e4m3fn;
    padding rows are zero codes with zero scales."""
    a = pad_rows(_bytes(data), rows, capacity)
    sfa = swizzle_scales(pad_rows(_bytes(scale), rows, capacity))
    return fp4_view(a), e4m3_view(sfa)


def weight_operand(data: torch.Tensor, scale: torch.Tensor, glu: bool = False):
    """A per-expert copy (G, N, K/2), (G, N, K/16) -> b_tensor (G, N, K/2) and sfb_tensor
    (G, ceil(N/128), ceil(K/64), 32, 4, 4); SwiGLU's rows interleaved in 32-blocks."""
    data, scale = _bytes(data), _bytes(scale)
    if glu:
        data, scale = interleave_glu(data), interleave_glu(scale)
    return fp4_view(data.contiguous()), e4m3_view(swizzle_scales(scale))


# ---------------------------------------------------------------------------------------
# Wgrad operands: column-wise (token-major) grouped copies


def wgrad_layout(offsets: torch.Tensor, tokens: int):
    """Our column-wise copies' (G+1,) 16-aligned offsets over `tokens` (P) columns ->
    (where each of our P/16 token blocks goes, the wrapper's token capacity, its (G,) int32
    ``offsets_tensor``: each expert's tokens rounded up to 256, the last expert taking the
    slack up to a capacity from shapes alone). Blocks past the last group are zeros and
    land in that slack. Device-side, no host read."""
    aligned = M_ALIGNED // BLOCK
    blocks = torch.diff(offsets.to(torch.int64)) // BLOCK
    count = tokens // BLOCK
    rows = padded_rows(blocks, count, aligned)
    capacity = padded_capacity(count, blocks.numel(), aligned)
    return rows, capacity * BLOCK, padded_offsets(blocks, count, aligned) * BLOCK


def wgrad_operand(data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, capacity: int,
                  ends: torch.Tensor):
    """A column-wise grouped copy (K, P/2), (K, P/16) -> the wrapper's token-major operand
    (K, capacity/2) float4_e2m1fn_x2 (transpose it for B) and its scale factors
    (round_up(K, 128), capacity/16) float8_e4m3fn, per expert in the 128x4 tile layout."""
    k = data.shape[0]
    blocks = _bytes(data).view(k, -1, BLOCK // 2).transpose(0, 1)  # (P/16, K, 8): one 16-token block
    moved = pad_rows(blocks, rows, capacity // BLOCK).transpose(0, 1).reshape(k, capacity // 2)
    sf = pad_rows(_bytes(scale).t(), rows, capacity // BLOCK).t()
    return fp4_view(moved.contiguous()), e4m3_view(expert_tiled_scales(sf, ends))


def expert_tiled_scales(scale: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(MN, C) plain scales whose columns belong to the experts ending at token `ends`
    (each expert a multiple of 4 columns) -> (round_up(MN, 128), C): each expert's columns
    in the 128x4 tile layout (``swizzle_scales`` of its slice), experts back to back."""
    mn, cols = scale.shape
    rm = _ceil(mn, SF_TILE_ROWS)
    col_ends = ends.to(torch.int64) // BLOCK
    widths = torch.diff(col_ends, prepend=col_ends.new_zeros(1))
    col = torch.arange(cols, device=scale.device)
    expert = torch.searchsorted(col_ends, col, right=True).clamp(max=max(col_ends.numel() - 1, 0))
    start = col_ends[expert] - widths[expert]
    k, tiles_k = col - start, widths[expert] // SF_TILE_COLS
    r = torch.arange(rm * SF_TILE_ROWS, device=scale.device).unsqueeze(1)
    offset = (start * rm * SF_TILE_ROWS + ((r // SF_TILE_ROWS) * tiles_k + k // SF_TILE_COLS) * 512
              + (r % 32) * 16 + ((r // 32) % 4) * 4 + k % SF_TILE_COLS)
    padded = scale.new_zeros(rm * SF_TILE_ROWS, cols)
    padded[:mn] = scale
    out = scale.new_zeros(rm * SF_TILE_ROWS * cols)
    return out.index_put_((offset.reshape(-1),), padded.reshape(-1)).view(rm * SF_TILE_ROWS, cols)
