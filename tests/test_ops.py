"""The ``torch.ops.nvfp4.*`` ops: their numbers against oracles written here, and what
each op adds on top of the functions it runs (nvfp4_inductor/ops.py and the fused ops of
nvfp4_inductor/compiler/fused.py).

On the CPU every op runs the reference functions of ``numerics.py`` / ``activations.py``,
so none of those is used as an oracle here. The oracles:

* Known answers derived by hand from the numerics.md 2 scale chain, written out next to each
  case: ties of the E2M1 grid, the block holding the amax (scale 448), an all-zero block,
  a block whose scale underflows (codes +-6), E4M3 subnormal scales, 2D tiles, and an RHT
  input built so that the transformed values land on the E2M1 grid.
* Round-to-nearest as a property: each scale is the E4M3 value nearest to
  block_amax * 448 / A, and each element's code the grid point nearest to x / D,
  D = scale * A / 2688 (computed in fp64; E4M3 decoded by torch's float8 cast, E2M1 by
  a table written here). Either neighbour passes at a tie, which the known answers pin.
* RHT: R = diag(s) . H16 / 4 with H16 the 4-fold Kronecker power of [[1, 1], [1, -1]]
  and s the sign list of numerics.md 3 verbatim, applied in fp64 to inputs whose sums are exact.
* Stochastic rounding: codes only at the two grid neighbours; unbiased over many seeds
  (inputs at fractions k/256 of a step, where 8-bit SR is exactly unbiased) within 5
  sigma; the same ``torch.manual_seed`` gives the same bits.
* GEMMs: fp64 matmul of operands decoded here, per group, times alpha = A_a A_b / 2688^2,
  within bf16 rounding plus fp32 accumulation error.
* Activation and its backward: numerics.md 5 formulas in fp64 and ``torch.autograd``, within
  bf16 rounding; dprob within the fp32 error bound of its pinned summation order.
* The fused grouped-MLP ops equal, bit for bit, the chain of the ``nvfp4`` ops above
  (the fused ops' contract; the steps' numbers are pinned by the oracles above).

Op contract: ``torch.library.opcheck`` (schema, fake impl against the real one,
autograd registration, AOT dispatch with dynamic shapes; stochastic rounding off, as an
SR op draws a fresh seed on every call), absent copies as empty tensors with the fake
impl's dtypes, group-size errors naming the argument, compilation with fullgraph.

Cases cover empty groups, zero tokens and group sizes that are not multiples of 16;
shapes are tiny (G = 4, H/F = 32..64, T = 64..96) so the file runs in seconds on a CPU.
Pruned: CUDA (no device here); large shapes (nothing shape-specific beyond multiples of
16); gradcheck of the activation op's autograd formula (tests/test_activations.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

import nvfp4_inductor
from nvfp4_inductor.recipe import QuantizeOptions
from nvfp4_inductor.tensor import Operand
from _assertions import assert_bytes_equal

nvfp4 = torch.ops.nvfp4
MASK = 0xD7E8  # numerics.md 3's default sign mask
E4M3 = torch.float8_e4m3fn

# numerics.md 1: E2M1 code -> value (codes 8..15 are the negatives; 8 is -0)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float64)
GRID = torch.tensor(E2M1_GRID, dtype=torch.float64)
# every finite non-negative E4M3 value, decoded by torch's own float8 cast (0x7F is NaN)
E4M3_VALUES = torch.arange(0x7F, dtype=torch.uint8).view(E4M3).float().double()
# numerics.md 3, verbatim: the sign vector of mask 0xD7E8
SPEC_SIGNS = (+1, +1, +1, -1, +1, -1, -1, -1, -1, -1, -1, +1, -1, +1, -1, -1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _exact_values(gen, *shape, dtype=torch.bfloat16):
    """Multiples of 1/32 in (-4, 4) (7 significant bits): exact in bf16, and every fp32
    sum of 16 of them times 1/4 is exact, so fp64 here and fp32 in the op agree."""
    return (torch.randint(-127, 128, shape, generator=gen) / 32.0).to(dtype)


def _assert_tuple_equal(actual, expected, label):
    assert len(actual) == len(expected), f"{label}: {len(actual)} outputs, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bytes_equal(a, e, f"{label}[{i}]")


def _assert_close(actual, expected, tol, label):
    """|actual - expected| <= tol elementwise (fp64), with the worst element in the message."""
    err = (actual.double() - expected.double()).abs()
    bad = err > tol
    if bool(bad.any()):
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{label}: {int(bad.sum())} of {err.numel()} elements out of tolerance; first at {i}: "
                             f"actual {float(actual[i])!r}, expected {float(expected[i])!r}, tol {float(tol[i])!r}")


# ---------------------------------------------------------------------------------------
# Oracles: decoding, RHT, round-to-nearest


def _codes(data: torch.Tensor) -> torch.Tensor:
    """(..., N/2) packed bytes -> (..., N) codes, the even index in the low nibble (numerics.md 1)."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])


def _block_values(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e2m1 * e4m3 per element (fp64), without the global scale."""
    return E2M1_TABLE[_codes(data).long()] * scale.float().double().repeat_interleave(16, dim=-1)


def _rht_matrix(sign_mask: int) -> torch.Tensor:
    """R = diag(s) . H16 / 4 (fp64); a run v of 16 becomes v @ R (numerics.md 3)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):
        h = torch.kron(h, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    signs = SPEC_SIGNS if sign_mask == MASK else tuple(-1 if sign_mask >> i & 1 else 1 for i in range(16))
    return torch.diag(torch.tensor(signs, dtype=torch.float64)) @ h / 4


def _rht_rows(z: torch.Tensor, sign_mask: int) -> torch.Tensor:
    """Each run of 16 along the last dim times R, rounded to bf16."""
    r, c = z.shape
    return (z.double().reshape(r, c // 16, 16) @ _rht_matrix(sign_mask)).reshape(r, c).to(torch.bfloat16)


def _nearest_distance(v: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return (v.unsqueeze(-1) - values).abs().amin(dim=-1)


def _block_factor(x, scale, amax, block_2d):
    """(exact pre-rounding scale block_amax * 448 / A, decoded scale, D = scale * A / 2688),
    per block; amax (R, 1) fp64."""
    rows, cols = x.shape
    block_amax = x.abs().reshape(rows, cols // 16, 16).amax(dim=-1)
    if block_2d:
        tiles = block_amax.reshape(rows // 16, 16, cols // 16).amax(dim=1, keepdim=True)
        block_amax = tiles.expand(-1, 16, -1).reshape(rows, cols // 16)
    s_exact = torch.where(amax > 0, block_amax * 448.0 / amax, block_amax * 448.0 / 2688).clamp(max=448.0)
    s = scale.float().double()
    return s_exact, s, s * amax / 2688


def _assert_round_to_nearest(x, data, scale, amax, label, *, block_2d=False, stochastic=False):
    """The copy (data, scale) of the rows of x with global amax `amax` (a float, or one per
    row) is round-to-nearest at both levels (numerics.md 2) -- or, with `stochastic`, each code is
    one of the two grid neighbours. Relative slack 1e-6 covers the fp32 rounding of the
    chain (a few ulps), so only exact-or-near ties may go either way."""
    x = x.double()
    rows = x.shape[0]
    amax = torch.as_tensor(amax, dtype=torch.float64).expand(rows).reshape(rows, 1)
    s_exact, s, d = _block_factor(x, scale, amax, block_2d)
    slack = 1e-6
    far = (s - s_exact).abs() > _nearest_distance(s_exact, E4M3_VALUES) + slack * s_exact
    assert not bool(far.any()), (f"{label}: {int(far.sum())} block scales are not the E4M3 value nearest to "
                                 f"block_amax * 448 / A; first at {tuple(far.nonzero()[0].tolist())}")
    assert bool((s > 0).all()), f"{label}: a block scale underflowed (the case should avoid it)"
    v = (x / d.repeat_interleave(16, dim=1)).clamp(-6.0, 6.0)
    q = E2M1_TABLE[_codes(data).long()]
    a = v.abs()
    if stochastic:
        down = (a * (1 - slack)).unsqueeze(-1) >= GRID
        up = (a * (1 + slack)).clamp(max=6.0).unsqueeze(-1) <= GRID
        lo = torch.where(down, GRID, -1.0).amax(dim=-1)
        hi = torch.where(up, GRID, 7.0).amin(dim=-1)
        off = (q.abs() < lo) | (q.abs() > hi)
        what = "neither grid neighbour of x / D"
    else:
        off = (q.abs() - a).abs() > _nearest_distance(a, GRID) + slack * a
        what = "not the grid point nearest to x / D"
    off |= (q != 0) & ((q < 0) != (x < 0))
    if bool(off.any()):
        i = tuple(off.nonzero()[0].tolist())
        raise AssertionError(f"{label}: {int(off.sum())} of {off.numel()} codes {what}; first at {i}: "
                             f"x / D = {float(v[i])!r}, code value {float(q[i])!r}")


def _amax(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax().float() if t.numel() else torch.zeros((), dtype=torch.float32)


def _padded_offsets(sizes) -> list[int]:
    """numerics.md 4: group g's column-wise copy starts at the sum of the earlier sizes rounded up to 16."""
    out = [0]
    for m in sizes:
        out.append(out[-1] + -(-m // 16) * 16)
    return out


def _group_rows(x: torch.Tensor, sizes, g: int) -> torch.Tensor:
    start = sum(sizes[:g])
    return x[start:start + sizes[g]]


# ---------------------------------------------------------------------------------------
# Quantize: known answers

# One row of six 1x16 blocks, every value exact in bf16 / fp16 / fp32. Block 0 holds the
# amax A = 5.25 = 2688 / 512, so S_enc = 512 and S_dec = 2**-9 exactly, and the per-block
# multiplier m = 512 * fp32(1/6) = 85.3333359 (a power-of-two multiple: exact).
KAT_ROW = (
    # 0: the amax block. s = 5.25 * m = 448.0000134 -> fp32 448.0 -> E4M3 448 (0x7E, numerics.md 2.5);
    #    enc = 1 / (448 * 2**-9) = 1.1428572; 5.25 * enc = 6.0000002 -> clamp 6 -> code 7.
    [5.25] + [0.0] * 15,
    # 1: grid ties. block amax 3: s = 3 * m = 256.00001 -> fp32 256.0 -> E4M3 256 (0x78);
    #    enc = 1 / (256 * 2**-9) = 2 exactly, so v = 2x hits the ties exactly:
    #    v = 6, -6, .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, -.25->-0 (code 8),
    #    -.75->-1, -3.5->-4, .5, 2, -0.0 (exact -0 is coded 0), .125->0
    [3, -3, 0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5, -0.125, -0.375, -1.75, 0.25, 1.0, -0.0, 0.0625],
    # 2: all zero: scale 0, codes 0 (numerics.md 2.5)
    [0.0] * 16,
    # 3: underflow: s = 2**-20 * m = 8.1e-5 <= 2**-10 -> E4M3 0; enc = min(1 / 0, FLT_MAX) = FLT_MAX,
    #    so the non-zero elements saturate to +-6 (codes 7, 15) and 0 stays 0 (numerics.md 2.5)
    [2.0**-20, -(2.0**-20)] + [0.0] * 14,
    # 4: subnormal scale: s = 2**-14 * m = 2.667 * 2**-9 -> E4M3 3 * 2**-9 (0x03);
    #    enc = 1 / (3 * 2**-18) = 87381.336: v = 5.333 -> 6, 2.667 -> 3, 1.333 -> 1.5,
    #    -0.667 -> -0.5, 4.0000001 -> 4
    [2.0**-14, 2.0**-15, 2.0**-16, -(2.0**-17), 3 * 2.0**-16] + [0.0] * 11,
    # 5: smallest subnormal scale: s = 2**-16 * m = 0.667 * 2**-9 -> 2**-9 (0x01);
    #    enc = 2**18: v = 4 -> 4, -2 -> -2
    [2.0**-16, -(2.0**-17)] + [0.0] * 14,
)
KAT_CODES = (
    [7] + [0] * 15,
    [7, 15, 0, 2, 2, 4, 4, 6, 6, 8, 10, 14, 1, 4, 0, 0],
    [0] * 16,
    [7, 15] + [0] * 14,
    [7, 5, 3, 9, 6] + [0] * 11,
    [6, 12] + [0] * 14,
)
KAT_SCALES = (0x7E, 0x78, 0x00, 0x00, 0x03, 0x01)


def _packed(codes) -> torch.Tensor:
    """Codes (rows of N) -> bytes (rows of N/2), code[2i] | code[2i+1] << 4 (numerics.md 1), written out."""
    return torch.tensor([[row[i] | row[i + 1] << 4 for i in range(0, len(row), 2)] for row in codes],
                        dtype=torch.uint8)


def _kat_expected(blocks=range(6)):
    codes = [sum((KAT_CODES[b] for b in blocks), [])]
    return _packed(codes), torch.tensor([[KAT_SCALES[b] for b in blocks]], dtype=torch.uint8).view(E4M3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_quantize_known_answer(dtype):
    x = torch.tensor([sum(KAT_ROW, [])], dtype=dtype)
    assert bool((x.double() == torch.tensor([sum(KAT_ROW, [])], dtype=torch.float64)).all()), "KAT row not exact"
    out = nvfp4.quantize(x, True, False, False, MASK, False, False, None, None)
    data, scale = _kat_expected()
    assert_bytes_equal(out[0], data, "rowwise data")
    assert_bytes_equal(out[1], scale, "rowwise scale")
    assert_bytes_equal(out[2], torch.tensor(5.25), "rowwise amax")


def test_quantize_known_answer_columnwise():
    """The column-wise copy is the quantization of x^T: the KAT row as column 0 of x."""
    x = torch.zeros(96, 16, dtype=torch.bfloat16)
    x[:, 0] = torch.tensor(sum(KAT_ROW, []))
    out = nvfp4.quantize(x, False, True, False, MASK, False, False, None, None)
    data, scale = _kat_expected()
    zero_data, zero_scale = torch.zeros(15, 48, dtype=torch.uint8), torch.zeros(15, 6, dtype=torch.uint8).view(E4M3)
    assert_bytes_equal(out[3], torch.cat((data, zero_data)), "columnwise data")
    assert_bytes_equal(out[4], torch.cat((scale, zero_scale)), "columnwise scale")
    assert_bytes_equal(out[5], torch.tensor(5.25), "columnwise amax")


def test_quantize_known_answer_given_amax():
    """A supplied amax replaces the computed one: block 0 zeroed, A = 5.25 passed in, every
    other block as before; the amax comes back as a new tensor."""
    x = torch.tensor([[0.0] * 16 + sum(KAT_ROW[1:], [])], dtype=torch.bfloat16)
    given = torch.tensor(5.25)
    q = nvfp4_inductor.quantize(x, rowwise_amax=given)
    data, scale = _kat_expected([2, 1, 2, 3, 4, 5])
    assert_bytes_equal(q.rowwise_data, data, "rowwise data")
    assert_bytes_equal(q.rowwise_scale, scale, "rowwise scale")
    assert_bytes_equal(q.rowwise_amax, given, "rowwise amax")
    assert q.rowwise_amax.untyped_storage().data_ptr() != given.untyped_storage().data_ptr(), "amax aliases the input"


def _tile_kat():
    """(16, 32): tile 0 has the grid (amax 6) in row 0 and 0.5 in rows 1..15; tile 1 is zero.
    A = 6: S_enc = 448, m = 448 * fp32(1/6) = 74.666669.
      2D: tile 0 amax 6 -> s = 448.00002 -> 0x7E for all 16 rows; enc = 1 / (448 * fp32(1/448))
          = 1 +- 1 ulp, so the grid keeps its codes and 0.5 is code 1. Tile 1: scale 0, codes 0.
      1x16: rows 1..15 have block amax 0.5 -> s = 37.33 -> E4M3 36 (0x61), enc = 448 / 36 =
          12.44, 0.5 * enc = 6.22 -> clamp 6 -> code 7."""
    grid_row = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 0.0]
    grid_codes = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 0]
    x = torch.zeros(16, 32, dtype=torch.bfloat16)
    x[0, :16] = torch.tensor(grid_row)
    x[1:, :16] = 0.5
    codes_2d = [grid_codes + [0] * 16] + [[1] * 16 + [0] * 16] * 15
    codes_1x16 = [grid_codes + [0] * 16] + [[7] * 16 + [0] * 16] * 15
    scale_2d = torch.tensor([[0x7E, 0]] * 16, dtype=torch.uint8).view(E4M3)
    scale_1x16 = torch.tensor([[0x7E, 0]] + [[0x61, 0]] * 15, dtype=torch.uint8).view(E4M3)
    return x, (_packed(codes_2d), scale_2d), (_packed(codes_1x16), scale_1x16)


@pytest.mark.parametrize("block_2d", [True, False], ids=["2d", "1x16"])
def test_quantize_known_answer_tiles(block_2d):
    x, kat_2d, kat_1x16 = _tile_kat()
    data, scale = kat_2d if block_2d else kat_1x16
    out = nvfp4.quantize(x, True, False, False, MASK, block_2d, False, None, None)
    assert_bytes_equal(out[0], data, "rowwise data")
    assert_bytes_equal(out[1], scale, "rowwise scale")


@pytest.mark.parametrize("block_2d", [True, False], ids=["2d", "1x16"])
def test_quantize_weights_known_answer(block_2d):
    """Per-expert amax: expert 1 is expert 0 times 2**-3 (A = 0.75, S_enc = 3584 exact), so
    it gets the same bytes. With 2D tiles the column-wise copy (of each W^T) is the exact
    transpose; with 1x16 it is checked for round-to-nearest."""
    x, kat_2d, kat_1x16 = _tile_kat()
    w = torch.stack((x, x * 0.125))
    out = nvfp4.quantize_weights(w, block_2d)
    data, scale = kat_2d if block_2d else kat_1x16
    for g in range(2):
        assert_bytes_equal(out[0][g], data, f"expert {g} rowwise data")
        assert_bytes_equal(out[1][g], scale, f"expert {g} rowwise scale")
        if block_2d:
            codes_t = _codes(data).t().contiguous()
            assert_bytes_equal(out[2][g], codes_t[:, 0::2] | codes_t[:, 1::2] << 4, f"expert {g} columnwise data")
            assert_bytes_equal(out[3][g], torch.tensor([[0x7E]] * 16 + [[0]] * 16, dtype=torch.uint8).view(E4M3),
                               f"expert {g} columnwise scale")
        else:
            _assert_round_to_nearest(w[g].t()[:16], out[2][g][:16], out[3][g][:16], float(w[g].abs().max()),
                                     f"expert {g} columnwise")
    assert_bytes_equal(out[4], torch.tensor([6.0, 0.75]), "per-expert amax")


@pytest.mark.parametrize("sign_mask", [MASK, 0, 0x1234], ids=lambda m: f"mask{m:x}")
def test_quantize_rht_known_answer(sign_mask):
    """Column-wise RHT: x is built as Y . R^T (R orthogonal), Y's rows grid values each with
    a +-6, so RHT(x^T) = Y exactly, A = 6 (post-RHT), every scale 448 and the codes are Y's.
    x's entries are multiples of 1/8 below 24: exact in bf16."""
    gen = _gen(0)
    idx = torch.randint(0, 16, (16, 16), generator=gen)
    six = torch.randint(0, 2, (16,), generator=gen) * 8 + 7  # code 7 (6) or 15 (-6)
    idx[torch.arange(16), torch.randint(0, 16, (16,), generator=gen)] = six
    y = E2M1_TABLE[idx]  # (K=16, tokens=16)
    x = (y @ _rht_matrix(sign_mask).t()).t()  # (tokens, K)
    assert bool((x.to(torch.bfloat16).double() == x).all())
    out = nvfp4.quantize(x.to(torch.bfloat16), False, True, True, sign_mask, False, False, None, None)
    codes = torch.where(idx == 8, 0, idx)  # a zero of Y comes out of the sums as +0: code 0
    assert_bytes_equal(out[3], codes[:, 0::2].to(torch.uint8) | codes[:, 1::2].to(torch.uint8) << 4, "RHT codes")
    assert_bytes_equal(out[4], torch.full((16, 1), 0x7E, dtype=torch.uint8).view(E4M3), "RHT scales")
    assert_bytes_equal(out[5], torch.tensor(6.0), "post-RHT amax")


# ---------------------------------------------------------------------------------------
# Quantize: properties on random data


@dataclasses.dataclass(frozen=True)
class QCase:
    m: int
    k: int
    rowwise: bool = True
    columnwise: bool = False
    rht: bool = False
    block_2d: bool = False
    dtype: torch.dtype = torch.bfloat16
    given_amax: bool = False

    def __str__(self):
        flags = [n for n in ("rowwise", "columnwise", "rht", "block_2d", "given_amax") if getattr(self, n)]
        return f"{self.m}x{self.k}-{str(self.dtype)[6:]}-" + "+".join(flags)


QUANTIZE_CASES = [
    QCase(32, 64),
    QCase(48, 32, columnwise=True),
    QCase(32, 32, rowwise=False, columnwise=True, rht=True),
    QCase(64, 48, columnwise=True, rht=True),
    QCase(32, 64, block_2d=True),
    QCase(48, 32, columnwise=True, block_2d=True),
    QCase(32, 32, columnwise=True, dtype=torch.float32),
    QCase(40, 32, dtype=torch.float16),  # row-wise only: M need not be a multiple of 16
    QCase(32, 32, columnwise=True, rht=True, given_amax=True),
]


def _quantize_args(case: QCase, seed: int):
    x = _exact_values(_gen(seed), case.m, case.k, dtype=case.dtype)
    amax = torch.tensor(3.0) if case.given_amax else None  # below the true amax: saturation
    return (x, case.rowwise, case.columnwise, case.rht, MASK, case.block_2d, False, amax, amax)


def _columnwise_input(x: torch.Tensor, rht: bool, sign_mask: int) -> torch.Tensor:
    return _rht_rows(x.t(), sign_mask) if rht else x.t()


@pytest.mark.parametrize("case", QUANTIZE_CASES, ids=str)
def test_quantize_rounds_to_nearest(case: QCase):
    args = _quantize_args(case, 2)
    x = args[0]
    out = nvfp4.quantize(*args)
    if case.rowwise:
        amax = torch.tensor(3.0) if case.given_amax else _amax(x)
        assert_bytes_equal(out[2], amax, "rowwise amax")
        _assert_round_to_nearest(x, out[0], out[1], float(amax), f"{case} rowwise", block_2d=case.block_2d)
    if case.columnwise:
        xt = _columnwise_input(x, case.rht, MASK)
        amax = torch.tensor(3.0) if case.given_amax else _amax(xt)
        assert_bytes_equal(out[5], amax, "columnwise amax")
        _assert_round_to_nearest(xt, out[3], out[4], float(amax), f"{case} columnwise", block_2d=case.block_2d)


def test_quantize_columnwise_without_rht_uses_the_given_rowwise_amax():
    x = _exact_values(_gen(3), 32, 32)
    out = nvfp4.quantize(x, True, True, False, MASK, False, False, torch.tensor(2.5), None)
    assert_bytes_equal(out[5], torch.tensor(2.5), "columnwise amax")
    _assert_round_to_nearest(x.t(), out[3], out[4], 2.5, "columnwise")


def _sr_pattern(gen, rows: int):
    """fp32 (rows, 32): block 0 = [5.25, 0...] (A = 5.25, so block 1's scale is 256 and its
    enc exactly 2, as in KAT_ROW), block 1 = [3, then 15 values x = v / 2 with
    v = lo + p * step], p = k / 256, k in 32..224: 8-bit SR rounds |v| up with probability
    exactly p, so E[deq] = x; round-to-nearest would be off by >= step / 8.
    Returns (x, step, p) for the 15 values."""
    lo_i = torch.randint(0, 7, (15,), generator=gen)
    p = torch.randint(32, 225, (15,), generator=gen) / 256
    step = GRID[lo_i + 1] - GRID[lo_i]
    sign = torch.where(torch.rand(15, generator=gen) < 0.5, -1.0, 1.0)
    row = torch.cat((torch.tensor([5.25] + [0.0] * 15 + [3.0]), (sign * (GRID[lo_i] + p * step) / 2).float()))
    return row.expand(rows, 32).contiguous(), step, p.double()


def test_stochastic_rounding_is_unbiased_over_seeds():
    """Over n = 2048 draws (16 seeds x 128 rows) each element's mean is within 5 sigma of x,
    sigma = D * step * sqrt(p (1 - p) / n), D = 0.5; and so is the mean of the 15 z-scores
    taken toward larger |x| (a bias of a few / 256 in p shows there)."""
    rows, seeds = 128, 16
    x, step, p = _sr_pattern(_gen(4), rows)
    total = torch.zeros(32, dtype=torch.float64)
    for seed in range(seeds):
        torch.manual_seed(seed)
        out = nvfp4.quantize(x, True, False, False, MASK, False, True, None, None)
        assert_bytes_equal(out[1], torch.tensor([[0x7E, 0x78]] * rows, dtype=torch.uint8).view(E4M3), "SR scales")
        total += (_block_values(out[0], out[1]) * 5.25 / 2688).sum(dim=0)
    n = rows * seeds
    mean, target = total[17:] / n, x[0, 17:].double()
    sigma = 0.5 * step * (p * (1 - p) / n).sqrt()
    _assert_close(mean, target, 5 * sigma, f"SR mean of {n} draws")
    z = ((mean - target) * target.sign() / sigma).mean() * 15**0.5
    assert abs(float(z)) <= 5, f"SR: the 15 elements' mean z-score toward larger |x| is {float(z):.2f} (n = {n})"


@pytest.mark.parametrize("rht", [True, False], ids=["rht", "norht"])
def test_stochastic_rounding_picks_a_grid_neighbour(rht):
    x = _exact_values(_gen(5), 32, 48)
    torch.manual_seed(5)
    out = nvfp4.quantize(x, True, True, rht, MASK, False, True, None, None)
    _assert_round_to_nearest(x, out[0], out[1], float(_amax(x)), "SR rowwise", stochastic=True)
    xt = _columnwise_input(x, rht, MASK)
    _assert_round_to_nearest(xt, out[3], out[4], float(_amax(xt)), "SR columnwise", stochastic=True)


def test_stochastic_rounding_seeded_by_torch_manual_seed():
    """The op draws its Philox seed from torch's generator: the same manual_seed gives the
    same bits, the next call other bits (group_quantize as well)."""
    x = _exact_values(_gen(6), 32, 48)
    gs = torch.tensor([7, 0, 25])

    def both():
        return (nvfp4.quantize(x, True, True, True, MASK, False, True, None, None)
                + nvfp4.group_quantize(x, gs, True, True, True, MASK, True, None, None))

    torch.manual_seed(1234)
    first, second = both(), both()
    torch.manual_seed(1234)
    _assert_tuple_equal(both(), first, "SR under the same manual_seed")
    for i in (0, 3, 6, 9):  # the data of every copy
        assert not torch.equal(first[i], second[i]), f"output {i}: a second call drew the same bits"


# ---------------------------------------------------------------------------------------
# Grouped quantization


@dataclasses.dataclass(frozen=True)
class GCase:
    sizes: tuple[int, ...]
    k: int = 32
    rowwise: bool = True
    columnwise: bool = True
    rht: bool = True
    sign_mask: int = MASK
    given_amax: bool = False

    def __str__(self):
        flags = [n for n in ("rowwise", "columnwise", "rht", "given_amax") if getattr(self, n)]
        return f"{'-'.join(map(str, self.sizes))}xK{self.k}-mask{self.sign_mask:x}-" + "+".join(flags)


# (20, 0, 37, 23): an empty group and sizes not multiples of 16 (T = 80)
UNEVEN = (20, 0, 37, 23)
GROUP_CASES = [
    GCase(UNEVEN),
    GCase(UNEVEN, rht=False),
    GCase(UNEVEN, rowwise=False),
    GCase(UNEVEN, columnwise=False, rht=False),
    GCase((16, 32, 0, 16), k=64, sign_mask=0),  # aligned sizes, mask 0 (plain H/4)
    GCase((0, 64, 0, 0), k=48, sign_mask=0x1234),  # all tokens in one group
    GCase((0, 0, 0, 0)),  # zero-size: no tokens at all (a rank that received none)
    GCase(UNEVEN, given_amax=True),
    GCase(UNEVEN, rht=False, given_amax=True),
]


def _group_inputs(case: GCase, seed: int):
    """Group g's rows scaled by 4**g, so the per-group amaxes differ (and stay exact)."""
    gen = _gen(seed)
    x = _exact_values(gen, sum(case.sizes), case.k)
    x = x * torch.repeat_interleave(4.0 ** torch.arange(len(case.sizes)), torch.tensor(case.sizes)).unsqueeze(1)
    x = x.to(torch.bfloat16)
    gs = torch.tensor(case.sizes, dtype=torch.int64)
    ra = ca = None
    if case.given_amax:
        ra = torch.rand(len(case.sizes), generator=gen) * 4 + 0.5
        ca = torch.rand(len(case.sizes), generator=gen) * 4 + 0.5
    return x, gs, ra, ca


def _group_columnwise_input(x, sizes, g, rht, sign_mask):
    """Group g's rows zero-padded to a multiple of 16, transposed, RHT'd here (numerics.md 4)."""
    rows = _group_rows(x, sizes, g)
    padded = torch.cat((rows, rows.new_zeros(-(-sizes[g] // 16) * 16 - sizes[g], rows.shape[1])))
    return _columnwise_input(padded, rht, sign_mask)


@pytest.mark.parametrize("case", GROUP_CASES, ids=str)
def test_group_quantize(case: GCase):
    """Per group: its own amax (0 when empty), row-wise rounding of its rows, and its
    column-wise copy at numerics.md 4's padded offset, rounded from its own zero-padded (RHT'd)
    transpose. Absent copies are empty."""
    x, gs, ra, ca = _group_inputs(case, 5)
    sizes = case.sizes
    out = nvfp4.group_quantize(x, gs, case.rowwise, case.columnwise, case.rht, case.sign_mask, False, ra, ca)
    offsets = _padded_offsets(sizes)
    assert_bytes_equal(out[6], torch.tensor(offsets), "columnwise offsets")
    row_amax = ra if ra is not None else torch.stack([_amax(_group_rows(x, sizes, g)) for g in range(len(sizes))])
    for g, m in enumerate(sizes):
        if case.rowwise:
            start = sum(sizes[:g])
            rows = slice(start, start + m)
            if m:
                _assert_round_to_nearest(x[rows], out[0][rows], out[1][rows], float(row_amax[g]), f"group {g} rowwise")
        if case.columnwise:
            xt = _group_columnwise_input(x, sizes, g, case.rht, case.sign_mask)
            col_amax = ca[g] if ca is not None else (row_amax[g] if ra is not None and not case.rht else _amax(xt))
            assert_bytes_equal(out[5][g], col_amax, f"group {g} columnwise amax")
            lo, hi = offsets[g], offsets[g + 1]
            if m:
                _assert_round_to_nearest(xt, out[3][:, lo // 2:hi // 2], out[4][:, lo // 16:hi // 16],
                                         float(col_amax), f"group {g} columnwise")
    if case.rowwise:
        assert_bytes_equal(out[2], row_amax, "rowwise amax")
    for i in ([] if case.rowwise else [0, 1, 2]) + ([] if case.columnwise else [3, 4, 5]):
        assert out[i].numel() == 0, f"output {i}: an absent copy should be empty, got {tuple(out[i].shape)}"
    if case.given_amax:
        for i, given in ((2, ra), (5, ca)):
            assert out[i].untyped_storage().data_ptr() != given.untyped_storage().data_ptr(), f"output {i} aliases"


@pytest.mark.parametrize("sizes", [UNEVEN, (16, 32, 0, 16)], ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("sign_mask", [MASK, 0], ids=lambda m: f"mask{m:x}")
def test_group_hadamard_amax(sizes, sign_mask):
    """Per group (max |x_g|, max |RHT(x_g^T)|) with the RHT built here; 0 for an empty group."""
    x, gs, _, _ = _group_inputs(GCase(sizes, k=48), 7)
    out = nvfp4.group_hadamard_amax(x, gs, sign_mask)
    pre = torch.stack([_amax(_group_rows(x, sizes, g)) for g in range(len(sizes))])
    post = torch.stack([_amax(_group_columnwise_input(x, sizes, g, True, sign_mask)) for g in range(len(sizes))])
    _assert_tuple_equal(out, (pre, post), "group_hadamard_amax")


# ---------------------------------------------------------------------------------------
# Grouped GEMMs: fp64 matmul of operands decoded here


def _gemm_tolerance(ref, magnitude):
    """bf16 rounding of the result (half an ulp: 2**-8 relative at most) plus fp32
    accumulation and alpha rounding: (K + 8) ulps of alpha * sum |a b|, K <= 64 here."""
    return 2.0**-8 * ref.abs() + (64 + 8) * 2.0**-24 * magnitude


def _gemm_operands(seed: int, sizes=UNEVEN, k=32, n=48):
    """Group g's rows and expert g's weights scaled by 4**g (and 2**-g): swapping groups or
    their alphas would show."""
    gen = _gen(seed)
    gs = torch.tensor(sizes)
    scale = torch.repeat_interleave(4.0 ** torch.arange(len(sizes)), gs).unsqueeze(1)
    x = (_randn(gen, sum(sizes), k).float() * scale).to(torch.bfloat16)
    w = (_randn(gen, len(sizes), n, k, scale=0.1).float() * 2.0 ** -torch.arange(len(sizes)).view(-1, 1, 1))
    a = nvfp4.group_quantize(x, gs, True, False, False, MASK, False, None, None)
    b = nvfp4.quantize_weights(w.to(torch.bfloat16), True)
    return (a[0], a[1], a[2], b[0], b[1], b[4], gs)


def _as_operands(flat):
    """A GEMM op's flat arguments (a's data, scale, amax, b's, group sizes) as a step takes them."""
    return Operand(*flat[:3]), Operand(*flat[3:6]), flat[6]


@pytest.mark.parametrize("sizes", [UNEVEN, (0, 64, 0, 0)], ids=lambda s: "-".join(map(str, s)))
def test_grouped_gemm(sizes):
    a_data, a_scale, a_amax, b_data, b_scale, b_amax, gs = _gemm_operands(9, sizes)
    out = nvfp4.grouped_gemm(a_data, a_scale, a_amax, b_data, b_scale, b_amax, gs)
    assert (out.dtype, out.shape) == (torch.bfloat16, (sum(sizes), b_data.shape[1]))
    a = _block_values(a_data, a_scale)
    for g, m in enumerate(sizes):
        rows = slice(sum(sizes[:g]), sum(sizes[:g]) + m)
        b = _block_values(b_data[g], b_scale[g])
        alpha = float(a_amax[g]) * float(b_amax[g]) / 2688**2
        ref = alpha * a[rows] @ b.t()
        _assert_close(out[rows], ref, _gemm_tolerance(ref, alpha * a[rows].abs() @ b.abs().t()), f"group {g}")


@pytest.mark.parametrize("sizes", [UNEVEN, (16, 32, 0, 16)], ids=lambda s: "-".join(map(str, s)))
def test_grouped_gemm_wgrad(sizes):
    """Contraction over each group's padded tokens of two column-wise RHT copies; an empty
    group's weight gradient is exactly zero."""
    gen = _gen(10)
    gs = torch.tensor(sizes)
    a = nvfp4.group_quantize(_randn(gen, sum(sizes), 32), gs, False, True, True, MASK, False, None, None)
    b = nvfp4.group_quantize(_randn(gen, sum(sizes), 48), gs, False, True, True, MASK, False, None, None)
    out = nvfp4.grouped_gemm_wgrad(a[3], a[4], a[5], b[3], b[4], b[5], a[6])
    assert (out.dtype, out.shape) == (torch.bfloat16, (len(sizes), 32, 48))
    offsets = _padded_offsets(sizes)
    for g in range(len(sizes)):
        lo, hi = offsets[g], offsets[g + 1]
        av = _block_values(a[3][:, lo // 2:hi // 2], a[4][:, lo // 16:hi // 16])
        bv = _block_values(b[3][:, lo // 2:hi // 2], b[4][:, lo // 16:hi // 16])
        alpha = float(a[5][g]) * float(b[5][g]) / 2688**2
        ref = alpha * av @ bv.t()
        _assert_close(out[g], ref, _gemm_tolerance(ref, alpha * av.abs() @ bv.abs().t()), f"group {g}")
        if sizes[g] == 0:
            assert_bytes_equal(out[g], torch.zeros(32, 48, dtype=torch.bfloat16), f"empty group {g}")


# ---------------------------------------------------------------------------------------
# Activation and its backward: numerics.md 5 in fp64

ACTS = [("srelu", None), ("tanh_srelu", 3.0), ("swiglu", None)]
ACT_IDS = [a for a, _ in ACTS]


def _f64(c: torch.Tensor, activation: str, clamp) -> torch.Tensor:
    if activation == "srelu":
        return torch.relu(c) ** 2
    if activation == "tanh_srelu":
        return (clamp * torch.tanh(torch.relu(c) / clamp)) ** 2
    gate, up = c.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _act_inputs(seed: int, activation: str, with_probs: bool, t=64, f=32):
    gen = _gen(seed)
    f1 = 2 * f if activation == "swiglu" else f
    c = _randn(gen, t, f1, scale=2.0)
    g = _randn(gen, t, f)
    probs = torch.rand(t, generator=gen) if with_probs else None
    return c, g, probs


def _act_reference(c, g, probs, activation, clamp):
    """fp64 (D, dC, dprobs, sum |g f| per row) from the formulas and torch.autograd."""
    c64 = c.double().requires_grad_()
    p64 = (probs.double() if probs is not None else torch.ones(c.shape[0], dtype=torch.float64)).requires_grad_()
    f = _f64(c64, activation, clamp)
    d = f * p64.unsqueeze(1)
    dc, dp = torch.autograd.grad(d, (c64, p64), g.double())
    return d.detach(), dc, dp, (g.double() * f.detach()).abs().sum(dim=1)


BF16_TOL = 2.0**-8 + 2.0**-12  # half a bf16 ulp (relative) + fp32 error of the formulas


def _dprob_tolerance(f: int, magnitude):
    """fp32 error bound of dp = sum_n g f (pinned order: a 16-wide halving tree, 4 adds deep,
    then F/16 run totals left to right) plus ~8 ulps for computing each g * f in fp32."""
    return (4 + f // 16 + 8) * 2.0**-24 * magnitude


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_activation(activation, clamp, with_probs):
    c, g, probs = _act_inputs(11, activation, with_probs)
    out = nvfp4.activation(c, probs, activation, clamp)
    d, _, _, _ = _act_reference(c, g, probs, activation, clamp)
    assert (out.dtype, out.shape) == (torch.bfloat16, d.shape)
    _assert_close(out, d, BF16_TOL * d.abs(), f"D {activation}")


@pytest.mark.parametrize("regenerate", [True, False], ids=["regen", "noregen"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_activation_backward(activation, clamp, with_probs, regenerate):
    """dC and dprobs against fp64 autograd; the regenerated D is the forward op's D, byte for
    byte (numerics.md 6: the backward recompute); absent outputs empty."""
    c, g, probs = _act_inputs(12, activation, with_probs)
    dc, dp, d = nvfp4.activation_backward(g, c, probs, activation, clamp, regenerate)
    _, dc_ref, dp_ref, magnitude = _act_reference(c, g, probs, activation, clamp)
    assert dc.dtype == torch.bfloat16
    _assert_close(dc, dc_ref, BF16_TOL * dc_ref.abs(), f"dC {activation}")
    if with_probs:
        assert dp.dtype == torch.float32
        _assert_close(dp, dp_ref, _dprob_tolerance(g.shape[1], magnitude), f"dprobs {activation}")
    else:
        assert_bytes_equal(dp, torch.empty(0), "dprobs without probs")
    if regenerate:
        assert_bytes_equal(d, nvfp4.activation(c, probs, activation, clamp), "regenerated D")
    else:
        assert_bytes_equal(d, torch.empty(0, dtype=torch.bfloat16), "D without regenerate")


@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16], ids=["fp32-probs", "bf16-probs"])
@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_activation_autograd(activation, clamp, probs_dtype):
    """The op's registered backward through torch.autograd: gradients against fp64 autograd,
    dprobs in the probs' dtype."""
    c, g, probs = _act_inputs(13, activation, True)
    probs = probs.to(probs_dtype)
    c_req, p_req = c.clone().requires_grad_(), probs.clone().requires_grad_()
    dc, dp = torch.autograd.grad(nvfp4.activation(c_req, p_req, activation, clamp), (c_req, p_req), g)
    _, dc_ref, dp_ref, magnitude = _act_reference(c, g, probs, activation, clamp)
    assert (dc.dtype, dp.dtype) == (torch.bfloat16, probs_dtype)
    _assert_close(dc, dc_ref, BF16_TOL * dc_ref.abs(), "dC")
    tol = _dprob_tolerance(g.shape[1], magnitude) + (2.0**-8 * dp_ref.abs() if probs_dtype == torch.bfloat16 else 0)
    _assert_close(dp, dp_ref, tol, "dprobs")


# ---------------------------------------------------------------------------------------
# Op contract: opcheck, absent outputs, errors, compilation

# opcheck's test_schema runs the op under SchemaCheckMode, which compares inputs before and
# after with torch.allclose: not implemented for float8_e4m3fn on the CPU in this torch. Ops
# that take E4M3 scales (the GEMMs, the backward op) get the same check by hand instead
# (_check_functional); the other three opcheck tests run as usual.
NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _check_functional(op, args, label, kwargs=None):
    """What test_schema checks, by hand: no input mutated, no output aliases an input."""
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = op(*args, **(kwargs or {}))
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor):
            assert_bytes_equal(a, b, f"{label}: input {i} after the call")
    in_ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
    for j, o in enumerate(outs):
        assert not (o.numel() and o.untyped_storage().data_ptr() in in_ptrs), f"{label}: output {j} aliases an input"


# opcheck is up to ~1 s a call (AOT compile with dynamic shapes): one case per code path
QUANTIZE_OPCHECK_CASES = [
    QCase(64, 48, columnwise=True, rht=True),
    QCase(32, 64, columnwise=True, rht=True, block_2d=True),
    QCase(32, 64),
    QCase(32, 32, rowwise=False, columnwise=True, rht=True),
    QCase(48, 32, columnwise=True, dtype=torch.float32),
    QCase(32, 32, columnwise=True, rht=True, given_amax=True),
]


@pytest.mark.parametrize("case", QUANTIZE_OPCHECK_CASES, ids=str)
def test_quantize_opcheck(case: QCase):
    torch.library.opcheck(nvfp4.quantize, _quantize_args(case, 1))


@pytest.mark.parametrize("case", [GCase(UNEVEN), GCase(UNEVEN, columnwise=False, rht=False), GCase(UNEVEN, rht=False),
                                  GCase(UNEVEN, given_amax=True)], ids=str)
def test_group_quantize_opcheck(case: GCase):
    x, gs, ra, ca = _group_inputs(case, 4)
    torch.library.opcheck(
        nvfp4.group_quantize, (x, gs, case.rowwise, case.columnwise, case.rht, case.sign_mask, False, ra, ca)
    )


def test_group_hadamard_amax_and_quantize_weights_opcheck():
    x, gs, _, _ = _group_inputs(GCase(UNEVEN), 7)
    torch.library.opcheck(nvfp4.group_hadamard_amax, (x, gs, MASK))
    torch.library.opcheck(nvfp4.quantize_weights, (_randn(_gen(8), 4, 48, 32, scale=0.1), True))


def test_gemm_opcheck():
    args = _gemm_operands(9)
    torch.library.opcheck(nvfp4.grouped_gemm, args, test_utils=NO_SCHEMA)
    _check_functional(nvfp4.grouped_gemm, args, "grouped_gemm")
    gen, gs = _gen(10), torch.tensor(UNEVEN)
    a = nvfp4.group_quantize(_randn(gen, 80, 32), gs, False, True, True, MASK, False, None, None)
    b = nvfp4.group_quantize(_randn(gen, 80, 48), gs, False, True, True, MASK, False, None, None)
    wargs = (a[3], a[4], a[5], b[3], b[4], b[5], a[6])
    torch.library.opcheck(nvfp4.grouped_gemm_wgrad, wargs, test_utils=NO_SCHEMA)
    _check_functional(nvfp4.grouped_gemm_wgrad, wargs, "grouped_gemm_wgrad")


@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_activation_opcheck(activation, clamp):
    """With gradients required, so AOT dispatch also runs the registered backward; the
    backward op with each of its flags (probs, regenerate) on and off."""
    c, g, probs = _act_inputs(11, activation, True)
    torch.library.opcheck(nvfp4.activation, (c.requires_grad_(), probs.requires_grad_(), activation, clamp))
    c, probs = c.detach(), probs.detach()
    torch.library.opcheck(nvfp4.activation, (c, None, activation, clamp))
    torch.library.opcheck(nvfp4.activation_backward, (g, c, probs, activation, clamp, True))
    torch.library.opcheck(nvfp4.activation_backward, (g, c, None, activation, clamp, False))


@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_fused_step_ops(activation, clamp):
    """``nvfp4::fc1_act_amax`` / ``nvfp4::fc2_dgrad_act`` return what the named target's fused
    steps return (here the cudnn step table over its CPU simulator), pass opcheck, and name
    a target that has no fused steps."""
    from nvfp4_inductor import lowerings
    from nvfp4_inductor.testing import simulated_target

    f, gated = 64, activation == "swiglu"
    f1 = 2 * f if gated else f
    want_amax = activation != "tanh_srelu"  # cuDNN's amax wrapper has no clamp (rule 3)
    probs = torch.rand(sum(UNEVEN), generator=_gen(22))
    fc1 = _gemm_operands(21, k=64, n=f1)
    dgrad = _gemm_operands(23, k=64, n=f)
    c = _randn(_gen(24), sum(UNEVEN), f1)
    target = simulated_target()
    steps = target.steps()
    with lowerings.registered(target):
        fc1_args = (*fc1, probs, activation, clamp, MASK, want_amax, target.name)
        got = nvfp4.fc1_act_amax(*fc1_args)
        expected = steps.fc1_act_amax(*_as_operands(fc1), probs, activation, clamp,
                                      QuantizeOptions(columnwise=True, rht=True, sign_mask=MASK), want_amax=want_amax)
        _assert_tuple_equal(got[:2], expected[:2], "fc1_act_amax C, D")
        if want_amax:
            _assert_tuple_equal(got[2:], expected[2:], "fc1_act_amax amaxes")
        else:
            assert got[2].numel() == got[3].numel() == 0
        dgrad_args = (*dgrad, c, probs, activation, clamp, target.name)
        dc, dp, _ = steps.fc2_dgrad_act(*_as_operands(dgrad), c, probs, activation, clamp)
        _assert_tuple_equal(nvfp4.fc2_dgrad_act(*dgrad_args), (dc, dp), "fc2_dgrad_act")
        for op, args in ((nvfp4.fc1_act_amax, fc1_args), (nvfp4.fc2_dgrad_act, dgrad_args)):
            torch.library.opcheck(op, args, test_utils=NO_SCHEMA)
            _check_functional(op, args, str(op))
    with pytest.raises(ValueError, match="nvfp4::fc1_act_amax: the reference target has no fused kernel"):
        nvfp4.fc1_act_amax(*fc1_args[:-1], "reference")


def test_absent_copies_are_empty_with_the_fake_impls_dtypes():
    """Optional outputs come back as empty tensors of the dtype the fake impl gives, and the
    public wrappers turn them into None."""
    x = _randn(_gen(16), 32, 32)
    dtypes = (torch.uint8, E4M3, torch.float32)
    row_only = nvfp4.quantize(x, True, False, False, MASK, False, False, None, None)
    col_only = nvfp4.quantize(x, False, True, True, MASK, False, False, None, None)
    for i, d in enumerate(dtypes):
        assert_bytes_equal(row_only[3 + i], torch.empty(0, dtype=d), f"absent columnwise output {i}")
        assert_bytes_equal(col_only[i], torch.empty(0, dtype=d), f"absent rowwise output {i}")
    q = nvfp4_inductor.quantize(x)
    assert (q.columnwise_data, q.columnwise_scale, q.columnwise_amax) == (None, None, None)
    gq = nvfp4_inductor.group_quantize(x, torch.tensor([10, 22]), rowwise=False, columnwise=True)
    assert (gq.rowwise_data, gq.rowwise_scale, gq.rowwise_amax) == (None, None, None)


def test_columnwise_copy_without_rht_is_contiguous():
    x = _randn(_gen(17), 48, 32)
    out = nvfp4.quantize(x, True, True, False, MASK, False, False, None, None)
    assert out[3].is_contiguous(), f"columnwise data {tuple(out[3].shape)} has strides {out[3].stride()}"


def _bad_sizes_calls():
    x, w1, w2 = _randn(_gen(0), 80, 32), _randn(_gen(1), 4, 48, 32), _randn(_gen(2), 4, 32, 48)
    gq = lambda gs: nvfp4.group_quantize(x, gs, True, True, True, MASK, False, None, None)  # noqa: E731
    case = MLP_CASES[1]  # srelu, no probs
    infer = lambda gs: nvfp4.grouped_mlp_infer(x, w1, w2, gs, None, **_infer_kwargs(case))  # noqa: E731
    fwd = lambda gs: nvfp4.grouped_mlp_fwd(x, w1, w2, gs, None, **_fwd_kwargs(case, True))  # noqa: E731
    return {"group_quantize": gq, "grouped_mlp_infer": infer, "grouped_mlp_fwd": fwd}


@pytest.mark.parametrize("sizes,match", [((20, 0, 37, 22), r"group_sizes must sum"),
                                         ((40, -3, 20, 23), r"group_sizes must be non-negative")],
                         ids=["wrong-sum", "negative"])
@pytest.mark.parametrize("op", ["group_quantize", "grouped_mlp_infer", "grouped_mlp_fwd"])
def test_op_rejects_bad_group_sizes(op, sizes, match):
    """The ops check group-size values themselves (the host-side check on the CPU)."""
    with pytest.raises(ValueError, match=match):
        _bad_sizes_calls()[op](torch.tensor(sizes))


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_ops_compile_fullgraph():
    """Quantize, GEMM and the activation (with its registered backward) in one fullgraph
    torch.compile: no graph break, the same bits as eager."""
    gen = _gen(18)
    sizes = torch.tensor(UNEVEN)
    x, w = _randn(gen, 80, 32), _randn(gen, 4, 48, 32, scale=0.1)
    probs = torch.rand(80, generator=gen)

    def f(x, w, sizes, probs):
        xq = nvfp4.group_quantize(x, sizes, True, True, True, MASK, False, None, None)
        wq = nvfp4.quantize_weights(w, True)
        c = nvfp4.grouped_gemm(xq[0], xq[1], xq[2], wq[0], wq[1], wq[4], sizes)
        return c, nvfp4.activation(c, probs, "srelu", None), xq[3]

    def run(fn):
        p = probs.clone().requires_grad_()
        c, d, x_col = fn(x, w, sizes, p)
        return [c, d, x_col, *torch.autograd.grad(d.float().sum(), p)]

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    _assert_tuple_equal(run(compiled), run(f), "compiled vs eager")


# ---------------------------------------------------------------------------------------
# Fused grouped-MLP ops: bit for bit the chain of nvfp4 ops (the fused ops' contract)


@dataclasses.dataclass(frozen=True)
class MCase:
    activation: str
    clamp: Optional[float]
    with_probs: bool
    sizes: tuple[int, ...] = UNEVEN
    hidden: int = 32
    ffn: int = 48
    rht: bool = True
    block_2d: bool = True

    def __str__(self):
        sizes = "-".join(map(str, self.sizes))
        return (f"{self.activation}-{'probs' if self.with_probs else 'noprobs'}-{sizes}-H{self.hidden}F{self.ffn}"
                + ("" if self.rht else "-northt") + ("" if self.block_2d else "-1x16w"))


MLP_CASES = [MCase(a, c, p) for a, c in ACTS for p in (True, False)] + [
    MCase("srelu", None, True, sizes=(16, 32, 0, 16), hidden=64, ffn=32, rht=False, block_2d=False),
]
NORHT = MLP_CASES[-1]


def _mlp_inputs(case: MCase, seed: int):
    gen = _gen(seed)
    g = len(case.sizes)
    t = sum(case.sizes)
    f1 = 2 * case.ffn if case.activation == "swiglu" else case.ffn
    x = _randn(gen, t, case.hidden)
    w1 = _randn(gen, g, f1, case.hidden, scale=case.hidden ** -0.5)
    w2 = _randn(gen, g, case.hidden, case.ffn, scale=case.ffn ** -0.5)
    gs = torch.tensor(case.sizes)
    probs = torch.rand(t, generator=gen) if case.with_probs else None
    dy = _randn(gen, t, case.hidden)
    return x, w1, w2, gs, probs, dy


def _chain_forward(case: MCase, x, w1, w2, gs, probs):
    """numerics.md 5 forward as the chain of eager ops: (Y, C, xq, W1q, W2q, Dq)."""
    xq = nvfp4.group_quantize(x, gs, True, True, case.rht, MASK, False, None, None)
    w1q = nvfp4.quantize_weights(w1, case.block_2d)
    w2q = nvfp4.quantize_weights(w2, case.block_2d)
    c = nvfp4.grouped_gemm(xq[0], xq[1], xq[2], w1q[0], w1q[1], w1q[4], gs)
    d = nvfp4.activation(c, probs, case.activation, case.clamp)
    dq = nvfp4.group_quantize(d, gs, True, True, case.rht, MASK, False, None, None)
    y = nvfp4.grouped_gemm(dq[0], dq[1], dq[2], w2q[0], w2q[1], w2q[4], gs)
    return y, c, xq, w1q, w2q, dq


def _chain_backward(case: MCase, dy, c, probs, gs, xq, w1q, w2q, dq):
    """numerics.md 5 backward as the chain of eager ops, SR off: (dX, dW1, dW2, dprobs)."""
    def quantize_grad(t):
        return nvfp4.group_quantize(t, gs, True, True, case.rht, MASK, False, None, None)

    dyq = quantize_grad(dy)
    g = nvfp4.grouped_gemm(dyq[0], dyq[1], dyq[2], w2q[2], w2q[3], w2q[4], gs)
    dc, dp, _ = nvfp4.activation_backward(g, c, probs, case.activation, case.clamp, False)
    dw2 = nvfp4.grouped_gemm_wgrad(dyq[3], dyq[4], dyq[5], dq[3], dq[4], dq[5], dq[6])
    dcq = quantize_grad(dc)
    dx = nvfp4.grouped_gemm(dcq[0], dcq[1], dcq[2], w1q[2], w1q[3], w1q[4], gs)
    dw1 = nvfp4.grouped_gemm_wgrad(dcq[3], dcq[4], dcq[5], xq[3], xq[4], xq[5], xq[6])
    return (dx, dw1, dw2) + ((dp,) if probs is not None else ())


def _fwd_kwargs(case: MCase, recompute: bool) -> dict:
    """The fused ops' options: the case's recipe (RNE), the reference target's plan."""
    return dict(activation=case.activation, tanh_clamp_scale=case.clamp, rht=case.rht, sign_mask=MASK,
                block_2d=case.block_2d, stochastic_rounding=False, recompute=recompute, target="reference",
                fused_fc1=False, fused_amax=False, fused_dgrad=False)


def _infer_kwargs(case: MCase) -> dict:
    return _fwd_kwargs(case, False)


def _bwd_fc2_kwargs(case: MCase, recompute: bool) -> dict:
    return _fwd_kwargs(case, recompute)


@pytest.mark.parametrize("case", MLP_CASES, ids=str)
def test_grouped_mlp_infer(case: MCase):
    x, w1, w2, gs, probs, _ = _mlp_inputs(case, 13)
    y = nvfp4.grouped_mlp_infer(x, w1, w2, gs, probs, **_infer_kwargs(case))
    assert_bytes_equal(y, _chain_forward(case, x, w1, w2, gs, probs)[0], "Y")


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saveD"])
@pytest.mark.parametrize("case", MLP_CASES, ids=str)
def test_grouped_mlp_fwd(case: MCase, recompute: bool):
    """Y and C, and what the backward is handed: x's and the weights' column-wise copies,
    D's column-wise amax (post-RHT with RHT) and, without recompute, D's column-wise copy."""
    x, w1, w2, gs, probs, _ = _mlp_inputs(case, 14)
    out = nvfp4.grouped_mlp_fwd(x, w1, w2, gs, probs, **_fwd_kwargs(case, recompute))
    y, c, xq, w1q, w2q, dq = _chain_forward(case, x, w1, w2, gs, probs)
    d_col = (torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=E4M3)) if recompute else (dq[3], dq[4])
    expected = (y, c, xq[3], xq[4], xq[5], xq[6], w1q[2], w1q[3], w1q[4], w2q[2], w2q[3], w2q[4], dq[5]) + d_col
    _assert_tuple_equal(out, expected, f"grouped_mlp_fwd {case}")


@pytest.mark.parametrize("case", MLP_CASES, ids=str)
def test_grouped_mlp_backward(case: MCase):
    """Gradients of grouped_mlp_fwd through its registered backward (SR off), with and
    without recompute: both equal the chain of eager ops (numerics.md 6: recompute changes no bit)."""
    x, w1, w2, gs, probs, dy = _mlp_inputs(case, 15)
    _, c, xq, w1q, w2q, dq = _chain_forward(case, x, w1, w2, gs, probs)
    expected = _chain_backward(case, dy, c, probs, gs, xq, w1q, w2q, dq)
    for recompute in (True, False):
        inputs = [t.clone().requires_grad_() for t in (x, w1, w2) + ((probs,) if probs is not None else ())]
        p = inputs[3] if probs is not None else None
        y = nvfp4.grouped_mlp_fwd(*inputs[:3], gs, p, **_fwd_kwargs(case, recompute))[0]
        grads = torch.autograd.grad(y, inputs, dy)
        _assert_tuple_equal(grads, expected, f"grouped_mlp backward {case} recompute={recompute}")


MLP_OPCHECK = [MLP_CASES[0], MLP_CASES[3], MLP_CASES[4]]  # srelu+probs, tanh_srelu-noprobs, swiglu+probs


@pytest.mark.parametrize("case", MLP_OPCHECK, ids=str)
def test_grouped_mlp_opcheck(case: MCase):
    x, w1, w2, gs, probs, dy = _mlp_inputs(case, 14)
    torch.library.opcheck(nvfp4.grouped_mlp_infer, (x, w1, w2, gs, probs), _infer_kwargs(case))
    recompute = case.activation != "swiglu"
    torch.library.opcheck(nvfp4.grouped_mlp_fwd, (x, w1, w2, gs, probs), _fwd_kwargs(case, recompute))
    # with gradients required: the autograd registration check. test_schema and
    # test_aot_dispatch_dynamic cannot run here: they would differentiate through the E4M3
    # scale outputs (sum / allclose are not implemented for float8_e4m3fn on the CPU).
    req = [t.detach().requires_grad_() for t in (x, w1, w2)]
    p_req = probs.detach().requires_grad_() if probs is not None else None
    torch.library.opcheck(nvfp4.grouped_mlp_fwd, (*req, gs, p_req), _fwd_kwargs(case, recompute),
                          test_utils="test_autograd_registration")
    if case.with_probs:  # the backward's first op (its other two are the eager GEMM ops)
        saved = nvfp4.grouped_mlp_fwd(x, w1, w2, gs, probs, **_fwd_kwargs(case, recompute))
        fc2_args = (dy, saved[1], probs, gs, saved[5], *saved[9:])
        fc2_kwargs = _bwd_fc2_kwargs(case, recompute)
        torch.library.opcheck(nvfp4.grouped_mlp_bwd_fc2, fc2_args, fc2_kwargs, test_utils=NO_SCHEMA)
        _check_functional(nvfp4.grouped_mlp_bwd_fc2, fc2_args, "grouped_mlp_bwd_fc2", fc2_kwargs)


def test_grouped_mlp_fwd_opcheck_without_rht():
    x, w1, w2, gs, probs, _ = _mlp_inputs(NORHT, 14)
    torch.library.opcheck(nvfp4.grouped_mlp_fwd, (x, w1, w2, gs, probs), _fwd_kwargs(NORHT, True),
                          test_utils="test_faketensor")
