"""Grouped NVFP4 cast with supplied amaxes: one pass over a (T, K) tensor writes the
row-wise 1x16 copy and the column-wise copy (RHT'd along tokens or not), each optional.

Kernel ``_group_cast_kernel``; launcher ``group_cast``; op ``nvfp4_kernels::group_cast``.

Tiling. Programs walk the *padded* token axis of the column-wise layout (NVFP4GroupedTensor:
group g's tokens start at padded row p_g, a multiple of 16, and its last run of 16 is
zero-padded). A program takes BM padded rows x BK columns: R = BM/16 runs of 16 tokens.
Token j of every run is one (R, BK) register tile (x0 .. x15), so the RHT along tokens
is plain elementwise fp32 math on 16 tiles (``_nvfp4.rht16``), in the pinned order.
Each run belongs to one group (or to the unused tail past p_G, written as zeros), found
inside the kernel from prefix sums of the group sizes (``_nvfp4.group_of_runs``): no host
sync, one launch for all groups (two for an SR row + column cast, below); program (0, 0) of
each launch also writes the padded offsets p_0..p_G and the amax outputs: copies of the
amaxes the cast uses (an op's outputs may alias no input; copied here, a supplied amax
costs no copy launch of its own).

    padded rows  | r0 ............................. r0+BM |
    runs         | run 0 (16 rows) | run 1 | ... | run R-1 |
    token j      |  x_j[run, :] = x[src row of (run, j), k0:k0+BK]

Row-wise: tile x_j is R rows of x: 1x16 blocks along K, stored at the source rows. A
row-wise-only cast takes the 16 tiles one at a time (nothing needs them together), all
unrolled or ``CastConfig.token_unroll`` per step of a loop (a smaller kernel to compile).
Column-wise: the 16 tiles of a run form one 16-token block per column k; codes of
tokens 2i, 2i+1 share a byte and the 8 bytes of a run go out as one uint64, so the
column-wise copy is written as (K, cap/16) uint64 words (cap = padded capacity), through
a uint64 pointer the kernel makes from the uint8 output's. Likewise the scales are
allocated as the E4M3 tensors the NVFP4 copies hold and stored as their code bytes
through uint8 pointers: a dtype view outside the kernel is one more op a
compiled step calls on the host, per copy and per reader.

Stacked layout (STACKED, used by ``quantize_weights``): the input is a (G*N, K) stack of
G groups of N rows; a run's group is its first row // N (``_nvfp4.stacked_runs``, no
search); the column-wise copy of group g goes to [g, :, :] of (G, K, N/2) instead of the
shared (K, P/2) matrix.

Shared codes (SHARED_CODES: 2D blocks, RNE, both copies from one amax tensor -- every weight
stack): a 16x16 tile has one scale for both copies, so an element's column-wise code is its
row-wise code; the column-wise words collect the row-wise codes instead of encoding again
(sm_90a SASS per element 37.1 -> 23.6, benchmarks/cast_sass.py).

Activation prologue (ACT_IN, used by ``api.activation_group_quantize``): the input is C and
each token tile is made as it is loaded, D = bf16(f(C) * p) with the activation kernel's
operations (``_load_input``), so the backward's recompute of the fc2 input casts D without
writing or reading it.

Launches and tiles: ``config.cast_launches`` (an SR row + column cast, or one writing its
row-wise copy as deq() values, is a row-wise launch and a column-wise one) and
``config.cast_config`` (no tile choice changes a bit). A program casts K_BLOCKS column
blocks of BK one after the other (``_cast_block`` each), so the search for its runs' groups
and its other setup are paid once for all of them; with one block there is no loop (ptxas
allocates a loop body's registers worse). EVEN_K drops the column masks when BK divides K.

Philox counters (numerics.sr_random_bytes): row-wise block = src_row * K/16 + k // 16,
stream 0; column-wise block = k * cap/16 + padded_row // 16, stream 1.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..constants import BLOCK
from ._nvfp4 import (
    bf16_round,
    block_scale,
    columns,
    e2m1_rne,
    e2m1_stochastic,
    e2m1_value,
    e4m3_decode,
    global_scales,
    group_of_runs,
    load_rows,
    philox_words,
    random_byte,
    random_bytes_along_last,
    rht16,
    stacked_runs,
    token_rows,
)
from ._registry import INTERPRET, cdiv, kernel_op, launch, next_power_of_2, stacked_groups
from .activation import act_fwd_rows, is_gated
from .config import cast_config, cast_launches

_E4M3 = torch.float8_e4m3fn


@triton.jit
def _row_block_amax(x, R: tl.constexpr, BK: tl.constexpr):
    """(R, BK) -> (R, BK/16) max |x| of each 1x16 block."""
    return tl.max(tl.reshape(tl.abs(x), (R, BK // 16, 16)), axis=2)


@triton.jit
def _load_input(x_ptr, p_ptr, src, ok, K, ks, k_ok, clamp, ACT_IN: tl.constexpr, ACT: tl.constexpr,
                GATED: tl.constexpr, HAS_PROBS: tl.constexpr, GPU: tl.constexpr):
    """Rows `src` of the cast's input at columns ks as fp32 (R, BK); rows not `ok` read as zeros.
    With ACT_IN the input is D = bf16(f(C) * p), made here from C's rows (K columns, 2K for
    a gated activation) by the activation kernel's own loads and math
    (``activation.act_fwd_rows``) and its one RNE rounding: D's values, never stored."""
    if not ACT_IN:
        return load_rows(x_ptr, src, ok, K, ks, k_ok)
    return bf16_round(act_fwd_rows(x_ptr, p_ptr, src, ok, ks, k_ok, K, clamp, ACT, GATED, HAS_PROBS, GPU))


@triton.jit
def _store_rowwise(x, bam, src, ok, k0, K, s_enc, s_dec, seed, row_data_ptr, row_scale_ptr,
                   SR: tl.constexpr, EVEN_K: tl.constexpr, ROW_DEQ: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """Quantize R rows (R, BK) in 1x16 blocks of amax `bam` (R, BK/16) and store them."""
    code_s, enc = block_scale(bam, s_enc[:, None], s_dec[:, None])
    v = tl.reshape(x, (R, BK // 16, 16)) * enc[:, :, None]
    kb = k0 // 16 + tl.arange(0, BK // 16)
    if SR:
        w0, w1, w2, w3 = philox_words(seed, src[:, None] * (K // 16) + kb[None, :], 0)
        codes = e2m1_stochastic(v, random_bytes_along_last(w0, w1, w2, w3))
    else:
        codes = e2m1_rne(v)
    _store_row_codes(codes, code_s, src, ok, k0, K, row_data_ptr, row_scale_ptr, EVEN_K, ROW_DEQ, R, BK)


@triton.jit
def _store_row_codes(codes, code_s, src, ok, k0, K, row_data_ptr, row_scale_ptr,
                     EVEN_K: tl.constexpr, ROW_DEQ: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """Store R rows of E2M1 codes (R, BK/16, 16) and their E4M3 scale codes (R, BK/16); with
    ROW_DEQ their deq() values instead, as bf16 (T, K) (``dequantize``'s bits: the product
    of an E2M1 and an E4M3 value has at most 6 significant bits, exact in fp32 and bf16)."""
    if ROW_DEQ:
        v = e2m1_value(codes) * e4m3_decode(code_s)[:, :, None]
        bits = tl.reshape((v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16), (R, BK))
        ks = k0 + tl.arange(0, BK)
        if EVEN_K:
            deq_ok = ok[:, None] & tl.full((1, BK), 1, tl.int1)
        else:
            deq_ok = ok[:, None] & (ks < K)[None, :]
        tl.store(row_data_ptr.to(tl.pointer_type(tl.uint16)) + src[:, None] * K + ks[None, :], bits, mask=deq_ok)
        return
    lo, hi = tl.split(tl.reshape(codes, (R, BK // 2, 2)))
    kb = k0 // 16 + tl.arange(0, BK // 16)
    kh = k0 // 2 + tl.arange(0, BK // 2)
    if EVEN_K:  # no column masks: K % BK == 0
        data_ok = ok[:, None] & tl.full((1, BK // 2), 1, tl.int1)
        scale_ok = ok[:, None] & tl.full((1, BK // 16), 1, tl.int1)
    else:
        data_ok = ok[:, None] & (kh < K // 2)[None, :]
        scale_ok = ok[:, None] & (kb < K // 16)[None, :]
    tl.store(row_data_ptr + src[:, None] * (K // 2) + kh[None, :], (lo | (hi << 4)).to(tl.uint8), mask=data_ok)
    scale_ptrs = row_scale_ptr.to(tl.pointer_type(tl.uint8)) + src[:, None] * (K // 16) + kb[None, :]
    tl.store(scale_ptrs, code_s.to(tl.uint8), mask=scale_ok)


@triton.jit
def _store_rowwise_2d(x, code_s, enc, word, src, ok, k0, K, row_data_ptr, row_scale_ptr, j: tl.constexpr,
                      EVEN_K: tl.constexpr, ROW_DEQ: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """Token j of 2D-scaled runs (RNE, the row and column copies' amax one tensor): store its
    row-wise codes and return the column-wise words (R, BK) with its codes at bits 4j.
    Each 16x16 tile has one scale for both copies, so the column-wise code of an element
    is its row-wise code: encoded once, not twice."""
    codes = e2m1_rne(tl.reshape(x, (R, BK // 16, 16)) * enc[:, :, None])
    _store_row_codes(codes, code_s, src, ok, k0, K, row_data_ptr, row_scale_ptr, EVEN_K, ROW_DEQ, R, BK)
    return word | (tl.reshape(codes, (R, BK)).to(tl.uint64) << (4 * j))


@triton.jit
def _cast_row_tokens(x_ptr, p_ptr, clamp, start, local0, size, in_group, ks, k_ok, k0, K, row_senc, row_sdec, seed,
                     row_data_ptr, row_scale_ptr, SR: tl.constexpr, EVEN_K: tl.constexpr, ROW_DEQ: tl.constexpr,
                     R: tl.constexpr, BK: tl.constexpr, N: tl.constexpr, ACT_IN: tl.constexpr, ACT: tl.constexpr,
                     GATED: tl.constexpr, HAS_PROBS: tl.constexpr, GPU: tl.constexpr):
    """Row-wise only: tokens local0 .. local0 + N - 1 of each run, each loaded, cast and
    stored in turn (unrolled: the compiler overlaps a token's load with the previous
    token's work)."""
    for j in tl.static_range(N):
        srcj, okj = token_rows(start, local0, size, in_group, j)
        xj = _load_input(x_ptr, p_ptr, srcj, okj, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
        _store_rowwise(xj, _row_block_amax(xj, R, BK), srcj, okj, k0, K, row_senc, row_sdec, seed,
                       row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)


@triton.jit
def _in_layout_of(x, w):
    """w unchanged (the condition is always true; LLVM folds it away), joined with x in
    one op so Triton gives w the register layout of x.

    Why: left alone, Triton computes the column-wise Philox words in the layout of the
    column-wise store (1 column per thread, the addresses are strided) and converts
    every token's encoder intermediates to x's layout through shared memory: 32 (R, BK)
    conversions per program with their barriers. Joined here, only the 4 words move
    (ttgir: 32 -> 4 conversions; sm_90 SASS 95 -> 93 per element, 168 -> 112 registers
    in the column-only cast)."""
    return tl.where((x.to(tl.int32, bitcast=True) | 1) != 0, w, 0)


@triton.jit
def _col_code(y, enc, w0, w1, w2, w3, j: tl.constexpr, SR: tl.constexpr):
    """E2M1 code (int32 (R, BK)) of token j of each run in the column-wise copy."""
    v = y * enc  # the encoders clamp to +-6
    if SR:
        return e2m1_stochastic(v, random_byte(w0, w1, w2, w3, j))
    return e2m1_rne(v)


@triton.jit
def _cast_block(
    k0, x_ptr, p_ptr, clamp, row_amax_ptr, col_amax_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
    K, rows_total, cap, col_group_stride, g, in_group, rs, local0, size, start, seed,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, RHT: tl.constexpr, SIGN_MASK: tl.constexpr,
    BLOCK_2D: tl.constexpr, SR: tl.constexpr, STACKED: tl.constexpr, EVEN_K: tl.constexpr,
    SHARED_CODES: tl.constexpr, ROW_DEQ: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
    TOKEN_UNROLL: tl.constexpr, ACT_IN: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr,
    GPU: tl.constexpr,
):
    """Cast the program's runs at columns [k0, k0 + BK). (A helper that stores, not one
    whose results address stores: torch's analysis of traced launches counts only the
    pointers it stores through, see ``_nvfp4.load_token``.)"""
    ks, k_ok = columns(k0, K, BK, EVEN_K)
    if ROWWISE and not COLUMNWISE and not BLOCK_2D:
        # Row-wise only: tokens are independent, so each is loaded, cast and stored before
        # the next is read; holding all 16 (below) would cost ~250 registers for nothing.
        # (The global scales are computed here and again below, not once above the branch:
        # hoisted, they stay live across the 16 loads there, 251 -> 255 registers for RNE
        # row + column and spills in the 2D cast, sm_90 ptxas.)
        row_senc, row_sdec = global_scales(tl.load(row_amax_ptr + g, mask=in_group, other=0.0))
        if TOKEN_UNROLL == 16:  # straight-line code, not a loop of one step (see K_BLOCKS below)
            _cast_row_tokens(x_ptr, p_ptr, clamp, start, local0, size, in_group, ks, k_ok, k0, K, row_senc, row_sdec,
                             seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK, 16, ACT_IN, ACT,
                             GATED, HAS_PROBS, GPU)
        else:
            for j0 in range(0, 16, TOKEN_UNROLL):
                _cast_row_tokens(x_ptr, p_ptr, clamp, start, local0 + j0, size, in_group, ks, k_ok, k0, K, row_senc,
                                 row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK, TOKEN_UNROLL,
                                 ACT_IN, ACT, GATED, HAS_PROBS, GPU)
        return
    src0, ok0 = token_rows(start, local0, size, in_group, 0)
    x0 = _load_input(x_ptr, p_ptr, src0, ok0, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src1, ok1 = token_rows(start, local0, size, in_group, 1)
    x1 = _load_input(x_ptr, p_ptr, src1, ok1, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src2, ok2 = token_rows(start, local0, size, in_group, 2)
    x2 = _load_input(x_ptr, p_ptr, src2, ok2, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src3, ok3 = token_rows(start, local0, size, in_group, 3)
    x3 = _load_input(x_ptr, p_ptr, src3, ok3, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src4, ok4 = token_rows(start, local0, size, in_group, 4)
    x4 = _load_input(x_ptr, p_ptr, src4, ok4, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src5, ok5 = token_rows(start, local0, size, in_group, 5)
    x5 = _load_input(x_ptr, p_ptr, src5, ok5, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src6, ok6 = token_rows(start, local0, size, in_group, 6)
    x6 = _load_input(x_ptr, p_ptr, src6, ok6, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src7, ok7 = token_rows(start, local0, size, in_group, 7)
    x7 = _load_input(x_ptr, p_ptr, src7, ok7, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src8, ok8 = token_rows(start, local0, size, in_group, 8)
    x8 = _load_input(x_ptr, p_ptr, src8, ok8, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src9, ok9 = token_rows(start, local0, size, in_group, 9)
    x9 = _load_input(x_ptr, p_ptr, src9, ok9, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src10, ok10 = token_rows(start, local0, size, in_group, 10)
    x10 = _load_input(x_ptr, p_ptr, src10, ok10, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src11, ok11 = token_rows(start, local0, size, in_group, 11)
    x11 = _load_input(x_ptr, p_ptr, src11, ok11, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src12, ok12 = token_rows(start, local0, size, in_group, 12)
    x12 = _load_input(x_ptr, p_ptr, src12, ok12, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src13, ok13 = token_rows(start, local0, size, in_group, 13)
    x13 = _load_input(x_ptr, p_ptr, src13, ok13, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src14, ok14 = token_rows(start, local0, size, in_group, 14)
    x14 = _load_input(x_ptr, p_ptr, src14, ok14, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    src15, ok15 = token_rows(start, local0, size, in_group, 15)
    x15 = _load_input(x_ptr, p_ptr, src15, ok15, K, ks, k_ok, clamp, ACT_IN, ACT, GATED, HAS_PROBS, GPU)

    if BLOCK_2D or ROWWISE:
        bam0 = _row_block_amax(x0, R, BK)
        bam1 = _row_block_amax(x1, R, BK)
        bam2 = _row_block_amax(x2, R, BK)
        bam3 = _row_block_amax(x3, R, BK)
        bam4 = _row_block_amax(x4, R, BK)
        bam5 = _row_block_amax(x5, R, BK)
        bam6 = _row_block_amax(x6, R, BK)
        bam7 = _row_block_amax(x7, R, BK)
        bam8 = _row_block_amax(x8, R, BK)
        bam9 = _row_block_amax(x9, R, BK)
        bam10 = _row_block_amax(x10, R, BK)
        bam11 = _row_block_amax(x11, R, BK)
        bam12 = _row_block_amax(x12, R, BK)
        bam13 = _row_block_amax(x13, R, BK)
        bam14 = _row_block_amax(x14, R, BK)
        bam15 = _row_block_amax(x15, R, BK)
    if BLOCK_2D:
        tile = bam0
        tile = tl.maximum(tile, bam1)
        tile = tl.maximum(tile, bam2)
        tile = tl.maximum(tile, bam3)
        tile = tl.maximum(tile, bam4)
        tile = tl.maximum(tile, bam5)
        tile = tl.maximum(tile, bam6)
        tile = tl.maximum(tile, bam7)
        tile = tl.maximum(tile, bam8)
        tile = tl.maximum(tile, bam9)
        tile = tl.maximum(tile, bam10)
        tile = tl.maximum(tile, bam11)
        tile = tl.maximum(tile, bam12)
        tile = tl.maximum(tile, bam13)
        tile = tl.maximum(tile, bam14)
        tile = tl.maximum(tile, bam15)
    if ROWWISE:
        row_senc, row_sdec = global_scales(tl.load(row_amax_ptr + g, mask=in_group, other=0.0))
        if SHARED_CODES:  # one scale per tile for both copies: the column-wise words collect the row-wise codes
            code_s, enc = block_scale(tile, row_senc[:, None], row_sdec[:, None])
            word = tl.zeros((R, BK), dtype=tl.uint64)
            word = _store_rowwise_2d(x0, code_s, enc, word, src0, ok0, k0, K, row_data_ptr, row_scale_ptr, 0, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x1, code_s, enc, word, src1, ok1, k0, K, row_data_ptr, row_scale_ptr, 1, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x2, code_s, enc, word, src2, ok2, k0, K, row_data_ptr, row_scale_ptr, 2, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x3, code_s, enc, word, src3, ok3, k0, K, row_data_ptr, row_scale_ptr, 3, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x4, code_s, enc, word, src4, ok4, k0, K, row_data_ptr, row_scale_ptr, 4, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x5, code_s, enc, word, src5, ok5, k0, K, row_data_ptr, row_scale_ptr, 5, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x6, code_s, enc, word, src6, ok6, k0, K, row_data_ptr, row_scale_ptr, 6, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x7, code_s, enc, word, src7, ok7, k0, K, row_data_ptr, row_scale_ptr, 7, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x8, code_s, enc, word, src8, ok8, k0, K, row_data_ptr, row_scale_ptr, 8, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x9, code_s, enc, word, src9, ok9, k0, K, row_data_ptr, row_scale_ptr, 9, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x10, code_s, enc, word, src10, ok10, k0, K, row_data_ptr, row_scale_ptr, 10, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x11, code_s, enc, word, src11, ok11, k0, K, row_data_ptr, row_scale_ptr, 11, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x12, code_s, enc, word, src12, ok12, k0, K, row_data_ptr, row_scale_ptr, 12, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x13, code_s, enc, word, src13, ok13, k0, K, row_data_ptr, row_scale_ptr, 13, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x14, code_s, enc, word, src14, ok14, k0, K, row_data_ptr, row_scale_ptr, 14, EVEN_K, ROW_DEQ, R, BK)
            word = _store_rowwise_2d(x15, code_s, enc, word, src15, ok15, k0, K, row_data_ptr, row_scale_ptr, 15, EVEN_K, ROW_DEQ, R, BK)
        elif BLOCK_2D:
            _store_rowwise(x0, tile, src0, ok0, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x1, tile, src1, ok1, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x2, tile, src2, ok2, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x3, tile, src3, ok3, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x4, tile, src4, ok4, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x5, tile, src5, ok5, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x6, tile, src6, ok6, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x7, tile, src7, ok7, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x8, tile, src8, ok8, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x9, tile, src9, ok9, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x10, tile, src10, ok10, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x11, tile, src11, ok11, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x12, tile, src12, ok12, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x13, tile, src13, ok13, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x14, tile, src14, ok14, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x15, tile, src15, ok15, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
        else:
            _store_rowwise(x0, bam0, src0, ok0, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x1, bam1, src1, ok1, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x2, bam2, src2, ok2, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x3, bam3, src3, ok3, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x4, bam4, src4, ok4, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x5, bam5, src5, ok5, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x6, bam6, src6, ok6, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x7, bam7, src7, ok7, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x8, bam8, src8, ok8, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x9, bam9, src9, ok9, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x10, bam10, src10, ok10, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x11, bam11, src11, ok11, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x12, bam12, src12, ok12, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x13, bam13, src13, ok13, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x14, bam14, src14, ok14, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)
            _store_rowwise(x15, bam15, src15, ok15, k0, K, row_senc, row_sdec, seed, row_data_ptr, row_scale_ptr, SR, EVEN_K, ROW_DEQ, R, BK)

    if COLUMNWISE:
        if STACKED:  # group g's own (K, N) matrix
            col_row = local0
            base = g.to(tl.int64) * col_group_stride
        else:  # the shared (K, P) matrix, padded rows; the tail past p_G gets zeros
            col_row = rs
            base = tl.zeros_like(rs)
        # one uint64 word (8 bytes, 16 tokens) and one scale byte per (run, column)
        idx = base[:, None] + ks[None, :] * (cap // 16) + (col_row // 16)[:, None]
        if SHARED_CODES:  # the words were filled with the row-wise codes above
            col_code_s = tl.reshape(tl.broadcast_to(code_s[:, :, None], (R, BK // 16, 16)), (R, BK))
        else:
            if RHT:
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, SIGN_MASK)
            if BLOCK_2D:  # the 16x16 tile amax, repeated on the 16 columns of each tile
                cam = tl.reshape(tl.broadcast_to(tile[:, :, None], (R, BK // 16, 16)), (R, BK))
            else:
                cam = tl.abs(x0)
                cam = tl.maximum(cam, tl.abs(x1))
                cam = tl.maximum(cam, tl.abs(x2))
                cam = tl.maximum(cam, tl.abs(x3))
                cam = tl.maximum(cam, tl.abs(x4))
                cam = tl.maximum(cam, tl.abs(x5))
                cam = tl.maximum(cam, tl.abs(x6))
                cam = tl.maximum(cam, tl.abs(x7))
                cam = tl.maximum(cam, tl.abs(x8))
                cam = tl.maximum(cam, tl.abs(x9))
                cam = tl.maximum(cam, tl.abs(x10))
                cam = tl.maximum(cam, tl.abs(x11))
                cam = tl.maximum(cam, tl.abs(x12))
                cam = tl.maximum(cam, tl.abs(x13))
                cam = tl.maximum(cam, tl.abs(x14))
                cam = tl.maximum(cam, tl.abs(x15))
            col_senc, col_sdec = global_scales(tl.load(col_amax_ptr + g, mask=in_group, other=0.0))
            col_code_s, enc = block_scale(cam, col_senc[:, None], col_sdec[:, None])
            w0 = idx
            w1 = idx
            w2 = idx
            w3 = idx
            if SR:
                w0, w1, w2, w3 = philox_words(seed, ks[None, :] * (cap // 16) + (col_row // 16)[:, None], 1)
                w0, w1, w2, w3 = _in_layout_of(x0, w0), _in_layout_of(x0, w1), _in_layout_of(x0, w2), _in_layout_of(x0, w3)
            c0 = _col_code(x0, enc, w0, w1, w2, w3, 0, SR)
            c1 = _col_code(x1, enc, w0, w1, w2, w3, 1, SR)
            c2 = _col_code(x2, enc, w0, w1, w2, w3, 2, SR)
            c3 = _col_code(x3, enc, w0, w1, w2, w3, 3, SR)
            c4 = _col_code(x4, enc, w0, w1, w2, w3, 4, SR)
            c5 = _col_code(x5, enc, w0, w1, w2, w3, 5, SR)
            c6 = _col_code(x6, enc, w0, w1, w2, w3, 6, SR)
            c7 = _col_code(x7, enc, w0, w1, w2, w3, 7, SR)
            c8 = _col_code(x8, enc, w0, w1, w2, w3, 8, SR)
            c9 = _col_code(x9, enc, w0, w1, w2, w3, 9, SR)
            c10 = _col_code(x10, enc, w0, w1, w2, w3, 10, SR)
            c11 = _col_code(x11, enc, w0, w1, w2, w3, 11, SR)
            c12 = _col_code(x12, enc, w0, w1, w2, w3, 12, SR)
            c13 = _col_code(x13, enc, w0, w1, w2, w3, 13, SR)
            c14 = _col_code(x14, enc, w0, w1, w2, w3, 14, SR)
            c15 = _col_code(x15, enc, w0, w1, w2, w3, 15, SR)
            word = (c0 | (c1 << 4)).to(tl.uint64)
            word = word | ((c2 | (c3 << 4)).to(tl.uint64) << 8)
            word = word | ((c4 | (c5 << 4)).to(tl.uint64) << 16)
            word = word | ((c6 | (c7 << 4)).to(tl.uint64) << 24)
            word = word | ((c8 | (c9 << 4)).to(tl.uint64) << 32)
            word = word | ((c10 | (c11 << 4)).to(tl.uint64) << 40)
            word = word | ((c12 | (c13 << 4)).to(tl.uint64) << 48)
            word = word | ((c14 | (c15 << 4)).to(tl.uint64) << 56)
        col_ok = (rs < rows_total)[:, None] & k_ok[None, :]
        tl.store(col_data_ptr.to(tl.pointer_type(tl.uint64)) + idx, word, mask=col_ok)
        tl.store(col_scale_ptr.to(tl.pointer_type(tl.uint8)) + idx, col_code_s.to(tl.uint8), mask=col_ok)


@triton.jit
def _group_cast_kernel(
    x_ptr, p_ptr, sizes_ptr, pad_off_ptr, row_amax_ptr, col_amax_ptr, seed_ptr,
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, row_amax_out_ptr, col_amax_out_ptr,
    K, G, rows_total, cap, col_group_stride, clamp,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, RHT: tl.constexpr, SIGN_MASK: tl.constexpr,
    BLOCK_2D: tl.constexpr, SR: tl.constexpr, STACKED: tl.constexpr, EVEN_K: tl.constexpr,
    SHARED_CODES: tl.constexpr, ROW_DEQ: tl.constexpr, BLOCK_G: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, K_BLOCKS: tl.constexpr, TOKEN_UNROLL: tl.constexpr,
    ACT_IN: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, GPU: tl.constexpr,
):
    R: tl.constexpr = BM // 16
    r0 = tl.program_id(0).to(tl.int64) * BM
    gi = tl.arange(0, BLOCK_G)
    if STACKED:  # G groups of rows_total / G rows: no sizes to load, no search
        g, in_group, rs, poff, size, start = stacked_runs(r0, rows_total, G, R)
        pad_end = (gi + 1).to(tl.int64) * (rows_total // G)
    else:  # loaded here, not in a helper (_nvfp4.load_token)
        sizes = tl.load(sizes_ptr + gi, mask=gi < G, other=0)
        g, in_group, rs, poff, size, start, pad_end = group_of_runs(sizes, r0, rows_total, G, R, BLOCK_G)
    local0 = rs - poff
    # program (0, 0) also writes the padded offsets p_0 = 0, p_1, ..., p_G
    first = (gi * 0 + tl.program_id(0) + tl.program_id(1)) == 0  # (BLOCK_G,) bool
    mine = (gi < G) & first
    tl.store(pad_off_ptr + 1 + gi, pad_end, mask=mine)
    tl.store(pad_off_ptr + gi, tl.zeros_like(pad_end), mask=(gi == 0) & first)
    # ... and the amax outputs, copies of the amaxes it casts with (an op may not return its input)
    if ROWWISE:
        tl.store(row_amax_out_ptr + gi, tl.load(row_amax_ptr + gi, mask=mine), mask=mine)
    if COLUMNWISE:
        tl.store(col_amax_out_ptr + gi, tl.load(col_amax_ptr + gi, mask=mine), mask=mine)
    seed = 0
    if SR:
        seed = tl.load(seed_ptr)
    # K_BLOCKS column blocks of BK per program, one after the other: the group search above
    # and the per-program setup are paid once for all of them. (One block is not a loop of
    # one: ptxas allocates the loop's body worse, 192 -> 432 bytes of spills in the SR cast.)
    if K_BLOCKS == 1:
        _cast_block(tl.program_id(1) * BK, x_ptr, p_ptr, clamp, row_amax_ptr, col_amax_ptr, row_data_ptr,
                    row_scale_ptr, col_data_ptr, col_scale_ptr, K, rows_total, cap, col_group_stride, g, in_group, rs,
                    local0, size, start, seed, ROWWISE, COLUMNWISE, RHT, SIGN_MASK, BLOCK_2D, SR, STACKED, EVEN_K,
                    SHARED_CODES, ROW_DEQ, R, BK, TOKEN_UNROLL, ACT_IN, ACT, GATED, HAS_PROBS, GPU)
    else:
        k_first = tl.program_id(1) * (BK * K_BLOCKS)
        for k0 in range(k_first, tl.minimum(k_first + BK * K_BLOCKS, K), BK):
            _cast_block(k0, x_ptr, p_ptr, clamp, row_amax_ptr, col_amax_ptr, row_data_ptr, row_scale_ptr,
                        col_data_ptr, col_scale_ptr, K, rows_total, cap, col_group_stride, g, in_group, rs, local0,
                        size, start, seed, ROWWISE, COLUMNWISE, RHT, SIGN_MASK, BLOCK_2D, SR, STACKED, EVEN_K,
                        SHARED_CODES, ROW_DEQ, R, BK, TOKEN_UNROLL, ACT_IN, ACT, GATED, HAS_PROBS, GPU)


@kernel_op("nvfp4_kernels::group_cast")
def group_cast(
    x: torch.Tensor,
    group_sizes: Optional[torch.Tensor],
    row_amax: Optional[torch.Tensor],
    col_amax: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    sign_mask: int,
    block_2d: bool,
    stochastic_rounding: bool,
    capacity: int,
    stacked: bool,
    row_deq: bool = False,
    probs: Optional[torch.Tensor] = None,
    act: int = -1,
    clamp: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast x (T, K) of G groups with supplied per-group amaxes (fp32 (G,), contiguous;
    they may be one tensor, or alias anything: they are only read).

    capacity: column-wise width P (grouped: numerics.columnwise_capacity(T, G); one
    group of T tokens, T % 16 == 0: T; stacked: N = T / G, the rows of one group, and
    group_sizes is None: an expert weight stack, ``quantize_weights``).
    seed: int64 (1,) on x's device (read only with stochastic_rounding).
    Returns (row data (T, K/2) uint8, row scales (T, K/16) E4M3, column-wise data
    (K, P/2) uint8 [stacked: (G, K, N/2)], column-wise scales (K, P/16) E4M3 [(G, K, N/16)],
    padded offsets int64 (G+1,), row-wise amax, column-wise amax (fp32 (G,): new tensors
    holding the amaxes given)); a copy not asked for is an empty (0,) tensor.
    row_deq: the row-wise copy as its deq() values, row data (T, K) bf16 (what
    ``dequantize_bf16`` makes of the packed copy, bit for bit), row scales empty.
    act >= 0 (an activation's triton_code): x is C, and the cast's input is D = bf16(f(C) * p)
    (probs p (T,) or None; clamp: tanh-SReLU's scale), computed as it is loaded, bit for bit
    ``activation.activation_forward``'s D: (T, K) from C (T, K), or (T, 2K) for a gated
    activation. Amaxes must be supplied (D's, from the forward).
    """
    x = x.contiguous()
    act_in = act >= 0
    tokens, k = x.shape
    gated = act_in and is_gated(act)
    if gated:
        k //= 2
    groups = stacked_groups(tokens, capacity) if stacked else group_sizes.shape[0]
    pad_off = x.new_empty(groups + 1, dtype=torch.int64)
    def alloc(wanted, *shape, dtype=torch.uint8):  # a copy not asked for: its own empty tensor (no aliasing)
        return x.new_empty(*shape if wanted else (0,), dtype=dtype)

    if row_deq:
        row_data = x.new_empty(*(tokens, k) if rowwise else (0,), dtype=torch.bfloat16)
        row_scale = alloc(False, dtype=_E4M3)
    else:
        row_data = alloc(rowwise, tokens, k // 2)
        row_scale = alloc(rowwise, tokens, k // BLOCK, dtype=_E4M3)
    lead = (groups, k) if stacked else (k,)
    col_data = alloc(columnwise, *lead, capacity // 2)
    col_scale = alloc(columnwise, *lead, capacity // BLOCK, dtype=_E4M3)
    row_amax_out = x.new_empty(groups if rowwise else 0, dtype=torch.float32)
    col_amax_out = x.new_empty(groups if columnwise else 0, dtype=torch.float32)
    rows_total = tokens if stacked else capacity
    if groups == 0:
        return row_data, row_scale, col_data, col_scale, pad_off.zero_(), row_amax_out, col_amax_out
    sizes = None if stacked else group_sizes.contiguous()
    has_probs = act_in and probs is not None
    # 2D, RNE, both copies from one amax tensor: each element's two codes are the same
    shared_codes = block_2d and not stochastic_rounding and not rht and row_amax is col_amax
    for row, col in cast_launches(rowwise, columnwise, stochastic_rounding, row_deq, stacked):  # each writes pad_off
        # the RHT and its signs touch only the column-wise copy: a row-only launch compiles
        # to the same binary with or without them (one kernel, not two, to compile)
        col_rht = rht and col
        cfg = cast_config(rows_total, k, rht=col_rht, sr=stochastic_rounding, rowwise=row, columnwise=col,
                          stacked=stacked, row_deq=row_deq and row, act_in=act_in)
        # pointers this launch does not use are None (``_registry.launch``)
        launch(
            _group_cast_kernel,
            (max(cdiv(rows_total, cfg.block_m), 1), max(cdiv(k, cfg.block_k * cfg.k_blocks), 1)),
            x_ptr=x, p_ptr=probs if has_probs else None, sizes_ptr=sizes, pad_off_ptr=pad_off,
            row_amax_ptr=row_amax if row else None, col_amax_ptr=col_amax if col else None,
            seed_ptr=seed if stochastic_rounding else None,
            row_data_ptr=row_data if row else None, row_scale_ptr=row_scale if row else None,
            col_data_ptr=col_data if col else None, col_scale_ptr=col_scale if col else None,
            row_amax_out_ptr=row_amax_out if row else None, col_amax_out_ptr=col_amax_out if col else None,
            K=k, G=groups, rows_total=rows_total, cap=capacity,
            col_group_stride=k * capacity // BLOCK, clamp=clamp,
            ROWWISE=row, COLUMNWISE=col, RHT=col_rht, SIGN_MASK=sign_mask if col_rht else 0, BLOCK_2D=block_2d,
            SR=stochastic_rounding, STACKED=stacked, EVEN_K=k % cfg.block_k == 0,
            SHARED_CODES=shared_codes and row and col, ROW_DEQ=row_deq and row,
            BLOCK_G=max(next_power_of_2(groups), 2), BM=cfg.block_m, BK=cfg.block_k, K_BLOCKS=cfg.k_blocks,
            TOKEN_UNROLL=cfg.token_unroll, ACT_IN=act_in, ACT=act if act_in else 0, GATED=gated,
            HAS_PROBS=has_probs,
            GPU=not INTERPRET, **cfg.launch_options(),
        )
    return row_data, row_scale, col_data, col_scale, pad_off, row_amax_out, col_amax_out
