"""NVFP4 numerics in plain PyTorch: the reference every kernel is tested against.

This module is docs/numerics.md section 1-4 in code. It runs on CPU and CUDA tensors and needs
neither Triton nor a GPU. Load-bearing details (do not tidy them away):

Scale chain for a tensor or group with amax A, in fp32, in this order:
    S_enc = 2688 / A, min(S_enc, FLT_MAX); S_enc = 1 when A == 0
    S_dec = 1 / S_enc                                  (a true division)
    s     = e4m3_rne_sat(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX))
                                                       (multiply by fp32(1/6), never divide)
    enc   = min(1 / (float(s) * S_dec), FLT_MAX)       (divide by the product, not S_enc / s)
    code  = e2m1_round(clamp(x * enc, -6, 6))          (RNE, or stochastic for gradients)
  so an all-zero block has scale 0 and codes 0, a non-zero block whose scale underflows
  to 0 has enc = FLT_MAX and codes +-6 (still dequantizing to 0), and the block holding
  the amax gets scale 448.
Dequantize: (float(s) * A) * fp32(1/2688), then times the E2M1 value.

RHT of a run of 16 values v (column-wise copies only, along tokens):
    y = bf16(0.25 * FWHT(s * v))
  s = the signs of `sign_mask` (bit i set -> s_i = -1), FWHT = the natural-order
  (Sylvester) fast Walsh-Hadamard transform computed in fp32 as four butterfly stages
  of strides 1, 2, 4, 8, each mapping (a, b) -> (a + b, a - b). This pins the order of
  every fp32 addition, so kernels reproduce it bit for bit (a matmul against H would
  sum in an order each library picks for itself). The amax and the block quantization
  both read the bf16-rounded values.

Stochastic rounding: |v| on the grid {0, .5, 1, 1.5, 2, 3, 4, 6} between neighbours
lo < hi rounds up iff (|v| - lo) * 256 / (hi - lo) > r + 0.5, r one random byte (all
terms exact in fp32). The bytes come from Philox4x32-10 (Triton's ``tl.philox``):
key = the 64-bit seed, counter = (block index, stream, 0, 0) with stream 0 for the
row-wise copy and 1 for the column-wise copy; the 4 output words give the 16 bytes of
one 16-element block, element j taking byte j % 4 (little end first) of word j // 4.
One seed is drawn per quantize call, on the data's device from its default generator
(``draw_seed``: a device tensor, never a host int, so CUDA graphs replay fresh bits), and
``torch.manual_seed`` reproduces the bits in eager and compiled runs.
Under torch.distributed the ops fold the rank into the key's high word (``draw_seed``
with ``per_rank``: seed ^ (rank << 32)), so ranks seeded alike draw independent bits;
rank 0, and any run without torch.distributed, keeps the drawn seed.

Negative zero: an exact -0.0 input is coded 0 (+0); a negative value that rounds to
zero is coded 8 (-0). Both dequantize to 0.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed

from .constants import (
    BLOCK,
    E2M1_SIGN_BIT,
    E2M1_VALUES,
    FLT_MAX,
    FP4_E4M3_MAX,
    FP4_MAX,
    GEMM_ALPHA_DIVISOR,
    INV_FP4_MAX,
    PHILOX_KEY_A,
    PHILOX_KEY_B,
    PHILOX_ROUND_A,
    PHILOX_ROUND_B,
    PHILOX_ROUNDS,
    RHT_DEFAULT_SIGN_MASK,
    RHT_SCALE,
    SR_STREAM_COLUMNWISE,
    SR_STREAM_ROWWISE,
)
from .formats import block_values, e2m1_encode, e4m3_decode, e4m3_encode, operand_values, pack_fp4
from .tensor import NVFP4GroupedTensor, NVFP4Tensor, NVFP4WeightStack, Operand

_U32 = 0xFFFFFFFF
Seed = Union[int, torch.Tensor]  # a Philox seed: a host int, or a 0-d int64 tensor on the data's device

# ---------------------------------------------------------------------------------------
# Global and block scales


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = min(2688 / A, FLT_MAX), or 1 where A == 0 (fp32, same shape as amax)."""
    amax = amax.float()
    # tensor / tensor: one IEEE division. (A Python number over a tensor is computed as
    # reciprocal(A) * 2688, rounded twice.)
    s_enc = torch.clamp(torch.full_like(amax, FP4_E4M3_MAX) / amax, max=FLT_MAX)
    return torch.where(amax == 0, torch.ones_like(s_enc), s_enc)


def block_scales(block_amax: torch.Tensor, s_enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 decode scales (uint8 bits) and fp32 encode multipliers for blocks.

    block_amax: fp32 per block; s_enc: broadcastable fp32 global encode scale.
    """
    s = torch.clamp(block_amax * (s_enc * INV_FP4_MAX), max=FLT_MAX)
    bits = e4m3_encode(s)
    s_dec = 1.0 / s_enc
    enc = torch.clamp(1.0 / (e4m3_decode(bits) * s_dec), max=FLT_MAX)
    return bits, enc


# ---------------------------------------------------------------------------------------
# E2M1 rounding of scaled values


def e2m1_round_stochastic(v: torch.Tensor, rbytes: torch.Tensor) -> torch.Tensor:
    """v in [-6, 6] (fp32), rbytes uint8 of the same shape -> E2M1 codes (uint8)."""
    a = v.abs()
    lo_code = (
        (a >= 0.5).to(torch.uint8) + (a >= 1.0) + (a >= 1.5) + (a >= 2.0) + (a >= 3.0) + (a >= 4.0) + (a >= 6.0)
    )
    grid = torch.tensor(E2M1_VALUES + (FP4_MAX,), dtype=torch.float32, device=v.device)
    lo = grid[lo_code.long()]
    step = grid[lo_code.long() + 1] - lo  # 0 at |v| == 6, where (a - lo) is 0 too
    # (a - lo) is exact (Sterbenz: lo <= a <= 2 lo, or lo == 0); 256 / step is a power of 2
    scaled = (a - lo) * torch.where(step > 0, 256.0 / step, torch.zeros_like(step))
    up = scaled > rbytes.float() + 0.5
    code = lo_code + up.to(torch.uint8)
    return code | torch.where(v < 0, E2M1_SIGN_BIT, 0).to(torch.uint8)


# ---------------------------------------------------------------------------------------
# Philox4x32 (Triton's tl.philox), in int64 torch ops so every device draws the same bits


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b) >> 32 and (a * b) & 0xFFFFFFFF for a < 2**32, b uint32 held in int64,
    split in 16-bit halves of b so no product leaves int64's range."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # each < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _U32
    return hi, lo


def philox4x32(seed: Seed, c0: torch.Tensor, c1: int, c2: int = 0, c3: int = 0, rounds: int = PHILOX_ROUNDS):
    """Philox4x32 with key (seed low 32 bits, seed high 32 bits), counters c0 (a tensor of
    uint32 values in int64) and scalars c1..c3. Returns four int64 tensors of uint32 words,
    identical to ``tl.philox(seed, c0, c1, c2, c3, rounds)``. `seed` is an int or a 0-d int64
    tensor on c0's device (``draw_seed``); a tensor stays on the device (no host read)."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    x0 = c0.to(torch.int64) & _U32
    x1 = torch.full_like(x0, c1 & _U32)
    x2 = torch.full_like(x0, c2 & _U32)
    x3 = torch.full_like(x0, c3 & _U32)
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(PHILOX_ROUND_B, x2)
        hi_a, lo_a = _mul_hi_lo(PHILOX_ROUND_A, x0)
        x0, x1, x2, x3 = hi_b ^ x1 ^ k0, lo_b, hi_a ^ x3 ^ k1, lo_a
        k0, k1 = (k0 + PHILOX_KEY_A) & _U32, (k1 + PHILOX_KEY_B) & _U32
    return x0, x1, x2, x3


def sr_rank() -> int:
    """The global torch.distributed rank, 0 when torch.distributed is not initialised."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def draw_seed(device=None, per_rank: bool = False) -> torch.Tensor:
    """One 63-bit Philox seed: a 0-d int64 tensor on `device`, drawn by
    ``torch.randint`` from that device's default generator.

    On a GPU the draw is a kernel: nothing reaches the host, so there is no sync, and
    under CUDA-graph capture torch's generator records it with a device-side Philox offset
    that advances on every replay: each replay draws a fresh seed, exactly the seed an
    uncaptured step would draw from the same generator state. (A seed read on the host and
    written by a fill would be frozen into the graph: every replay would round alike.)

    per_rank (``Recipe.sr_per_rank``, the ops pass it): fold the torch.distributed rank
    into the high key word, ``seed ^ (rank << 32)`` -- the one place the rank enters the
    random bits. Ranks whose generators are seeded alike then draw independent streams
    (distinct Philox keys); rank 0 and runs without torch.distributed keep the drawn seed,
    so single-process numerics never depend on it. Ranks stay below 2**31, so the result
    is still a 63-bit seed."""
    seed = torch.randint(0, 2**63 - 1, (), dtype=torch.int64, device=device)
    rank = sr_rank() if per_rank else 0
    return seed ^ (rank << 32) if rank else seed  # rank 0: no fold, no extra launch


def require_seed(stochastic_rounding: bool, seed: Optional[Seed], name: str) -> None:
    """A quantizer's check that stochastic rounding comes with its seed: seeds are drawn in
    one place (``draw_seed``, called by the ``nvfp4::`` ops and ``nvfp4::draw_sr_seeds``),
    never by a quantizer itself, where ``sr_per_rank`` would not reach."""
    if stochastic_rounding and seed is None:
        raise ValueError(f"{name}: stochastic_rounding=True needs a seed (numerics.draw_seed draws one)")


def sr_random_bytes(seed: Seed, rows: int, cols: int, stream: int, device) -> torch.Tensor:
    """uint8 (rows, cols): the random byte of each element of a (rows, cols) matrix that is
    quantized in 1x16 blocks along cols (block index = row * cols/16 + col // 16)."""
    n_blocks = rows * (cols // BLOCK)
    if n_blocks >= 2**32:
        raise ValueError(f"stochastic rounding: {n_blocks} blocks exceed the 2**32 Philox counter range")
    words = philox4x32(seed, torch.arange(n_blocks, device=device), stream)
    w = torch.stack(words, dim=-1)  # (n_blocks, 4)
    shifts = torch.arange(0, 32, 8, device=device)
    rbytes = (w.unsqueeze(-1) >> shifts) & 0xFF  # (n_blocks, word, byte): element = 4*word + byte
    return rbytes.reshape(rows, cols).to(torch.uint8)


# ---------------------------------------------------------------------------------------
# Random Hadamard transform


def rht_signs(sign_mask: int, device=None) -> torch.Tensor:
    """The 16 signs (+-1.0, fp32) of a 16-bit mask: bit i set -> sign i is -1."""
    bits = (sign_mask >> torch.arange(16, device=device)) & 1
    return 1.0 - 2.0 * bits.float()


def hadamard16(device=None) -> torch.Tensor:
    """Natural-order Sylvester H16 (fp32): H[i][j] = (-1)^popcount(i & j)."""
    idx = torch.arange(16, device=device)
    anded = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(anded)
    for bit in range(4):
        parity ^= (anded >> bit) & 1
    return 1.0 - 2.0 * parity.float()


def rht_matrix(sign_mask: int, device=None) -> torch.Tensor:
    """R = diag(s) . H16 . 0.25 in bf16 (entries +-0.25 are exact); v . R is the RHT of v.
    For inspection and tests: the transform itself is computed by ``rht16`` in a pinned order."""
    return (rht_signs(sign_mask, device)[:, None] * hadamard16(device) * RHT_SCALE).to(torch.bfloat16)


def rht16(v: torch.Tensor, sign_mask: int) -> torch.Tensor:
    """RHT of each run of 16 along the last dim: bf16(0.25 * FWHT(s * v)), fp32 sums in the
    butterfly order of the module docstring. v: (..., 16n) any float dtype; returns bf16."""
    shape = v.shape
    y = v.float().reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK) * rht_signs(sign_mask, v.device)
    for stride in (1, 2, 4, 8):
        pairs = y.reshape(*y.shape[:-1], BLOCK // (2 * stride), 2, stride)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*y.shape)
    return (y * RHT_SCALE).to(torch.bfloat16).reshape(shape)


# ---------------------------------------------------------------------------------------
# Quantizing one matrix along its rows


def quantize_rows(
    q: torch.Tensor,
    amax: torch.Tensor,
    *,
    block_2d: bool = False,
    rbytes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize q (R, C) in 1x16 blocks along its rows (16x16 tiles when block_2d).

    amax: the global amax (fp32), broadcastable to the (R, C/16) blocks: a scalar, per
        row (R, 1) for row-wise grouped copies, per block column (1, C/16) for column-wise.
    rbytes: uint8 (R, C) random bytes for stochastic rounding, or None for RNE.
    Returns (data uint8 (R, C/2), scale float8_e4m3fn (R, C/16)).
    """
    rows, cols = q.shape
    x = q.float().reshape(rows, cols // BLOCK, BLOCK)
    block_amax = x.abs().amax(dim=-1)  # (R, C/16)
    if block_2d:
        tiles = block_amax.reshape(rows // BLOCK, BLOCK, cols // BLOCK).amax(dim=1, keepdim=True)
        block_amax = tiles.expand(-1, BLOCK, -1).reshape(rows, cols // BLOCK)
    bits, enc = block_scales(block_amax, global_encode_scale(amax))
    v = torch.clamp(x * enc.unsqueeze(-1), -FP4_MAX, FP4_MAX).reshape(rows, cols)
    codes = e2m1_encode(v) if rbytes is None else e2m1_round_stochastic(v, rbytes)
    return pack_fp4(codes).contiguous(), bits.contiguous().view(torch.float8_e4m3fn)


def _owned(amax: torch.Tensor) -> torch.Tensor:
    """A caller-supplied amax as a new fp32 tensor: outputs never alias inputs."""
    return amax.to(torch.float32, copy=True)


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 scalar (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().float()


# ---------------------------------------------------------------------------------------
# Public quantizers (reference twins of nvfp4_inductor.kernels.quantize / group_quantize)


def quantize_torch(
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
    seed: Optional[Seed] = None,
) -> NVFP4Tensor:
    """Quantize an (M, K) tensor (numerics.md 2-4). Arguments as ``nvfp4_inductor.quantize``;
    `seed` fixes the bits of stochastic rounding and is required with it (the ops draw it:
    ``draw_seed``, the one draw, which honours ``sr_per_rank``).
    Inputs are assumed valid (``nvfp4_inductor.validate`` checks them)."""
    require_seed(stochastic_rounding, seed, "quantize_torch")
    m, k = x.shape
    out = NVFP4Tensor(None, None, None, None, None, None)
    if rowwise:
        amax = amax_of(x) if rowwise_amax is None else _owned(rowwise_amax.reshape(()))
        rbytes = sr_random_bytes(seed, m, k, SR_STREAM_ROWWISE, x.device) if stochastic_rounding else None
        out.rowwise_data, out.rowwise_scale = quantize_rows(x, amax, block_2d=block_2d, rbytes=rbytes)
        out.rowwise_amax = amax
    if columnwise:
        xt = x.t()
        if rht:
            xt = rht16(xt, sign_mask)
        if columnwise_amax is not None:
            amax = _owned(columnwise_amax.reshape(()))
        elif rht or rowwise_amax is None:
            amax = amax_of(xt)
        else:  # without RHT the column-wise copy has the same amax as the row-wise one
            amax = _owned(rowwise_amax.reshape(()))
        rbytes = sr_random_bytes(seed, k, m, SR_STREAM_COLUMNWISE, x.device) if stochastic_rounding else None
        out.columnwise_data, out.columnwise_scale = quantize_rows(xt, amax, block_2d=block_2d, rbytes=rbytes)
        out.columnwise_amax = amax
    return out


def columnwise_capacity(tokens: int, groups: int) -> int:
    """Tokens of room in a grouped column-wise copy: every group padded to 16, rounded."""
    return -(-(tokens + (BLOCK - 1) * groups) // BLOCK) * BLOCK


def group_layout(group_sizes: torch.Tensor, tokens: int):
    """Device-side layout of a grouped tensor, with no host reads.

    Returns (group_of_row (T,), padded_row (T,): where each token sits in the padded
    column-wise layout, padded_offsets (G+1,) int64, group_of_padded_row (P,)).
    """
    sizes = group_sizes.to(torch.int64)
    groups = sizes.numel()
    device = sizes.device
    ends = torch.cumsum(sizes, 0)
    rows = torch.arange(tokens, device=device)
    group_of_row = torch.searchsorted(ends, rows, right=True).clamp(max=max(groups - 1, 0))
    padded = (sizes + BLOCK - 1) // BLOCK * BLOCK
    padded_offsets = torch.cat((torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(padded, 0)))
    starts = ends - sizes
    padded_row = padded_offsets[group_of_row] + (rows - starts[group_of_row])
    capacity = columnwise_capacity(tokens, groups)
    group_of_padded_row = torch.searchsorted(
        padded_offsets[1:], torch.arange(capacity, device=device), right=True
    ).clamp(max=max(groups - 1, 0))
    return group_of_row, padded_row, padded_offsets, group_of_padded_row


def group_amax(values: torch.Tensor, group_of_row: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-group max |values| over rows (fp32 (G,), 0 for an empty group)."""
    row_amax = values.abs().amax(dim=1).float() if values.shape[1] else values.new_zeros(values.shape[0]).float()
    out = torch.zeros(groups, dtype=torch.float32, device=values.device)
    return out.scatter_reduce(0, group_of_row, row_amax, reduce="amax", include_self=True)


def pad_groups(x: torch.Tensor, padded_row: torch.Tensor, capacity: int) -> torch.Tensor:
    """(T, K) -> (P, K): each group's rows at its padded offset, zeros elsewhere."""
    out = x.new_zeros(capacity, x.shape[1])
    return out.index_copy(0, padded_row, x)


def group_quantize_torch(
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
    seed: Optional[Seed] = None,
) -> NVFP4GroupedTensor:
    """Quantize a (T, K) tensor of G row groups, each with its own amaxes (numerics.md 4).
    Arguments as ``nvfp4_inductor.group_quantize`` (block_2d is accepted for symmetry but
    groups of tokens are never 2D-quantized: it is rejected by validation)."""
    require_seed(stochastic_rounding, seed, "group_quantize_torch")
    tokens, k = x.shape
    groups = group_sizes.numel()
    group_of_row, padded_row, padded_offsets, group_of_padded_row = group_layout(group_sizes, tokens)
    out = NVFP4GroupedTensor(None, None, None, None, None, None, padded_offsets, group_sizes.to(torch.int64))
    if rowwise:
        amax = group_amax(x, group_of_row, groups) if rowwise_amax is None else _owned(rowwise_amax)
        rbytes = sr_random_bytes(seed, tokens, k, SR_STREAM_ROWWISE, x.device) if stochastic_rounding else None
        out.rowwise_data, out.rowwise_scale = quantize_rows(
            x, amax[group_of_row].unsqueeze(1), rbytes=rbytes
        )
        out.rowwise_amax = amax
    if columnwise:
        capacity = columnwise_capacity(tokens, groups)
        xt = pad_groups(x, padded_row, capacity).t()  # (K, P); runs of 16 never straddle groups
        if rht:
            xt = rht16(xt, sign_mask)
        if columnwise_amax is not None:
            amax = _owned(columnwise_amax)
        elif rht or rowwise_amax is None:
            amax = group_amax(xt.t(), group_of_padded_row, groups)
        else:
            amax = _owned(rowwise_amax)
        rbytes = sr_random_bytes(seed, k, capacity, SR_STREAM_COLUMNWISE, x.device) if stochastic_rounding else None
        out.columnwise_data, out.columnwise_scale = quantize_rows(
            xt, amax[group_of_padded_row[::BLOCK]].unsqueeze(0), rbytes=rbytes
        )
        out.columnwise_amax = amax
    return out


def copy_amaxes(pre_rht: torch.Tensor, post_rht: torch.Tensor, rht: bool):
    """(row-wise, column-wise) amaxes of a tensor's two copies, from its pre- and post-RHT
    amaxes: the column-wise copy reads the post-RHT one only where it is transformed (what
    the quantizers compute themselves; numerics.md 6 rule 2 for D's casts)."""
    return pre_rht, post_rht if rht else pre_rht


def group_hadamard_amax_torch(x: torch.Tensor, group_sizes: torch.Tensor, sign_mask: int):
    """Per-group (pre-RHT amax, post-RHT amax) of a (T, K) bf16 tensor: exactly the amaxes
    ``group_quantize_torch`` computes for its row-wise and column-wise RHT copies."""
    tokens = x.shape[0]
    groups = group_sizes.numel()
    group_of_row, padded_row, _, group_of_padded_row = group_layout(group_sizes, tokens)
    padded = pad_groups(x, padded_row, columnwise_capacity(tokens, groups))
    post = group_amax(rht16(padded.t(), sign_mask).t(), group_of_padded_row, groups)
    return group_amax(x, group_of_row, groups), post


def quantize_weights_torch(w: torch.Tensor, *, block_2d: bool = True) -> NVFP4WeightStack:
    """Quantize a (G, N, K) expert weight stack per expert: row-wise (G, N, K/2) and the
    column-wise copy of each W^T (G, K, N/2), one amax per expert, RNE, no RHT."""
    g, n, k = w.shape
    amax = w.abs().amax(dim=(1, 2)).float() if w.numel() else torch.zeros(g, device=w.device)
    row_data, row_scale = quantize_rows(
        w.reshape(g * n, k), amax.repeat_interleave(n).unsqueeze(1), block_2d=block_2d
    )
    col_data, col_scale = quantize_rows(
        w.transpose(1, 2).reshape(g * k, n), amax.repeat_interleave(k).unsqueeze(1), block_2d=block_2d
    )
    return NVFP4WeightStack(
        row_data.reshape(g, n, k // 2),
        row_scale.reshape(g, n, k // BLOCK),
        col_data.reshape(g, k, n // 2),
        col_scale.reshape(g, k, n // BLOCK),
        amax,
    )


def gemm_alpha(a_amax: torch.Tensor, b_amax: torch.Tensor) -> torch.Tensor:
    """Per-group alpha = A_a * A_b / 2688**2 (fp32): the global scales of both operands,
    applied to the fp32 accumulator of the deq() products."""
    product = a_amax.float() * b_amax.float()
    return product / torch.full_like(product, GEMM_ALPHA_DIVISOR)  # one IEEE division on every device


def grouped_gemm_torch(
    a: Operand,
    b: Operand,
    group_sizes: torch.Tensor,
) -> torch.Tensor:
    """fprop / dgrad: out[t] = bf16(alpha_g * deq(a)[t] . deq(b_g)^T) for t in group g.

    a: row-wise grouped copy (T, K/2), (T, K/16), amax (G,); b: per-expert copies
    (G, N, K/2), (G, N, K/16), amax (G,); either may be given as its deq() values instead
    (``formats.operand_values``). fp32 matmul of exact deq() values."""
    (a_data, a_scale, a_amax), (b_data, b_scale, b_amax) = a, b
    a_vals = operand_values(a_data, a_scale)
    b_vals = operand_values(b_data, b_scale)
    ends = torch.cumsum(group_sizes.to(torch.int64), 0).to(torch.int32)
    acc = torch._grouped_mm(a_vals, b_vals.transpose(1, 2), offs=ends)
    group_of_row, _, _, _ = group_layout(group_sizes, a_data.shape[0])
    return (acc * gemm_alpha(a_amax, b_amax)[group_of_row].unsqueeze(1)).to(torch.bfloat16)


def grouped_gemm_wgrad_torch(
    a: Operand,
    b: Operand,
    padded_offsets: torch.Tensor,
) -> torch.Tensor:
    """wgrad: out_g = bf16(alpha_g * deq(a_g) . deq(b_g)^T), contraction over group g's
    (padded) tokens. a: column-wise grouped copy (N, P/2), (N, P/16), post-RHT amax (G,);
    b: the same for the other operand (M, P/2). Returns (G, N, M)."""
    (a_data, a_scale, a_amax), (b_data, b_scale, b_amax) = a, b
    a_vals = block_values(a_data, a_scale)
    b_vals = block_values(b_data, b_scale)
    acc = torch._grouped_mm(a_vals, b_vals.t(), offs=padded_offsets[1:].to(torch.int32))
    return (acc * gemm_alpha(a_amax, b_amax).view(-1, 1, 1)).to(torch.bfloat16)
