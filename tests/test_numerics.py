"""nvfp4_inductor/numerics.py against docs/numerics.md section 2-4, bit for bit.

Expected bytes come from oracles written here, independent of the code under test:
  * ``hand_quantize``: the numerics.md 2 scale chain in Python floats, every fp32 operation
    rounded once with ``f32`` (struct), E4M3/E2M1 rounding from the enumerated tables of
    test_formats.py, stochastic rounding with exact Fractions.
  * ``hand_rht``: the butterfly order pinned in numerics' docstring, each fp32 add rounded
    with ``f32``, bf16 rounding done on the fp32 bit pattern; R is built from the numerics.md sign
    list and ``H[i][j] = (-1)^popcount(i & j)``.
  * ``philox_ref``: Philox4x32-10 written from the Random123 paper with Python ints, checked
    against Random123's known-answer vectors and against Triton's ``tl.philox`` run in the
    Triton interpreter (in a subprocess, so TRITON_INTERPRET never leaks into this process).
  * Grouped layouts are checked against ``quantize_torch`` of each group zero-padded to 16
    rows as a single tensor (the bitwise property numerics.md 4 promises), after ``quantize_torch``
    itself is pinned to ``hand_quantize`` above.
Pruned: no NaN/inf inputs (numerics.md leaves them undefined); shapes stay small so the whole
file runs in a few seconds on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from fractions import Fraction

import pytest
import torch

from _assertions import assert_bytes_equal, assert_nvfp4_equal, count_differing_bytes
from test_formats import (
    E2M1_GRID,
    E4M3_VALUE,
    FLT_MAX,
    e2m1_oracle,
    e2m1_value,
    e4m3_oracle,
    f32,
    f32_bits,
    f32_from_bits,
)
from nvfp4_inductor import numerics
from nvfp4_inductor.formats import unpack_fp4
from nvfp4_inductor.tensor import NVFP4GroupedTensor, NVFP4Tensor

INV6 = f32(1.0 / 6.0)
INV2688 = f32(1.0 / 2688.0)
SPEC_SIGNS = [+1, +1, +1, -1, +1, -1, -1, -1, -1, -1, -1, +1, -1, +1, -1, -1]  # numerics.md 3, verbatim
SPEC_MASK = 0xD7E8

# ---------------------------------------------------------------------------------------
# Oracle: the numerics.md 2 scale chain in Python floats


def s_enc_of(amax: float) -> float:
    """numerics.md 2.1: S_enc = min(fp32(2688 / A), FLT_MAX); 1 when A == 0."""
    return 1.0 if amax == 0 else min(f32(2688.0 / amax), FLT_MAX)


def hand_block_scale(block_amax: float, s_enc: float) -> tuple[int, float]:
    """numerics.md 2.1-2.3 -> (E4M3 scale code, fp32 encode multiplier)."""
    s_dec = f32(1.0 / s_enc)
    s = min(f32(block_amax * f32(s_enc * INV6)), FLT_MAX)
    code = e4m3_oracle(s)
    prod = f32(E4M3_VALUE[code] * s_dec)
    enc = FLT_MAX if prod == 0 else min(f32(1.0 / prod), FLT_MAX)
    return code, enc


def sr_oracle(v: float, rbyte: int) -> int:
    """Module docstring rule: between grid neighbours lo < hi, round up iff
    (|v| - lo) * 256 / (hi - lo) > r + 0.5; exact in Fractions."""
    a = abs(v)
    lo_i = max(i for i, g in enumerate(E2M1_GRID) if g <= a)
    if lo_i == 7:
        code = 7
    else:
        lo, hi = E2M1_GRID[lo_i], E2M1_GRID[lo_i + 1]
        up = (Fraction(a) - Fraction(lo)) * 256 / Fraction(hi - lo) > rbyte + Fraction(1, 2)
        code = lo_i + int(up)
    return code | (8 if v < 0 else 0)


def hand_quantize(rows, amax, *, block_2d=False, rbytes=None):
    """Quantize a list of rows (fp32 Python floats) in 1x16 blocks along each row.

    amax: one float, or one per row. rbytes: per-element random bytes (lists) or None.
    Returns (packed data uint8 (R, C/2), scale float8_e4m3fn (R, C/16)) as tensors."""
    n_rows = len(rows)
    n_cols = len(rows[0]) if rows else 0
    amaxes = amax if isinstance(amax, (list, tuple)) else [amax] * n_rows
    data, scales = [], []
    for r, row in enumerate(rows):
        codes, row_scales = [], []
        for b in range(n_cols // 16):
            if block_2d:
                t0 = r // 16 * 16
                block_amax = max(abs(rows[t][c]) for t in range(t0, t0 + 16) for c in range(16 * b, 16 * b + 16))
            else:
                block_amax = max(abs(c) for c in row[16 * b : 16 * b + 16])
            scale, enc = hand_block_scale(block_amax, s_enc_of(amaxes[r]))
            row_scales.append(scale)
            for c in range(16 * b, 16 * b + 16):
                v = f32(row[c] * enc)
                v = max(-6.0, min(6.0, v)) if not math.isnan(v) else v
                codes.append(e2m1_oracle(v) if rbytes is None else sr_oracle(v, rbytes[r][c]))
        data.append([codes[2 * i] | codes[2 * i + 1] << 4 for i in range(n_cols // 2)])
        scales.append(row_scales)
    data_t = torch.tensor(data, dtype=torch.uint8).reshape(n_rows, n_cols // 2)
    scale_t = torch.tensor(scales, dtype=torch.uint8).reshape(n_rows, n_cols // 16).view(torch.float8_e4m3fn)
    return data_t, scale_t


def transpose(rows):
    return [list(col) for col in zip(*rows)]


def assert_copy(q_data, q_scale, expected, label):
    assert_bytes_equal(q_data, expected[0], f"{label} data")
    assert_bytes_equal(q_scale, expected[1], f"{label} scale")


def fp32_scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Oracle: RHT


def popcount(n: int) -> int:
    return bin(n).count("1")


def hand_r(signs) -> list[list[float]]:
    return [[signs[i] * (-1) ** popcount(i & j) * 0.25 for j in range(16)] for i in range(16)]


def bf16(x: float) -> float:
    """fp32 -> bf16 round to nearest even, on the bit pattern (finite inputs)."""
    bits = f32_bits(x)
    return f32_from_bits(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16)


def hand_rht16(v, signs) -> list[float]:
    """bf16(0.25 * FWHT(s * v)), butterflies of strides 1, 2, 4, 8, (a, b) -> (a + b, a - b)."""
    y = [f32(x * s) for x, s in zip(v, signs)]
    for h in (1, 2, 4, 8):
        for start in range(0, 16, 2 * h):
            for j in range(start, start + h):
                a, b = y[j], y[j + h]
                y[j], y[j + h] = f32(a + b), f32(a - b)
    return [bf16(f32(x * 0.25)) for x in y]


def hand_rht_rows(rows, signs):
    return [sum((hand_rht16(row[i : i + 16], signs) for i in range(0, len(row), 16)), []) for row in rows]


def signs_of(mask: int):
    return [-1 if mask >> i & 1 else 1 for i in range(16)]


# ---------------------------------------------------------------------------------------
# Oracle: Philox4x32-10 (Salmon et al., SC'11; Random123 philox.h)

_M32 = 0xFFFFFFFF


def philox_ref(key: tuple[int, int], ctr: tuple[int, int, int, int], rounds: int = 10):
    k0, k1 = key
    c0, c1, c2, c3 = ctr
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _M32, p1 & _M32, ((p0 >> 32) ^ c3 ^ k1) & _M32, p0 & _M32
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def sr_bytes_ref(seed: int, n_rows: int, n_cols: int, stream: int):
    """Module docstring layout: block index = row * (cols/16) + col // 16, counter
    (block, stream, 0, 0), key (seed lo, seed hi); element j of a block takes byte j % 4
    of word j // 4."""
    out = []
    for r in range(n_rows):
        row = []
        for b in range(n_cols // 16):
            words = philox_ref((seed & _M32, seed >> 32 & _M32), (r * (n_cols // 16) + b, stream, 0, 0))
            row += [words[j // 4] >> (8 * (j % 4)) & 0xFF for j in range(16)]
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------
# Inputs


def rand_bf16(m, k, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * scale).to(torch.bfloat16)


def rows_of(x: torch.Tensor):
    return x.float().tolist()


# =======================================================================================
# Scale chain on single blocks and small tensors (numerics.md 2)


def test_all_zero_tensor():
    x = torch.zeros(32, 32)
    x[3, 5] = -0.0
    q = numerics.quantize_torch(x, columnwise=True)
    for which in ("rowwise", "columnwise"):
        assert_bytes_equal(getattr(q, f"{which}_data"), torch.zeros(32, 16, dtype=torch.uint8), f"{which} data")
        assert_bytes_equal(
            getattr(q, f"{which}_scale"), torch.zeros(32, 2, dtype=torch.uint8).view(torch.float8_e4m3fn), which
        )
        assert_bytes_equal(getattr(q, f"{which}_amax"), fp32_scalar(0.0), f"{which} amax")
    assert_bytes_equal(q.dequantize(), torch.zeros(32, 32), "dequantize(all zero)")


def test_zero_amax_means_s_enc_1():
    """numerics.md 2.1: A == 0 gives S_enc = 1 (observable with a supplied amax of 0): the block
    scale is then e4m3(block_amax * fp32(1/6))."""
    x = torch.tensor([[3.0, -1.5, 0.25, 7.0] + [0.0] * 12, [0.001] * 16])
    q = numerics.quantize_torch(x, rowwise_amax=fp32_scalar(0.0))
    assert q.rowwise_scale.view(torch.uint8)[:, 0].tolist() == [
        e4m3_oracle(f32(7.0 * INV6)),
        e4m3_oracle(f32(f32(0.001) * INV6)),
    ]
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows_of(x), 0.0), "supplied amax 0")


def test_zero_block_in_nonzero_tensor():
    x = torch.zeros(16, 48)
    x[:, 16:32] = torch.linspace(-3, 5, 256).reshape(16, 16)
    x[2, 40] = -0.0
    q = numerics.quantize_torch(x)
    assert (q.rowwise_scale.view(torch.uint8)[:, [0, 2]] == 0).all()
    assert (unpack_fp4(q.rowwise_data)[:, list(range(16)) + list(range(32, 48))] == 0).all()
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows_of(x), 5.0), "zero blocks")


def test_underflow_trap_codes_6():
    """numerics.md 2.5: a non-zero block whose scale underflows to 0 gets enc = FLT_MAX, so its
    fp32-normal elements are coded +-6 (codes 7 / 15) and dequantize to 0."""
    block = [1.0, -1.0, 0.5, -2e-3, 3e-38, -1.2e-38, 0.0, -0.0, 1e-39, 1e-45, 7.0, -0.02, 1.5, 2.0, -3.0, 0.1]
    # block amax 7 under a global amax of 1e7: s = 7 * 448 / 1e7 = 3.1e-4 < 2**-10 -> scale 0
    x = torch.tensor([[1e7] + [0.0] * 15 + block], dtype=torch.float32)
    q = numerics.quantize_torch(x)
    assert q.rowwise_scale.view(torch.uint8)[0, 1].item() == 0
    codes = unpack_fp4(q.rowwise_data)[0, 16:].tolist()
    for value, code in zip(block, codes):
        if abs(value) >= 6 / FLT_MAX:  # |value| * FLT_MAX >= 6 -> clamp -> +-6 (all but the tiniest)
            assert code == (15 if value < 0 else 7), (value, code)
        elif value == 0:
            assert code == 0, (value, code)
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows_of(x), 1e7), "underflow trap")
    deq = q.dequantize()[0, 16:]
    assert (deq == 0).all(), deq


S_ENC_AMAXES = [40.0, 3.0, 7.0, 0.1, 1 / 3, 12345.678, 1e-30, 3e38] + [f32(1.0 + i / 97) for i in range(97)]


def test_global_encode_scale_true_division():
    """numerics.md 2.1: S_enc = fp32(2688 / A), one correctly rounded fp32 division."""
    amax = torch.tensor([f32(a) for a in S_ENC_AMAXES], dtype=torch.float32)
    expected = torch.tensor([s_enc_of(a) for a in amax.tolist()], dtype=torch.float32)
    assert_bytes_equal(numerics.global_encode_scale(amax), expected, "S_enc = fp32(2688 / A)")


def test_global_encode_scale_zero_and_overflow():
    got = numerics.global_encode_scale(torch.tensor([0.0, 1e-40, 1.4e-45, 2688.0, 1344.0]))
    expected = torch.tensor([1.0, FLT_MAX, FLT_MAX, 1.0, 2.0])
    assert_bytes_equal(got, expected, "S_enc: A == 0 -> 1, overflow -> FLT_MAX, exact quotients")


def test_scale_tie_under_amax_40():
    """Minimal consequence of the S_enc bug: A = 40, block amax 1.875. numerics.md 2: S_enc =
    fp32(2688/40) = 67.19999695, m = fp32(S_enc * fp32(1/6)) = 11.2 (fp32), s = 1.875 * m =
    21.0 exactly: the E4M3 tie between 20 (0x5A) and 22 (0x5B) goes to the even code 0x5A.
    With S_enc = 67.20000458, s = 21.0000019 and the scale becomes 0x5B."""
    x = torch.tensor([[40.0] + [0.0] * 15, [1.875] + [0.0] * 15])
    assert hand_block_scale(1.875, s_enc_of(40.0))[0] == 0x5A
    q = numerics.quantize_torch(x)
    assert q.rowwise_scale.view(torch.uint8)[1, 0].item() == 0x5A
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows_of(x), 40.0), "A = 40 tie")


AMAX_CASES = [1.0, 3.0, 6.0, 7.0, 0.1, 1 / 3, 448.0, 2688.0, 12345.678, 1e-30, 1e-20, 1e10, 1e30, 3e38]


@pytest.mark.parametrize("amax", AMAX_CASES, ids=[repr(a) for a in AMAX_CASES])
def test_saturation_amax_block_gets_448(amax):
    """numerics.md 2.5: the block holding the global amax gets scale 448 (0x7E) and its max
    element code 6 (7 or 15)."""
    amax = f32(amax)
    for sign in (1.0, -1.0):
        row = [amax * 0.3, 0.0] * 8 + [amax * 0.01] * 15 + [sign * amax]
        x = torch.tensor([row], dtype=torch.float32)
        q = numerics.quantize_torch(x)
        assert q.rowwise_amax.item() == amax
        assert q.rowwise_scale.view(torch.uint8)[0, 1].item() == 0x7E
        assert unpack_fp4(q.rowwise_data)[0, 31].item() == (15 if sign < 0 else 7)
        assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize([[f32(v) for v in row]], amax), f"amax {amax}")


@pytest.mark.parametrize("amax", [1e-37, 1e-40, 1.4e-45], ids=["1e-37", "1e-40", "min_subnormal"])
def test_tiny_amax_s_enc_clamped_to_flt_max(amax):
    """2688 / A overflows fp32: S_enc = FLT_MAX, and the chain still matches numerics.md 2."""
    amax = f32(amax)
    row = [amax, -amax / 2] + [0.0] * 14
    x = torch.tensor([row], dtype=torch.float32)
    q = numerics.quantize_torch(x)
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows_of(x), amax), f"tiny amax {amax}")


def test_subnormal_scales():
    """Blocks whose scale lands in E4M3's subnormal range (multiples of 2**-9 below 2**-6),
    across both ends: s = block_amax * 448 / 1e5 spans 0 (s <= 2**-10), every subnormal
    code, and the first normal code 0x08."""
    outlier = 1e5
    bamaxes = [0.10, 0.22, 0.4, 0.8, 1.0, 1.3, 1.6, 2.0, 2.3, 2.6, 3.0, 3.3, 3.45, 3.6]
    rows = []
    for i, bamax in enumerate(bamaxes):
        gen = torch.Generator().manual_seed(i)
        vals = (torch.rand(16, generator=gen) * 2 - 1) * bamax
        vals[i % 16] = bamax
        rows.append([outlier] + [0.0] * 15 + [f32(v) for v in vals.tolist()])
    x = torch.tensor(rows, dtype=torch.float32)
    expected = hand_quantize(rows_of(x), outlier)
    codes = set(expected[1].view(torch.uint8)[:, 1].tolist())
    assert set(range(0, 9)) <= codes, f"test should cover scale codes 0..8, covers {sorted(codes)}"
    q = numerics.quantize_torch(x)
    assert_copy(q.rowwise_data, q.rowwise_scale, expected, "subnormal scales")


def test_outliers_within_block():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, generator=gen)
    x[3, 7] = 500.0
    x[10, 40] = -2000.0
    x[20, 17] = 1e-3
    x[31, 63] = 80.0
    q = numerics.quantize_torch(x, columnwise=True)
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows_of(x), 2000.0), "outliers rowwise")
    assert_copy(
        q.columnwise_data, q.columnwise_scale, hand_quantize(transpose(rows_of(x)), 2000.0), "outliers columnwise"
    )


@dataclasses.dataclass(frozen=True)
class ChainCase:
    name: str
    m: int
    k: int
    seed: int
    scale: float
    dtype: torch.dtype


CHAIN_CASES = [
    ChainCase("single_block", 1, 16, 0, 1.0, torch.float32),
    ChainCase("aligned_bf16", 16, 64, 1, 3.0, torch.bfloat16),
    ChainCase("tall_fp32", 48, 16, 2, 1e-3, torch.float32),
    ChainCase("wide_bf16_large", 16, 128, 3, 1e4, torch.bfloat16),
]


@pytest.mark.parametrize("case", CHAIN_CASES, ids=[c.name for c in CHAIN_CASES])
def test_quantize_matches_hand_chain(case):
    """quantize_torch == the numerics.md 2 chain in Python floats, both copies (no RHT)."""
    gen = torch.Generator().manual_seed(case.seed)
    x = (torch.randn(case.m, case.k, generator=gen) * case.scale * torch.exp2(torch.randint(-4, 4, (case.m, 1), generator=gen))).to(case.dtype)
    rows = rows_of(x)
    amax = max(abs(v) for row in rows for v in row)
    q = numerics.quantize_torch(x, columnwise=case.m % 16 == 0)
    assert_bytes_equal(q.rowwise_amax, fp32_scalar(amax), "rowwise amax")
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows, amax), f"{case.name} rowwise")
    if case.m % 16 == 0:
        assert_bytes_equal(q.columnwise_amax, fp32_scalar(amax), "columnwise amax (no RHT)")
        assert_copy(q.columnwise_data, q.columnwise_scale, hand_quantize(transpose(rows), amax), f"{case.name} colwise")


@pytest.mark.parametrize("factor", [2.0, 1.7, 0.25, 0.5], ids=["2x", "1.7x", "quarter", "half"])
def test_supplied_amax(factor):
    """rowwise_amax / columnwise_amax replace the computed amax: a larger one shrinks the
    scales as predicted, a smaller one saturates scales at 448 and codes at +-6."""
    x = rand_bf16(32, 32, seed=9)
    rows = rows_of(x)
    true_amax = max(abs(v) for row in rows for v in row)
    supplied = f32(true_amax * factor)
    q = numerics.quantize_torch(
        x, columnwise=True, rowwise_amax=fp32_scalar(supplied), columnwise_amax=fp32_scalar(supplied * 1.5)
    )
    assert_bytes_equal(q.rowwise_amax, fp32_scalar(supplied), "rowwise amax is the supplied one")
    assert_bytes_equal(q.columnwise_amax, fp32_scalar(f32(supplied * 1.5)), "columnwise amax is the supplied one")
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows, supplied), f"supplied rowwise amax x{factor}")
    assert_copy(
        q.columnwise_data,
        q.columnwise_scale,
        hand_quantize(transpose(rows), f32(supplied * 1.5)),
        f"supplied columnwise amax x{factor}",
    )
    ref = numerics.quantize_torch(x)
    n_six = lambda d: int(((unpack_fp4(d) & 7) == 7).sum())  # noqa: E731
    if factor < 1:
        assert (q.rowwise_scale.view(torch.uint8) == 0x7E).sum() > (ref.rowwise_scale.view(torch.uint8) == 0x7E).sum()
        assert n_six(q.rowwise_data) > n_six(ref.rowwise_data)
    else:
        assert (q.rowwise_scale.view(torch.uint8) == 0x7E).sum() == 0


def test_supplied_rowwise_amax_used_by_columnwise_without_rht():
    x = rand_bf16(32, 16, seed=4)
    rows = rows_of(x)
    supplied = 10.0
    q = numerics.quantize_torch(x, columnwise=True, rowwise_amax=fp32_scalar(supplied))
    assert_bytes_equal(q.columnwise_amax, fp32_scalar(supplied), "columnwise amax")
    assert_copy(q.columnwise_data, q.columnwise_scale, hand_quantize(transpose(rows), supplied), "columnwise")


def test_dequantize_order_and_values():
    """NVFP4Tensor.dequantize: (float(s) * A) * fp32(1/2688), then times the E2M1 value."""
    x = rand_bf16(16, 32, seed=21, scale=37.0)
    q = numerics.quantize_torch(x, columnwise=True)
    for which in ("rowwise", "columnwise"):
        data = unpack_fp4(getattr(q, f"{which}_data")).tolist()
        scale = getattr(q, f"{which}_scale").view(torch.uint8).tolist()
        a = getattr(q, f"{which}_amax").item()
        expected = [
            [f32(f32(f32(E4M3_VALUE[scale[r][c // 16]] * a) * INV2688) * e2m1_value(code)) for c, code in enumerate(row)]
            for r, row in enumerate(data)
        ]
        assert_bytes_equal(q.dequantize(columnwise=which == "columnwise"), torch.tensor(expected), f"{which} dequantize")


# =======================================================================================
# 2D 16x16 tiles


def test_block_2d_one_scale_per_tile():
    x = rand_bf16(32, 48, seed=8)
    x[5, 33] = 9.0  # a tile whose amax sits in one row only
    rows = rows_of(x)
    amax = max(abs(v) for row in rows for v in row)
    q = numerics.quantize_torch(x, columnwise=True, block_2d=True)
    scale = q.rowwise_scale.view(torch.uint8)
    assert_bytes_equal(scale, scale[::16].repeat_interleave(16, dim=0), "scale repeated on the tile's 16 rows")
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows, amax, block_2d=True), "2D rowwise")
    # 1x16 would give row 5 alone the larger scale: the tile scale must differ from it
    assert not torch.equal(scale, numerics.quantize_torch(x).rowwise_scale.view(torch.uint8))


def test_block_2d_columnwise_is_transpose():
    x = rand_bf16(48, 32, seed=12, scale=5.0)
    q = numerics.quantize_torch(x, columnwise=True, block_2d=True)
    assert_bytes_equal(unpack_fp4(q.columnwise_data), unpack_fp4(q.rowwise_data).t().contiguous(), "2D codes^T")
    row_tiles = q.rowwise_scale.view(torch.uint8)[::16]  # (M/16, K/16)
    col_tiles = q.columnwise_scale.view(torch.uint8)[::16]  # (K/16, M/16)
    assert_bytes_equal(col_tiles, row_tiles.t().contiguous(), "2D tile scales^T")
    col_scale = q.columnwise_scale.view(torch.uint8)
    assert_bytes_equal(col_scale, col_scale[::16].repeat_interleave(16, dim=0), "columnwise scale repeated")
    assert_bytes_equal(q.columnwise_amax, q.rowwise_amax, "amax")


# =======================================================================================
# RHT (numerics.md 3)


def test_spec_sign_vector_is_mask_0xd7e8():
    mask = sum(1 << i for i, s in enumerate(SPEC_SIGNS) if s == -1)
    assert mask == SPEC_MASK
    assert numerics.rht_signs(SPEC_MASK).tolist() == [float(s) for s in SPEC_SIGNS]


@pytest.mark.parametrize("mask", [SPEC_MASK, 0], ids=["0xD7E8", "mask0"])
def test_rht_matrix_is_diag_s_h_quarter(mask):
    signs = SPEC_SIGNS if mask == SPEC_MASK else [1] * 16
    r = numerics.rht_matrix(mask)
    assert r.dtype == torch.bfloat16 and r.shape == (16, 16)
    assert_bytes_equal(r, torch.tensor(hand_r(signs), dtype=torch.bfloat16), f"rht_matrix(0x{mask:04X})")


@pytest.mark.parametrize("mask", [SPEC_MASK, 0, 0xFFFF, 0x1234], ids=["0xD7E8", "mask0", "0xFFFF", "0x1234"])
def test_rht_matrix_orthogonal(mask):
    r = numerics.rht_matrix(mask).double()
    assert torch.equal(r @ r.t(), torch.eye(16, dtype=torch.float64))


@pytest.mark.parametrize("mask", [SPEC_MASK, 0], ids=["0xD7E8", "mask0"])
def test_rht16_equals_bf16_matmul_small_integers(mask):
    """On small integers every fp32 sum is exact, so any order gives bf16(v @ R)."""
    gen = torch.Generator().manual_seed(mask)
    v = torch.randint(-64, 65, (8, 48), generator=gen).to(torch.bfloat16)
    r = torch.tensor(hand_r(signs_of(mask)), dtype=torch.float64)
    expected = (v.double().reshape(8, 3, 16) @ r).reshape(8, 48).float().to(torch.bfloat16)
    got = numerics.rht16(v, mask)
    assert got.dtype == torch.bfloat16 and got.shape == v.shape
    assert_bytes_equal(got, expected, f"rht16 vs bf16(v @ R), mask 0x{mask:04X}")


def _adversarial_rows(n, seed):
    """bf16 values with exponents spread over 2**-30 .. 2**30: fp32 sums lose bits, so the
    order of the additions shows in the result."""
    gen = torch.Generator().manual_seed(seed)
    mant = torch.randint(128, 256, (n, 16), generator=gen).float() / 128
    exps = torch.randint(-30, 31, (n, 16), generator=gen).float()
    exps = torch.where(torch.rand(n, 16, generator=gen) < 0.5, exps, torch.randint(-2, 3, (n, 16), generator=gen).float())
    sign = torch.where(torch.rand(n, 16, generator=gen) < 0.5, -1.0, 1.0)
    v = (sign * mant * torch.exp2(exps)).to(torch.bfloat16)
    # exact cancellations: pairs x, -x a stride apart with a tiny value in between
    v[: n // 4, 8:] = -v[: n // 4, :8]
    v[: n // 4, 3] = 2.0**-20
    return v


@pytest.mark.parametrize("mask", [SPEC_MASK, 0], ids=["0xD7E8", "mask0"])
def test_rht16_pinned_butterfly_order_adversarial(mask):
    v = _adversarial_rows(256, seed=mask + 1)
    signs = signs_of(mask)
    expected = [hand_rht16(row, signs) for row in v.float().tolist()]
    # teeth: a left-to-right dot product (another legal order) differs on these inputs
    r = hand_r(signs)
    sequential_differs = 0
    for row, exp_row in zip(v.float().tolist(), expected):
        for j in range(16):
            acc = 0.0
            for i in range(16):
                acc = f32(acc + f32(row[i] * r[i][j]))
            sequential_differs += bf16(acc) != exp_row[j]
    assert sequential_differs > 0, "adversarial inputs do not distinguish summation orders"
    got = numerics.rht16(v, mask)
    assert_bytes_equal(got, torch.tensor(expected, dtype=torch.bfloat16), f"rht16 butterfly order, mask 0x{mask:04X}")


def test_rht_columnwise_uses_post_rht_amax():
    """Column-wise RHT copy: RHT along tokens in runs of 16, amax max|RHT(x^T)|; the
    row-wise copy is untransformed with the pre-RHT amax."""
    x = rand_bf16(32, 32, seed=31)
    x[7, 3] = 36.0  # a spike: the RHT spreads it, so the post-RHT amax is ~ 36/4
    # (40.0 here trips the S_enc rounding bug pinned by test_global_encode_scale_true_division)
    rows = rows_of(x)
    pre = max(abs(v) for row in rows for v in row)
    xt_rht = hand_rht_rows(transpose(rows), SPEC_SIGNS)
    post = max(abs(v) for row in xt_rht for v in row)
    assert post != pre
    q = numerics.quantize_torch(x, columnwise=True, rht=True, sign_mask=SPEC_MASK)
    assert_bytes_equal(q.rowwise_amax, fp32_scalar(pre), "rowwise amax (pre-RHT)")
    assert_bytes_equal(q.columnwise_amax, fp32_scalar(post), "columnwise amax (post-RHT)")
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows, pre), "rowwise (never transformed)")
    assert_copy(q.columnwise_data, q.columnwise_scale, hand_quantize(xt_rht, post), "columnwise RHT")


def test_rht_mask0_is_plain_hadamard_quarter():
    x = rand_bf16(16, 16, seed=2)
    q = numerics.quantize_torch(x, rowwise=False, columnwise=True, rht=True, sign_mask=0)
    xt_rht = hand_rht_rows(transpose(rows_of(x)), [1] * 16)
    post = max(abs(v) for row in xt_rht for v in row)
    assert_copy(q.columnwise_data, q.columnwise_scale, hand_quantize(xt_rht, post), "columnwise RHT mask 0")
    assert q.rowwise_data is None and q.rowwise_scale is None and q.rowwise_amax is None


def test_rht_dw_equals_untransformed_product():
    """Property: dW = dY^T X from RHT'd column-wise copies (R per 16-token block on both
    operands, R R^T = I) matches the fp64 product to within quantization error.

    Bound: each operand's NVFP4 relative (Frobenius) error is ~0.1 on Gaussian data (E2M1
    half-steps of 1/12..1/6 of the block scale, plus E4M3 scale rounding); the product's
    relative error is then below ~0.15 for these sizes: 0.2 leaves margin. Dropping the
    RHT on one operand gives a relative error of ~1.4, so the test has teeth."""
    m, n, k = 64, 32, 48
    for seed in range(3):
        dy = rand_bf16(m, n, seed=100 + seed)
        x = rand_bf16(m, k, seed=200 + seed)
        exact = dy.double().t() @ x.double()
        qdy = numerics.quantize_torch(dy, rowwise=False, columnwise=True, rht=True)
        qx = numerics.quantize_torch(x, rowwise=False, columnwise=True, rht=True)
        dw = qdy.dequantize(columnwise=True).double() @ qx.dequantize(columnwise=True).double().t()
        rel = ((dw - exact).norm() / exact.norm()).item()
        assert rel < 0.2, f"seed {seed}: relative error {rel:.3f} (m={m}, n={n}, k={k})"
        qx_plain = numerics.quantize_torch(x, rowwise=False, columnwise=True, rht=False)
        wrong = qdy.dequantize(columnwise=True).double() @ qx_plain.dequantize(columnwise=True).double().t()
        assert ((wrong - exact).norm() / exact.norm()).item() > 0.8


# =======================================================================================
# Grouped quantization (numerics.md 4)


@dataclasses.dataclass(frozen=True)
class GroupCase:
    name: str
    sizes: tuple[int, ...]
    k: int = 32


GROUP_CASES = [
    GroupCase("aligned", (16, 32, 16)),
    GroupCase("odd_sizes", (5, 17, 1, 30)),
    GroupCase("empty_front", (0, 20, 12)),
    GroupCase("empty_middle", (7, 0, 9)),
    GroupCase("empty_end", (16, 9, 0)),
    GroupCase("all_empty_but_one", (0, 0, 23, 0)),
    GroupCase("single_group", (40,), k=16),
    GroupCase("moe_like", (37, 0, 64, 3, 18, 70, 1, 63), k=64),
]
# pruned: zero tokens in total (no shapes in numerics.md) and huge K (covered by test_quantize_matches_hand_chain)


def _pad16(x: torch.Tensor) -> torch.Tensor:
    rows = -(-x.shape[0] // 16) * 16
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def _group_input(case: GroupCase, seed: int) -> torch.Tensor:
    x = rand_bf16(sum(case.sizes), case.k, seed=seed)
    # give the groups very different magnitudes so a shared amax would show
    starts = [sum(case.sizes[:g]) for g in range(len(case.sizes))]
    for g, (s, m) in enumerate(zip(starts, case.sizes)):
        x[s : s + m] *= 4.0**g
    return x


@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
@pytest.mark.parametrize("case", GROUP_CASES, ids=[c.name for c in GROUP_CASES])
def test_grouped_equals_per_group_quantize(case, rht):
    """Each group's row-wise rows equal quantize_torch of its rows; its column-wise chunk
    equals quantize_torch of its rows zero-padded to 16 as one tensor; amaxes per group
    (0 for an empty group); offsets and capacity as documented."""
    x = _group_input(case, seed=len(case.sizes) + 7 * rht)
    sizes = torch.tensor(case.sizes, dtype=torch.int64)
    q = numerics.group_quantize_torch(x, sizes, columnwise=True, rht=rht)
    t, g_count = x.shape[0], len(case.sizes)
    padded = [-(-m // 16) * 16 for m in case.sizes]
    offsets = [sum(padded[:g]) for g in range(g_count + 1)]
    assert_bytes_equal(q.columnwise_offsets, torch.tensor(offsets, dtype=torch.int64), "columnwise_offsets")
    assert_bytes_equal(q.group_sizes, sizes, "group_sizes")
    capacity = -(-(t + 15 * g_count) // 16) * 16
    assert q.columnwise_data.shape == (case.k, capacity // 2) and q.columnwise_scale.shape == (case.k, capacity // 16)
    assert q.rowwise_data.shape == (t, case.k // 2) and q.rowwise_scale.shape == (t, case.k // 16)
    assert offsets[-1] <= capacity
    chunks = q.columnwise_chunks()
    start = 0
    for g, m in enumerate(case.sizes):
        xg = x[start : start + m]
        rows = rows_of(xg)
        row_amax = max((abs(v) for row in rows for v in row), default=0.0)
        assert_bytes_equal(q.rowwise_amax[g], fp32_scalar(row_amax), f"group {g} rowwise amax")
        col_data, col_scale = chunks[g]
        assert col_data.shape == (case.k, padded[g] // 2)
        if m == 0:
            assert_bytes_equal(q.columnwise_amax[g], fp32_scalar(0.0), f"empty group {g} columnwise amax")
            start += m
            continue
        ref = numerics.quantize_torch(_pad16(xg), rowwise=False, columnwise=True, rht=rht)
        assert_bytes_equal(q.columnwise_amax[g], ref.columnwise_amax, f"group {g} columnwise amax")
        assert_copy(col_data, col_scale, (ref.columnwise_data, ref.columnwise_scale), f"group {g} columnwise")
        ref_row = numerics.quantize_torch(xg)
        assert_copy(
            q.rowwise_data[start : start + m],
            q.rowwise_scale[start : start + m],
            (ref_row.rowwise_data, ref_row.rowwise_scale),
            f"group {g} rowwise",
        )
        start += m


def test_grouped_rowwise_pinned_to_hand_chain():
    """Anchor the per-group comparison to the independent oracle: grouped row-wise rows ==
    hand_quantize with each row's group amax; column-wise chunk == hand chain on the
    zero-padded, RHT'd group."""
    sizes = (5, 0, 19)
    x = _group_input(GroupCase("anchor", sizes, 16), seed=3)
    q = numerics.group_quantize_torch(x, torch.tensor(sizes), columnwise=True, rht=True)
    rows = rows_of(x)
    amaxes = [max(abs(v) for row in rows[0:5] for v in row), 0.0, max(abs(v) for row in rows[5:] for v in row)]
    row_amax = [amaxes[0]] * 5 + [amaxes[2]] * 19
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows, row_amax), "grouped rowwise")
    chunks = q.columnwise_chunks()
    for g, (lo, m) in ((0, (0, 5)), (2, (5, 19))):
        padded_rows = rows[lo : lo + m] + [[0.0] * 16] * (-m % 16)
        xt_rht = hand_rht_rows(transpose(padded_rows), SPEC_SIGNS)
        post = max(abs(v) for row in xt_rht for v in row)
        assert_bytes_equal(q.columnwise_amax[g], fp32_scalar(post), f"group {g} post-RHT amax")
        assert_copy(*chunks[g], hand_quantize(xt_rht, post), f"group {g} columnwise RHT")


def test_grouped_supplied_amax():
    sizes = (9, 0, 30)
    x = _group_input(GroupCase("supplied", sizes), seed=5)
    row_amax = torch.tensor([3.0, 0.0, 1e3])
    col_amax = torch.tensor([0.5, 7.0, 2e4])
    q = numerics.group_quantize_torch(
        x, torch.tensor(sizes), columnwise=True, rht=True, rowwise_amax=row_amax, columnwise_amax=col_amax
    )
    assert_bytes_equal(q.rowwise_amax, row_amax, "rowwise amax is the supplied one")
    assert_bytes_equal(q.columnwise_amax, col_amax, "columnwise amax is the supplied one")
    chunks = q.columnwise_chunks()
    start = 0
    for g, m in enumerate(sizes):
        if m:
            xg = x[start : start + m]
            ref = numerics.quantize_torch(
                _pad16(xg), columnwise=True, rht=True, rowwise_amax=row_amax[g], columnwise_amax=col_amax[g]
            )
            assert_copy(*chunks[g], (ref.columnwise_data, ref.columnwise_scale), f"group {g} columnwise")
            assert_copy(
                q.rowwise_data[start : start + m],
                q.rowwise_scale[start : start + m],
                (ref.rowwise_data[:m], ref.rowwise_scale[:m]),
                f"group {g} rowwise",
            )
        start += m


def test_grouped_without_rht_columnwise_reuses_supplied_rowwise_amax():
    sizes = (20, 12)
    x = _group_input(GroupCase("reuse", sizes), seed=6)
    row_amax = torch.tensor([50.0, 60.0])
    q = numerics.group_quantize_torch(x, torch.tensor(sizes), columnwise=True, rowwise_amax=row_amax)
    assert_bytes_equal(q.columnwise_amax, row_amax, "columnwise amax = supplied rowwise amax without RHT")


@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
def test_grouped_int32_and_int64_sizes_agree(rht):
    sizes = (5, 0, 17, 10)
    x = _group_input(GroupCase("dtypes", sizes), seed=8)
    q64 = numerics.group_quantize_torch(x, torch.tensor(sizes, dtype=torch.int64), columnwise=True, rht=rht)
    q32 = numerics.group_quantize_torch(x, torch.tensor(sizes, dtype=torch.int32), columnwise=True, rht=rht)
    assert isinstance(q32, NVFP4GroupedTensor)
    assert_nvfp4_equal(q32, q64, "int32 vs int64 group sizes")


def test_grouped_dequantize_rowwise():
    sizes = (7, 0, 25)
    x = _group_input(GroupCase("deq", sizes), seed=10)
    q = numerics.group_quantize_torch(x, torch.tensor(sizes))
    deq = q.dequantize()
    ref0 = numerics.quantize_torch(x[:7]).dequantize()
    ref2 = numerics.quantize_torch(x[7:]).dequantize()
    assert_bytes_equal(deq, torch.cat([ref0, ref2]), "grouped row-wise dequantize")


# =======================================================================================
# Stochastic rounding (numerics.md 4; numerics docstring)

PHILOX_KAT = [  # Random123 kat_vectors, philox4x32 10 rounds: counter, key -> output
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((_M32,) * 4, (_M32, _M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("ctr,key,out", PHILOX_KAT, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(ctr, key, out):
    assert philox_ref(key, ctr) == out  # the oracle itself
    seed = key[0] | key[1] << 32  # key word 0 = low 32 bits of the seed
    words = numerics.philox4x32(seed, torch.tensor([ctr[0]]), ctr[1], ctr[2], ctr[3])
    assert tuple(int(w.item()) for w in words) == out


def test_philox_matches_reference_on_many_counters():
    gen = torch.Generator().manual_seed(17)
    for seed in (0, 1, 2**32 - 1, 2**32, 0x299F31D0A4093822, 2**63 - 2):
        c0 = torch.cat([torch.arange(40), torch.randint(0, 2**32, (40,), generator=gen, dtype=torch.int64)])
        for c1 in (0, 1, 0xFFFFFFFF):
            words = numerics.philox4x32(seed, c0, c1, 5, 0xDEADBEEF)
            got = list(zip(*(w.tolist() for w in words)))
            expected = [philox_ref((seed & _M32, seed >> 32), (c, c1, 5, 0xDEADBEEF)) for c in c0.tolist()]
            assert got == expected, f"seed {seed:#x}, c1 {c1:#x}"


_TRITON_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch, triton, triton.language as tl

    @triton.jit
    def _philox_kernel(ctr_ptr, out_ptr, seed, N: tl.constexpr):
        i = tl.arange(0, N)
        c0 = tl.load(ctr_ptr + 4 * i + 0)
        c1 = tl.load(ctr_ptr + 4 * i + 1)
        c2 = tl.load(ctr_ptr + 4 * i + 2)
        c3 = tl.load(ctr_ptr + 4 * i + 3)
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
        tl.store(out_ptr + 4 * i + 0, r0.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 4 * i + 1, r1.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 4 * i + 2, r2.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 4 * i + 3, r3.to(tl.int32, bitcast=True))

    cases = json.loads(sys.stdin.read())
    results = []
    for seed, counters in cases:
        ctr = torch.tensor(counters, dtype=torch.int64)
        ctr = torch.where(ctr >= 2**31, ctr - 2**32, ctr).to(torch.int32)
        out = torch.empty_like(ctr)
        _philox_kernel[(1,)](ctr, out, seed, N=ctr.shape[0])
        results.append([[v & 0xFFFFFFFF for v in row] for row in out.tolist()])
    print(json.dumps(results))
    """
)


def test_philox_bit_identical_to_triton_interpreter():
    """numerics.philox4x32 == Triton's tl.philox (run under TRITON_INTERPRET=1 in a
    subprocess, so the interpreter setting stays out of this process)."""
    pytest.importorskip("triton", reason="needs Triton (for the tl.philox cross-check)")
    counters = [list(ctr) for ctr, _, _ in PHILOX_KAT] + [[b, s, 0, 0] for b in (0, 1, 2, 77, 2**31, 2**32 - 1) for s in (0, 1)]
    counters += [[0] * 4] * (32 - len(counters))  # tl.arange needs a power of 2
    seeds = [0, 1, 0x299F31D0A4093822, 2**63 - 1, 0x0123456789ABCDEF]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT],
        input=json.dumps([[s, counters] for s in seeds]),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    triton_words = json.loads(proc.stdout.strip().splitlines()[-1])
    for seed, words in zip(seeds, triton_words):
        c = torch.tensor(counters, dtype=torch.int64)
        ours = [numerics.philox4x32(seed, c[i : i + 1, 0], *c[i, 1:].tolist()) for i in range(len(counters))]
        ours = [[int(w.item()) for w in ws] for ws in ours]
        assert ours == words, f"seed {seed:#x}: numerics.philox4x32 != tl.philox"
        assert words[0] == [philox_ref((seed & _M32, seed >> 32), tuple(counters[0]))[i] for i in range(4)]
    # the pi vector's key is seed 0x299F31D0A4093822: Triton reproduces Random123 too
    assert tuple(triton_words[2][2]) == PHILOX_KAT[2][2]


def test_sr_random_bytes_layout():
    seed = 0x0123456789ABCDEF
    for stream in (0, 1):
        got = numerics.sr_random_bytes(seed, 3, 48, stream, "cpu")
        assert got.dtype == torch.uint8 and got.shape == (3, 48)
        assert_bytes_equal(got, torch.tensor(sr_bytes_ref(seed, 3, 48, stream), dtype=torch.uint8), f"stream {stream}")


@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
def test_sr_quantize_matches_hand_chain(rht):
    """Both copies with SR, bit for bit: row-wise bytes from stream 0 over the (M, K)
    blocks, column-wise bytes from stream 1 over the (K, M) blocks."""
    x = rand_bf16(32, 48, seed=40, scale=2.0)
    seed = 987654321
    q = numerics.quantize_torch(x, columnwise=True, rht=rht, stochastic_rounding=True, seed=seed)
    rows = rows_of(x)
    pre = max(abs(v) for row in rows for v in row)
    xt = hand_rht_rows(transpose(rows), SPEC_SIGNS) if rht else transpose(rows)
    post = max(abs(v) for row in xt for v in row)
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows, pre, rbytes=sr_bytes_ref(seed, 32, 48, 0)), "SR rowwise")
    assert_copy(
        q.columnwise_data, q.columnwise_scale, hand_quantize(xt, post, rbytes=sr_bytes_ref(seed, 48, 32, 1)), "SR colwise"
    )


def _unit_scale_rows(values, n_rows):
    """Rows whose block amax is 6 under a supplied amax of 2688: S_enc = S_dec = 1, block
    scale e4m3(6 * fp32(1/6)) = 1.0, enc = 1, so the scaled value v is x itself."""
    row = [6.0] + list(values)
    assert len(row) == 16 and max(abs(v) for v in row) == 6.0
    return torch.tensor([row] * n_rows, dtype=torch.float32)


def test_sr_grid_points_never_move():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, 6.0]
    x = _unit_scale_rows(grid, 256)
    q = numerics.quantize_torch(x, stochastic_rounding=True, seed=5, rowwise_amax=fp32_scalar(2688.0))
    assert (q.rowwise_scale.view(torch.uint8) == 0x38).all()  # scale 1.0
    expected = torch.tensor([[e2m1_oracle(v) for v in x[0].tolist()]] * 256, dtype=torch.uint8)
    assert_bytes_equal(unpack_fp4(q.rowwise_data), expected, "SR of grid points")


def test_sr_rounds_only_to_neighbours():
    gen = torch.Generator().manual_seed(2)
    vals = ((torch.rand(512, 15, generator=gen) * 12 - 6)).tolist()
    x = torch.cat([_unit_scale_rows(v, 1) for v in vals])
    q = numerics.quantize_torch(x, stochastic_rounding=True, seed=77, rowwise_amax=fp32_scalar(2688.0))
    codes = unpack_fp4(q.rowwise_data).tolist()
    for row, row_codes in zip(x.tolist(), codes):
        for v, code in zip(row, row_codes):
            a = abs(v)
            lo = max(g for g in E2M1_GRID if g <= a)
            hi = min(g for g in E2M1_GRID if g >= a)
            assert abs(e2m1_value(code)) in (lo, hi), (v, code)
            assert (code & 8 != 0) == (v < 0), (v, code)


def test_sr_unbiased():
    """Mean over 4096 independent draws (blocks of distinct Philox counters) of the
    dequantized value converges to x. Bound: |mean - x| <= step * (1/512 + 5 / (2 sqrt N)):
    the 8-bit comparison (|v| - lo) * 256 / step > r + 0.5 makes P(up) = ceil(256 f - 1/2) / 256,
    within 1/512 of the fractional position f; a Bernoulli mean over N draws has standard
    deviation <= step / (2 sqrt N), and 5 sigma keeps the false-failure rate negligible."""
    values = [0.1, 0.3, 0.7, 1.2, 1.3, 1.9, 2.2, 2.9, 3.3, 3.7, 4.2, 5.9, -0.1, -1.3, -4.5]
    n = 4096
    x = _unit_scale_rows([f32(v) for v in values], n)
    q = numerics.quantize_torch(x, stochastic_rounding=True, seed=2024, rowwise_amax=fp32_scalar(2688.0))
    mean = q.dequantize().double().mean(dim=0)[1:]
    for v, m in zip(x[0, 1:].tolist(), mean.tolist()):
        a = abs(v)
        step = min(g for g in E2M1_GRID if g > a) - max(g for g in E2M1_GRID if g <= a)
        bound = step * (1 / 512 + 5 / (2 * math.sqrt(n)))
        assert abs(m - v) <= bound, f"x={v}: mean {m:.5f}, |bias| {abs(m - v):.5f} > {bound:.5f} (N={n})"
    # teeth: round-to-nearest would be biased by far more than the bound for 0.1 (-> 0)
    rne = numerics.quantize_torch(x[:1], rowwise_amax=fp32_scalar(2688.0)).dequantize()[0, 1].item()
    assert abs(rne - 0.1) > 0.05


def test_sr_reproducible_under_manual_seed():
    x = rand_bf16(32, 32, seed=50)
    kwargs = dict(columnwise=True, rht=True, stochastic_rounding=True)
    torch.manual_seed(1234)
    a = numerics.quantize_torch(x, **kwargs, seed=numerics.draw_seed(x.device))
    torch.manual_seed(1234)
    b = numerics.quantize_torch(x, **kwargs, seed=numerics.draw_seed(x.device))
    assert_nvfp4_equal(a, b, "same torch.manual_seed")
    torch.manual_seed(4321)
    c = numerics.quantize_torch(x, **kwargs, seed=numerics.draw_seed(x.device))
    n_differ, n_total = count_differing_bytes(a.rowwise_data, c.rowwise_data)
    assert n_differ > n_total // 10, f"different seeds: only {n_differ} of {n_total} bytes differ"
    n_differ, n_total = count_differing_bytes(a.columnwise_data, c.columnwise_data)
    assert n_differ > n_total // 10


def test_a_quantizer_never_draws_its_own_seed():
    """Seeds are drawn in one place (the ops, through ``draw_seed``, which honours
    ``sr_per_rank``): stochastic rounding without a seed is an error here."""
    x = rand_bf16(32, 32, seed=51)
    with pytest.raises(ValueError, match="quantize_torch: stochastic_rounding=True needs a seed"):
        numerics.quantize_torch(x, stochastic_rounding=True)
    with pytest.raises(ValueError, match="group_quantize_torch: stochastic_rounding=True needs a seed"):
        numerics.group_quantize_torch(x, torch.tensor([32]), stochastic_rounding=True)


def test_draw_seed_is_a_device_value_with_the_host_draws_bits():
    """The seed stays a tensor on the data's device (a graph replays the draw, not a value);
    on the CPU it is the very number the former host draw gave, so no CPU bit moved."""
    torch.manual_seed(5)
    seed = numerics.draw_seed(torch.device("cpu"))
    torch.manual_seed(5)
    host = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    assert isinstance(seed, torch.Tensor) and seed.shape == () and seed.dtype == torch.int64
    assert int(seed) == host


def test_sr_tensor_seed_gives_the_int_seeds_bits():
    x = rand_bf16(48, 64, seed=52)
    sizes = torch.tensor([16, 0, 32])
    for seed in (1, 2**40 + 7, 2**63 - 2):
        kwargs = dict(columnwise=True, rht=True, stochastic_rounding=True)
        assert_nvfp4_equal(numerics.quantize_torch(x, **kwargs, seed=torch.tensor(seed)),
                           numerics.quantize_torch(x, **kwargs, seed=seed), f"seed {seed}")
        assert_nvfp4_equal(numerics.group_quantize_torch(x, sizes, **kwargs, seed=torch.tensor(seed)),
                           numerics.group_quantize_torch(x, sizes, **kwargs, seed=seed), f"grouped, seed {seed}")


def test_sr_explicit_seed_reproducible_and_distinct():
    x = rand_bf16(16, 64, seed=51)
    a = numerics.quantize_torch(x, stochastic_rounding=True, seed=1)
    b = numerics.quantize_torch(x, stochastic_rounding=True, seed=1)
    c = numerics.quantize_torch(x, stochastic_rounding=True, seed=2)
    assert_nvfp4_equal(a, b, "same seed")
    assert count_differing_bytes(a.rowwise_data, c.rowwise_data)[0] > 0


def test_sr_rowwise_and_columnwise_use_different_streams():
    """On a symmetric x, the row-wise and column-wise copies quantize the same matrix with
    the same amax: without SR they are equal; with SR they differ because their Philox
    streams (counter word 1) differ."""
    a = rand_bf16(32, 32, seed=60)
    x = (a.float() + a.float().t()).to(torch.bfloat16)
    assert torch.equal(x, x.t())
    plain = numerics.quantize_torch(x, columnwise=True)
    assert_bytes_equal(plain.columnwise_data, plain.rowwise_data, "RNE: symmetric copies equal")
    q = numerics.quantize_torch(x, columnwise=True, stochastic_rounding=True, seed=3)
    assert_bytes_equal(q.columnwise_scale, q.rowwise_scale, "same scales")
    n_differ, n_total = count_differing_bytes(q.columnwise_data, q.rowwise_data)
    assert n_differ > n_total // 10, f"SR copies share a stream: only {n_differ} of {n_total} bytes differ"


def test_sr_grouped_streams_and_layout():
    """Grouped SR: row-wise bytes over the (T, K) matrix (stream 0), column-wise over the
    padded (K, P) matrix (stream 1)."""
    sizes = (5, 11)
    x = _group_input(GroupCase("sr", sizes, 16), seed=61)
    seed = 31337
    q = numerics.group_quantize_torch(x, torch.tensor(sizes), columnwise=True, stochastic_rounding=True, seed=seed)
    rows = rows_of(x)
    amaxes = [max(abs(v) for row in rows[:5] for v in row), max(abs(v) for row in rows[5:] for v in row)]
    rb = sr_bytes_ref(seed, 16, 16, 0)
    assert_copy(q.rowwise_data, q.rowwise_scale, hand_quantize(rows, [amaxes[0]] * 5 + [amaxes[1]] * 11, rbytes=rb), "SR grouped rowwise")
    capacity = q.columnwise_data.shape[1] * 2
    zeros = [[0.0] * 16]
    padded = rows[:5] + zeros * 11 + rows[5:] + zeros * 5 + zeros * (capacity - 32)  # groups at 0 and 16
    cb = sr_bytes_ref(seed, 16, capacity, 1)
    expected = hand_quantize(transpose(padded[:capacity]), [amaxes[0]] * 16, rbytes=cb)
    col_data, col_scale = q.columnwise_chunks()[0]
    assert_copy(col_data, col_scale, (expected[0][:, :8], expected[1][:, :1]), "SR grouped columnwise group 0")
    expected1 = hand_quantize(transpose(padded[:capacity]), [amaxes[1]] * 16, rbytes=cb)
    col_data, col_scale = q.columnwise_chunks()[1]
    assert_copy(col_data, col_scale, (expected1[0][:, 8:16], expected1[1][:, 1:2]), "SR grouped columnwise group 1")


# =======================================================================================
# Properties on random inputs


def _half_step(a: float) -> float:
    return 0.25 if a < 2 else 0.5 if a < 4 else 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_roundtrip_error_bound(seed):
    """Per element, |deq(q(x)) - x| <= D * max(half grid step at |x|/D, |x|/D - 6) + 2**-20 |x|,
    D = (float(s) * A) / 2688 the block's dequantize factor: RNE onto the grid costs at most
    half a step (the steps are 0.5 / 1 / 2 on [0,2) / [2,4) / [4,6]); the E4M3 scale rounding
    (relative error <= 2**-4) can push the block max to 6 * (1 + 2**-4) / (1 - ...) which is
    clamped to 6; the fp32 roundings of enc, v and D add a few ulps. Consequently
    |err| <= D <= (1 + 2**-4) * block_amax / 6 for every element."""
    gen = torch.Generator().manual_seed(seed)
    m, k = 64, 128
    x = (torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-3, 4, (m, 1), generator=gen))).to(torch.bfloat16)
    q = numerics.quantize_torch(x)
    assert q.rowwise_data.shape == (m, k // 2) and q.rowwise_data.dtype == torch.uint8
    deq = q.dequantize().double()
    xd = x.double()
    a = q.rowwise_amax.item()
    s = torch.tensor([[E4M3_VALUE[c] for c in row] for row in q.rowwise_scale.view(torch.uint8).tolist()], dtype=torch.float64)
    d = (s * a / 2688).repeat_interleave(16, dim=1)
    assert (d > 0).all(), "test assumes no scale underflow"
    v = xd.abs() / d
    half = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    bound = d * torch.maximum(half, v - 6) + 2.0**-20 * xd.abs()
    err = (deq - xd).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"seed {seed}: error exceeds the bound by a factor {worst:.4f}"
    block_amax = xd.abs().reshape(m, k // 16, 16).amax(-1).repeat_interleave(16, dim=1)
    assert (err <= (1 + 2.0**-4) * block_amax / 6 * (1 + 2.0**-20)).all()
    rel = (err.norm() / xd.norm()).item()
    assert rel < 0.12, f"seed {seed}: relative Frobenius error {rel:.4f}"




def test_rht16_zero_tokens():
    assert numerics.rht16(torch.zeros(32, 0, dtype=torch.bfloat16), SPEC_MASK).shape == (32, 0)


def test_quantize_zero_tokens():
    q = numerics.quantize_torch(torch.zeros(0, 32, dtype=torch.bfloat16), columnwise=True, rht=True)
    assert q.rowwise_data.shape == (0, 16) and q.rowwise_scale.shape == (0, 2)
    assert q.columnwise_data.shape == (32, 0) and q.columnwise_scale.shape == (32, 0)
    assert_bytes_equal(q.rowwise_amax, fp32_scalar(0.0), "amax of an empty tensor")


def test_group_quantize_zero_tokens():
    """A micro-batch that routes no tokens: every group empty, amaxes 0, offsets 0."""
    q = numerics.group_quantize_torch(torch.zeros(0, 32, dtype=torch.bfloat16), torch.tensor([0, 0]), columnwise=True, rht=True)
    assert q.rowwise_data.shape == (0, 16)
    assert q.columnwise_data.shape == (32, 16)  # capacity round_up(0 + 15 * 2, 16) = 32
    assert_bytes_equal(q.rowwise_amax, torch.zeros(2), "rowwise amax")
    assert_bytes_equal(q.columnwise_amax, torch.zeros(2), "columnwise amax")
    assert_bytes_equal(q.columnwise_offsets, torch.zeros(3, dtype=torch.int64), "offsets")


SHAPE_CASES = [(16, 16), (32, 64), (48, 16), (16, 256), (128, 64)]


@pytest.mark.parametrize("m,k", SHAPE_CASES, ids=[f"{m}x{k}" for m, k in SHAPE_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_shapes_and_dtypes(m, k, dtype):
    x = rand_bf16(m, k, seed=m + k).to(dtype)
    q = numerics.quantize_torch(x, columnwise=True, rht=dtype == torch.bfloat16)
    assert isinstance(q, NVFP4Tensor)
    assert q.rowwise_data.shape == (m, k // 2) and q.rowwise_data.dtype == torch.uint8
    assert q.rowwise_scale.shape == (m, k // 16) and q.rowwise_scale.dtype == torch.float8_e4m3fn
    assert q.columnwise_data.shape == (k, m // 2) and q.columnwise_data.dtype == torch.uint8
    assert q.columnwise_scale.shape == (k, m // 16) and q.columnwise_scale.dtype == torch.float8_e4m3fn
    for amax in (q.rowwise_amax, q.columnwise_amax):
        assert amax.shape == () and amax.dtype == torch.float32
    assert q.dequantize().shape == (m, k) and q.dequantize(columnwise=True).shape == (k, m)
    only_col = numerics.quantize_torch(x, rowwise=False, columnwise=True)
    assert only_col.rowwise_data is None and only_col.rowwise_scale is None and only_col.rowwise_amax is None
    only_row = numerics.quantize_torch(x)
    assert only_row.columnwise_data is None and only_row.columnwise_scale is None and only_row.columnwise_amax is None


# =======================================================================================
# Helpers built on the quantizers (weight stacks, group Hadamard amax)


def test_quantize_weights_per_expert_2d():
    """Each expert of a (G, N, K) stack equals quantize_torch of that expert with 16x16
    tiles (both copies), with its own amax; the column-wise copy is the transpose."""
    g, n, k = 3, 32, 48
    w = torch.stack([rand_bf16(n, k, seed=80 + e, scale=4.0**e) for e in range(g)])
    q = numerics.quantize_weights_torch(w)
    assert q.rowwise_data.shape == (g, n, k // 2) and q.columnwise_data.shape == (g, k, n // 2)
    assert q.rowwise_scale.shape == (g, n, k // 16) and q.columnwise_scale.shape == (g, k, n // 16)
    for e in range(g):
        ref = numerics.quantize_torch(w[e], columnwise=True, block_2d=True)
        assert_bytes_equal(q.amax[e], ref.rowwise_amax, f"expert {e} amax")
        assert_copy(q.rowwise_data[e], q.rowwise_scale[e], (ref.rowwise_data, ref.rowwise_scale), f"expert {e} rowwise")
        assert_copy(
            q.columnwise_data[e], q.columnwise_scale[e], (ref.columnwise_data, ref.columnwise_scale), f"expert {e} colwise"
        )
        assert_bytes_equal(
            unpack_fp4(q.columnwise_data[e]), unpack_fp4(q.rowwise_data[e]).t().contiguous(), f"expert {e} codes^T"
        )


@pytest.mark.parametrize("mask", [SPEC_MASK, 0], ids=["0xD7E8", "mask0"])
def test_group_hadamard_amax_matches_group_quantize(mask):
    sizes = torch.tensor([9, 0, 33, 6])
    x = _group_input(GroupCase("hamax", tuple(sizes.tolist())), seed=90)
    pre, post = numerics.group_hadamard_amax_torch(x, sizes, mask)
    q = numerics.group_quantize_torch(x, sizes, columnwise=True, rht=True, sign_mask=mask)
    assert_bytes_equal(pre, q.rowwise_amax, "pre-RHT amax")
    assert_bytes_equal(post, q.columnwise_amax, "post-RHT amax")
