"""Bit-level E2M1 / E4M3 encode and decode, and block dequantization (docs/numerics.md section 1-2).

Written with explicit fp32 comparisons and integer bit operations, never with
``.to(torch.float8_e4m3fn)``: casts round differently across devices and in the Triton
interpreter, while these formulas are the same everywhere (the Triton kernels use the
same ones, see ``nvfp4_inductor/kernels/``).
"""

from __future__ import annotations

import torch

from .constants import (
    BLOCK,
    E2M1_SIGN_BIT,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E4M3_NAN_CODE,
    INV_FP4_E4M3_MAX,
)

# fp32 bit layout: 8-bit exponent (bias 127), 23-bit mantissa. E4M3: 4-bit exponent
# (bias 7), 3-bit mantissa, so 20 mantissa bits are dropped and the exponent rebiased.
_F32_TO_E4M3_DROPPED_BITS = 20
_E4M3_REBIAS = (127 - 7) << 3
_RNE_MAGIC = 8388608.0  # 2**23: x + 2**23 - 2**23 rounds x >= 0 to an integer, ties to even


def e4m3_encode(s: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn bits (uint8): round to nearest even, saturate at +-448.

    Subnormals (multiples of 2**-9) are kept; |s| <= 2**-10 becomes 0 (the tie goes
    to the even code 0). NaN is undefined (scales are never NaN for finite inputs).
    """
    s = s.float()
    a = s.abs().clamp(max=E4M3_MAX)  # saturate first: 448 < |s| < 464 must not round to NaN
    ab = a.view(torch.int32)
    lsb = (ab >> _F32_TO_E4M3_DROPPED_BITS) & 1
    # add 0x7FFFF + lsb: round-half-to-even on the dropped bits; a carry moves the exponent
    normal = ((ab + 0x7FFFF + lsb) >> _F32_TO_E4M3_DROPPED_BITS) - _E4M3_REBIAS
    # subnormal range: a / 2**-9 = a * 512 is exact; the magic-number add rounds it RNE
    subnormal = ((a * 512.0 + _RNE_MAGIC) - _RNE_MAGIC).to(torch.int32)
    bits = torch.where(a < E4M3_MIN_NORMAL, subnormal, normal)
    sign = torch.where(s.view(torch.int32) < 0, 0x80, 0)
    return (bits | sign).to(torch.uint8)


def _e4m3_table() -> torch.Tensor:
    values = []
    for code in range(256):
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if code & 0x7F == E4M3_NAN_CODE:
            value = float("nan")
        elif exponent == 0:
            value = mantissa * 2.0**-9
        else:
            value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        values.append(-value if code & 0x80 else value)
    return torch.tensor(values, dtype=torch.float32)


_E4M3_TABLE = _e4m3_table()
_E2M1_TABLE = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bits (uint8, or a float8_e4m3fn tensor) -> fp32 (exact)."""
    if bits.dtype == torch.float8_e4m3fn:
        bits = bits.view(torch.uint8)
    return _E4M3_TABLE.to(bits.device)[bits.long()]


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 in [-6, 6] -> E2M1 code (uint8, 0..15), round to nearest even on the grid.

    The thresholds are the midpoints of {0, .5, 1, 1.5, 2, 3, 4, 6}; a midpoint goes to
    the neighbour with the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4), so the comparison is `>` below an even code and `>=` above one.
    Sign: a strictly negative v gets the sign bit (so -0.3 -> code 9 ... and a value
    that rounds to zero keeps its sign, code 8); an exact -0.0 is coded 0.
    """
    a = v.abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    return code | torch.where(v < 0, E2M1_SIGN_BIT, 0).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> fp32."""
    return _E2M1_TABLE.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """(..., N) codes -> (..., N/2) bytes, the even-index element in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(data: torch.Tensor) -> torch.Tensor:
    """(..., N/2) bytes -> (..., N) codes; inverse of ``pack_fp4``."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Dequantize a 1x16-blocked matrix: data (R, C/2), scale (R, C/16), amax (R, 1) or scalar.

    Order (numerics.md 2.6): ``(float(scale) * amax) * fp32(1/2688)`` first, then times the
    E2M1 value; returns fp32 (R, C).
    """
    block_factor = (e4m3_decode(scale) * amax) * INV_FP4_E4M3_MAX
    values = e2m1_decode(unpack_fp4(data))
    rows, cols = values.shape
    return (values.view(rows, cols // BLOCK, BLOCK) * block_factor.unsqueeze(-1)).view(rows, cols)


def is_deq_values(data: torch.Tensor) -> bool:
    """Whether a GEMM operand's data is already its deq() values ((..., C) bf16, what a cast
    with ``rowwise_deq`` writes; its scale is empty and not read) rather than packed E2M1
    codes ((..., C/2) uint8)."""
    return data.dtype == torch.bfloat16


def operand_values(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 deq() values of a GEMM operand of any leading shape, given either packed
    (data (..., C/2) uint8, scale (..., C/16)) or already as its deq() values
    (``is_deq_values``)."""
    if is_deq_values(data):
        return data.float()
    lead, half = data.shape[:-1], data.shape[-1]
    return block_values(data.reshape(-1, half), scale.reshape(-1, half // 8)).reshape(*lead, 2 * half)


def block_values(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """deq(): E2M1 value times its E4M3 block scale, without the global scale.

    Exact in fp32 and in bf16 (2 + 4 significant bits), which is what lets the Hopper
    GEMMs feed these to bf16 tensor cores and apply the global scales as alpha.
    """
    values = e2m1_decode(unpack_fp4(data))
    rows, cols = values.shape
    return (values.view(rows, cols // BLOCK, BLOCK) * e4m3_decode(scale).unsqueeze(-1)).view(rows, cols)
