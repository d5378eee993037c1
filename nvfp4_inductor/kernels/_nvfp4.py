"""Triton device functions shared by the quantize kernels: the numerics.md 2 scale chain, the
E4M3 / E2M1 encoders, the pinned-order RHT and Philox random bytes.

Every function repeats the fp32 operations of ``nvfp4_inductor/formats.py`` and
``numerics.py`` one for one, so the interpreter (numpy) and the GPU give the same bits:

* the bf16 rounding and the E4M3 encode / decode take the hardware's conversions on the
  GPU (``cvt.rn.bf16.f32``; ``cvt.rn.satfinite.e4m3x2.f32`` and back through fp16, all
  exact or round-to-nearest-even, saturating at 448 as the encoder must) and integer bit
  operations under the interpreter, whose casts differ (fp8: ties away from zero, no
  saturation; bf16 -> fp32: wrong subnormals). ``_HW_CVT`` picks one when a kernel is
  traced; the GPU bit tests hold the hardware paths to ``numerics.py``, CI the integer ones;
* every division is ``tl.math.div_rn`` (IEEE round-to-nearest; a plain ``/`` may lower
  to an approximate division on the GPU);
* a multiply-add pair that the compiler may contract to an FMA appears only where the
  product is exact (``a * 512 + 2**23`` in the E4M3 encoder, ``a * 2 + 2**23`` and
  ``a * 1024 + (2**23 - 0.5)`` in the E2M1 encoders), so the FMA rounds the same sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import E4M3_MAX, FLT_MAX, FP4_E4M3_MAX, INV_FP4_MAX, PHILOX_ROUNDS, RHT_SCALE
from ._registry import INTERPRET

_FLT_MAX: tl.constexpr = tl.constexpr(FLT_MAX)
_FP4_E4M3_MAX: tl.constexpr = tl.constexpr(FP4_E4M3_MAX)  # 2688
_INV_FP4_MAX: tl.constexpr = tl.constexpr(INV_FP4_MAX)  # fp32(1/6): multiplied, never divided
_E4M3_MAX: tl.constexpr = tl.constexpr(E4M3_MAX)
_RHT_SCALE: tl.constexpr = tl.constexpr(RHT_SCALE)
_PHILOX_ROUNDS: tl.constexpr = tl.constexpr(PHILOX_ROUNDS)
_HW_CVT: tl.constexpr = tl.constexpr(not INTERPRET)  # hardware conversions (module docstring)


@triton.jit
def bf16_round(x):
    """fp32 -> fp32 holding bf16(x), round to nearest even (finite x)."""
    if _HW_CVT:
        return x.to(tl.bfloat16).to(tl.float32)
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def global_scales(amax):
    """(S_enc, S_dec) of an fp32 amax: S_enc = min(2688 / A, FLT_MAX), 1 where A == 0;
    S_dec = 1 / S_enc (numerics.md 2.1): both one IEEE division, as numerics.global_encode_scale
    (a tensor over a tensor there; a Python number over a tensor would be
    reciprocal * 2688, rounded twice)."""
    one = tl.zeros_like(amax) + 1.0
    s_enc = tl.minimum(tl.math.div_rn(one * _FP4_E4M3_MAX, amax), _FLT_MAX)
    s_enc = tl.where(amax == 0.0, 1.0, s_enc)
    s_dec = tl.math.div_rn(one, s_enc)
    return s_enc, s_dec


@triton.jit
def e4m3_encode_nonneg(s):
    """fp32 s >= 0 -> E4M3 code (int32): RNE, saturate at 448, subnormals kept
    (formats.e4m3_encode; block scales are never negative)."""
    if _HW_CVT:  # satfinite: 448 < s < 464 saturates, as below
        return s.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    a = tl.minimum(s, _E4M3_MAX)  # saturate first: 448 < s < 464 must not round to NaN
    ab = a.to(tl.int32, bitcast=True)
    lsb = (ab >> 20) & 1
    # RNE on the 20 dropped mantissa bits; a carry moves into the exponent; rebias 127 -> 7
    normal = ((ab + 0x7FFFF + lsb) >> 20) - ((127 - 7) << 3)
    # subnormals: a * 512 is exact, the 2**23 add rounds it to an integer, ties to even
    subnormal = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # mantissa = the integer
    return tl.where(a < 0.015625, subnormal, normal)


@triton.jit
def e4m3_decode(code):
    """E4M3 code (int32, 0..0x7E) -> its fp32 value (exact)."""
    if _HW_CVT:  # Hopper has no direct e4m3 -> fp32 conversion; through fp16 is exact
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.float32)
    exponent = code >> 3
    mantissa = code & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2**-9, exact
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def e2m1_value(code):
    """E2M1 code (int32, 0..15) -> its fp32 value (exact): codes 2..7 are 2**((c >> 1) - 1) *
    (1 + (c & 1) / 2), placed as exponent and mantissa bits; 1 is 0.5, 0 is 0; bit 3 the sign."""
    c = code & 7
    normal = (((c >> 1) + 126) << 23) | ((c & 1) << 22)
    bits = tl.where(c >= 2, normal, tl.where(c == 1, 0x3F000000, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def block_scale(block_amax, s_enc, s_dec):
    """E4M3 scale code (int32) and fp32 encode multiplier of blocks (numerics.md 2.2-2.3):
    s = e4m3(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX));
    enc = min(1 / (float(s) * S_dec), FLT_MAX) -- divide by the product, not S_enc / s."""
    s = tl.minimum(block_amax * (s_enc * _INV_FP4_MAX), _FLT_MAX)
    code = e4m3_encode_nonneg(s)
    enc = tl.minimum(tl.math.div_rn(tl.zeros_like(s) + 1.0, e4m3_decode(code) * s_dec), _FLT_MAX)
    return code, enc


@triton.jit
def e2m1_rne(v):
    """fp32 v = x * enc (any sign and size) -> E2M1 code (int32) of clamp(v, -6, 6), RNE on
    the grid: the codes of formats.e2m1_encode's threshold comparisons (0.25->0, 0.75->1,
    1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; a strictly negative v gets the sign bit) in
    fewer operations:
      |v| >= 1: E2M1 is a float with 1 mantissa bit, exponent bias 1, so round the fp32
                mantissa to 1 bit (add 0x1FFFFF + lsb, drop 22 bits; a carry bumps the
                exponent) and rebias by 252 = 126 << 1 (folded into the added constant;
                the sum stays below 2**31 up to inf);
      |v| < 1:  codes 0, 1, 2 are 0, 0.5, 1: code = RNE(|v| * 2) (exact product, the
                2**23 add rounds ties to even; read back from the sum's mantissa bits).
    The clamp to 6 is the code's minimum with 7: codes grow with |v| and 6 is code 7, so
    one integer min replaces two float clamps."""
    a = tl.abs(v)
    ab = a.to(tl.int32, bitcast=True)
    normal = (ab + (0x1FFFFF - (252 << 22)) + ((ab >> 22) & 1)) >> 22
    small = (a * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.minimum(tl.where(a < 1.0, small, normal), 7)
    return code | tl.where(v < 0.0, 8, 0)


@triton.jit
def e2m1_stochastic(v, rbyte):
    """fp32 v = x * enc (any sign and size), random byte r (int32 0..255) -> E2M1 code
    (int32) of clamp(v, -6, 6), the codes of numerics.e2m1_round_stochastic: |v| between
    grid neighbours lo < hi rounds up iff (|v| - lo) * 256 / (hi - lo) > r + 0.5. Both
    cases read that exact comparison off integer sums, with c = 255 - r:
      |v| >= 1: the 22 mantissa bits below E2M1's one are (|v| - lo) * 2**22 / (hi - lo);
                up iff they exceed (r + 0.5) * 2**14, i.e. iff adding c * 2**14 + 2**13 - 1
                carries into bit 22: code = (bits + (c << 14) + 8191 - (252 << 22)) >> 22
                (252 = 126 << 1 rebiases fp32's exponent to E2M1's; a carry bumps it);
      |v| < 1:  the grid is uniform (0, 0.5, 1; spacing 0.5), so with b = |v| * 1024 the
                code is [b > 2r + 1] + [b > 2r + 513]. One fused multiply-add
                s = RNE(b + 2**23 - 0.5) (b is exact) lands on an integer m = s - 2**23
                with m >= n iff b > n for odd n (the tie b = n rounds to the even m = n - 1),
                so code = (m - (2r + 1) + 512) >> 9 = (m + 1 + 2c) >> 9, m read from s's
                bits (no int->float convert, which issues at a quarter of the fp32 rate).
    Clamp as in e2m1_rne: codes grow with |v|, min with 7."""
    a = tl.abs(v)
    c = rbyte ^ 0xFF
    normal = (a.to(tl.int32, bitcast=True) + (c << 14) + (8191 - (252 << 22))) >> 22
    s = (a * 1024.0 + 8388607.5).to(tl.int32, bitcast=True)
    small = (s + (2 * c + 1 - 0x4B000000)) >> 9
    code = tl.where(a >= 1.0, normal, small)
    return tl.minimum(code, 7) | tl.where(v < 0.0, 8, 0)


@triton.jit
def philox_words(seed, block_index, stream: tl.constexpr):
    """The 4 Philox4x32-10 words of counter (block_index, stream, 0, 0), key = seed
    (int64 scalar): the random bytes of one 16-element block, element j = byte j % 4 of
    word j // 4 (numerics.sr_random_bytes)."""
    c0 = block_index.to(tl.uint32)
    zero = tl.zeros_like(c0)
    return tl.philox(seed, c0, zero + stream, zero, zero, _PHILOX_ROUNDS)


@triton.jit
def random_byte(w0, w1, w2, w3, j: tl.constexpr):
    """Byte j (0..15) of a block's 4 Philox words, as int32."""
    if j // 4 == 0:
        w = w0
    elif j // 4 == 1:
        w = w1
    elif j // 4 == 2:
        w = w2
    else:
        w = w3
    return ((w >> (8 * (j % 4))) & 0xFF).to(tl.int32)


@triton.jit
def random_bytes_along_last(w0, w1, w2, w3):
    """(..., N) words of N blocks -> (..., N, 16) int32 bytes, element j of each block
    taking byte j % 4 of word j // 4."""
    j = tl.arange(0, 16)
    word = j // 4
    shift = ((j % 4) * 8).to(tl.uint32)
    w = tl.where(
        word < 2,
        tl.where(word == 0, w0[:, :, None], w1[:, :, None]),
        tl.where(word == 2, w2[:, :, None], w3[:, :, None]),
    )
    return ((w >> shift) & 0xFF).to(tl.int32)


@triton.jit
def butterfly(a, b):
    """One FWHT butterfly: (a, b) -> (a + b, a - b) in fp32."""
    return a + b, a - b


@triton.jit
def _sign(sign_mask, j: tl.constexpr):
    """+1.0 or -1.0: bit j of the sign mask."""
    return tl.where(((sign_mask >> j) & 1) == 1, -1.0, 1.0)


@triton.jit
def rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, sign_mask):
    """RHT of 16 fp32 tensors (the 16 tokens of runs): bf16(0.25 * FWHT(s * x)) held in
    fp32, butterflies of strides 1, 2, 4, 8 in this order (numerics.rht16)."""
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = fwht16(
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, sign_mask)
    return (
        rht_round(y0), rht_round(y1), rht_round(y2), rht_round(y3), rht_round(y4), rht_round(y5),
        rht_round(y6), rht_round(y7), rht_round(y8), rht_round(y9), rht_round(y10), rht_round(y11),
        rht_round(y12), rht_round(y13), rht_round(y14), rht_round(y15),
    )


@triton.jit
def rht_round(y):
    """The RHT's last step on an FWHT output: times 0.25 (exact but in fp32's subnormal
    range), then one rounding to bf16. Monotone and odd in y, so the max of |rht_round(y)|
    over any set is rht_round(max |y|): an amax needs it once, not per element."""
    return bf16_round(y * _RHT_SCALE)


@triton.jit
def fwht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, sign_mask):
    """Signs, then the unscaled fp32 FWHT butterflies of strides 1, 2, 4, 8 in this order."""
    # signs: bit i of sign_mask set -> x_i * -1.0, else x_i * 1.0 (exact; numerics multiplies too).
    # A constexpr mask folds into the adds' operand signs.
    x0 = x0 * _sign(sign_mask, 0)
    x1 = x1 * _sign(sign_mask, 1)
    x2 = x2 * _sign(sign_mask, 2)
    x3 = x3 * _sign(sign_mask, 3)
    x4 = x4 * _sign(sign_mask, 4)
    x5 = x5 * _sign(sign_mask, 5)
    x6 = x6 * _sign(sign_mask, 6)
    x7 = x7 * _sign(sign_mask, 7)
    x8 = x8 * _sign(sign_mask, 8)
    x9 = x9 * _sign(sign_mask, 9)
    x10 = x10 * _sign(sign_mask, 10)
    x11 = x11 * _sign(sign_mask, 11)
    x12 = x12 * _sign(sign_mask, 12)
    x13 = x13 * _sign(sign_mask, 13)
    x14 = x14 * _sign(sign_mask, 14)
    x15 = x15 * _sign(sign_mask, 15)
    # stride 1: pairs (i, i + 1)
    x0, x1 = butterfly(x0, x1)
    x2, x3 = butterfly(x2, x3)
    x4, x5 = butterfly(x4, x5)
    x6, x7 = butterfly(x6, x7)
    x8, x9 = butterfly(x8, x9)
    x10, x11 = butterfly(x10, x11)
    x12, x13 = butterfly(x12, x13)
    x14, x15 = butterfly(x14, x15)
    # stride 2
    x0, x2 = butterfly(x0, x2)
    x1, x3 = butterfly(x1, x3)
    x4, x6 = butterfly(x4, x6)
    x5, x7 = butterfly(x5, x7)
    x8, x10 = butterfly(x8, x10)
    x9, x11 = butterfly(x9, x11)
    x12, x14 = butterfly(x12, x14)
    x13, x15 = butterfly(x13, x15)
    # stride 4
    x0, x4 = butterfly(x0, x4)
    x1, x5 = butterfly(x1, x5)
    x2, x6 = butterfly(x2, x6)
    x3, x7 = butterfly(x3, x7)
    x8, x12 = butterfly(x8, x12)
    x9, x13 = butterfly(x9, x13)
    x10, x14 = butterfly(x10, x14)
    x11, x15 = butterfly(x11, x15)
    # stride 8
    x0, x8 = butterfly(x0, x8)
    x1, x9 = butterfly(x1, x9)
    x2, x10 = butterfly(x2, x10)
    x3, x11 = butterfly(x3, x11)
    x4, x12 = butterfly(x4, x12)
    x5, x13 = butterfly(x5, x13)
    x6, x14 = butterfly(x6, x14)
    x7, x15 = butterfly(x7, x15)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def group_of_runs(sizes, r0, rows_total, G, R: tl.constexpr, BLOCK_G: tl.constexpr):
    """Where the R runs of 16 padded rows starting at r0 come from, computed on the device
    from the G group sizes (prefix sums of the sizes and of the sizes rounded up to 16);
    `sizes`: (BLOCK_G,), loaded by the kernel itself (``load_token`` says why).

    Returns per run: g (its group, clamped to a valid index), in_group (False past p_G
    or past rows_total), rs (its first padded row), poff (p_g, the padded start of g),
    size (m_g), start (g's first row in x); and pad_end (BLOCK_G,), the p_{g+1}.
    Runs never straddle groups: every p_g is a multiple of 16."""
    gi = tl.arange(0, BLOCK_G)
    sz = sizes.to(tl.int64)
    padded = (sz + 15) // 16 * 16
    pad_end = tl.cumsum(padded, 0)
    end = tl.cumsum(sz, 0)
    rs = r0 + tl.arange(0, R).to(tl.int64) * 16
    g = tl.sum((tl.where(gi < G, pad_end, 2**62)[None, :] <= rs[:, None]).to(tl.int32), axis=1)
    in_group = (g < G) & (rs < rows_total)
    sel = gi[None, :] == g[:, None]  # one-hot gather of the group's numbers (none past p_G)
    size = tl.sum(tl.where(sel, sz[None, :], 0), axis=1)
    start = tl.sum(tl.where(sel, (end - sz)[None, :], 0), axis=1)
    poff = tl.sum(tl.where(sel, (pad_end - padded)[None, :], 0), axis=1)
    g = tl.where(g < G, g, 0)
    return g, in_group, rs, poff, size, start, pad_end


@triton.jit
def stacked_runs(r0, rows_total, G, R: tl.constexpr):
    """``group_of_runs`` for a stack of G groups of n = rows_total / G rows each, n a
    multiple of 16 (an expert weight stack): no padding, so p_g = g * n and a run's group
    is its first row // n. The same values as ``group_of_runs`` on G sizes of n, without
    its (R, BLOCK_G) search: at 128 experts that search cost the cast ~10 instructions
    per element and spilled registers (sm_90 SASS)."""
    n = rows_total // G
    rs = r0 + tl.arange(0, R).to(tl.int64) * 16
    in_group = rs < rows_total
    g = tl.where(in_group, rs // n, 0).to(tl.int32)
    start = g.to(tl.int64) * n
    return g, in_group, rs, start, tl.zeros_like(rs) + n, start


@triton.jit
def columns(k0, K, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """The BK columns from k0 and which of them are < K (all, with EVEN_K: K % BK == 0)."""
    ks = k0 + tl.arange(0, BK)
    if EVEN_K:
        return ks, tl.full((BK,), 1, tl.int1)
    return ks, ks < K


@triton.jit
def token_rows(start, local0, size, in_group, j: tl.constexpr):
    """Token j of each run: (source row (R,), row valid (R,))."""
    local = local0 + j
    return start + local, in_group & (local < size)


@triton.jit
def load_rows(x_ptr, src, ok, K, ks, k_ok):
    """Rows `src` of x at columns ks as fp32 (R, BK); invalid rows read as zeros."""
    x = tl.load(x_ptr + src[:, None] * K + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
    return to_float32(x)


@triton.jit
def load_token(x_ptr, start, local0, size, in_group, j: tl.constexpr, K, ks, k_ok):
    """Token j of each run as fp32 (R, BK); rows past a group's end read as zeros.

    Only for values: where a kernel stores at a token's row, it takes the row from
    ``token_rows`` and the values from ``load_rows``. Traced by torch.compile, a launch's
    written tensors come from torch's analysis of the kernel's IR, which follows store
    addresses back through helper calls and counts every pointer a helper was passed as
    written -- here x, which torch would then copy before each launch (and copy back into
    a weight: a mutated input, which stops CUDA graphs). For the same reason kernels load
    group sizes and offsets themselves rather than in helpers."""
    src, ok = token_rows(start, local0, size, in_group, j)
    return load_rows(x_ptr, src, ok, K, ks, k_ok)


@triton.jit
def fold_run_amax(x_ptr, start, local0, size, in_group, K, ks, k_ok, sign_mask, acc_pre, acc_post,
                  PRE: tl.constexpr, POST: tl.constexpr):
    """Load the 16 token tiles (R, BK) of R runs at columns ks (``load_token``) and fold
    them into running elementwise maxima: |x| into acc_pre (if PRE), |FWHT(s * x)| into
    acc_post (if POST). acc_post holds *unrounded* FWHT outputs: the post-RHT amax is
    ``rht_round`` of its max, applied once by the caller."""
    x0 = load_token(x_ptr, start, local0, size, in_group, 0, K, ks, k_ok)
    x1 = load_token(x_ptr, start, local0, size, in_group, 1, K, ks, k_ok)
    x2 = load_token(x_ptr, start, local0, size, in_group, 2, K, ks, k_ok)
    x3 = load_token(x_ptr, start, local0, size, in_group, 3, K, ks, k_ok)
    x4 = load_token(x_ptr, start, local0, size, in_group, 4, K, ks, k_ok)
    x5 = load_token(x_ptr, start, local0, size, in_group, 5, K, ks, k_ok)
    x6 = load_token(x_ptr, start, local0, size, in_group, 6, K, ks, k_ok)
    x7 = load_token(x_ptr, start, local0, size, in_group, 7, K, ks, k_ok)
    x8 = load_token(x_ptr, start, local0, size, in_group, 8, K, ks, k_ok)
    x9 = load_token(x_ptr, start, local0, size, in_group, 9, K, ks, k_ok)
    x10 = load_token(x_ptr, start, local0, size, in_group, 10, K, ks, k_ok)
    x11 = load_token(x_ptr, start, local0, size, in_group, 11, K, ks, k_ok)
    x12 = load_token(x_ptr, start, local0, size, in_group, 12, K, ks, k_ok)
    x13 = load_token(x_ptr, start, local0, size, in_group, 13, K, ks, k_ok)
    x14 = load_token(x_ptr, start, local0, size, in_group, 14, K, ks, k_ok)
    x15 = load_token(x_ptr, start, local0, size, in_group, 15, K, ks, k_ok)
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
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = fwht16(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, sign_mask)
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
    return acc_pre, acc_post


@triton.jit
def to_float32(x):
    """Exact widening to fp32. bf16 goes through its bits (<< 16): the interpreter's
    bf16 -> fp32 conversion gets subnormals wrong (1.01e-39 -> 4.4e-39, triton 3.9)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)
