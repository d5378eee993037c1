"""NVFP4 constants, each defined once (docs/numerics.md section 1-3). Everything imports these."""

import struct


def _f32(value: float) -> float:
    """Round a Python float to the nearest fp32 value (as a Python float)."""
    return struct.unpack("f", struct.pack("f", value))[0]


BLOCK = 16  # elements per block scale (1x16) and tile side (16x16)
FP4_MAX = 6.0  # largest E2M1 magnitude
E4M3_MAX = 448.0  # largest finite float8_e4m3fn magnitude: 0x7E = 1.75 * 2**8
FP4_E4M3_MAX = FP4_MAX * E4M3_MAX  # 2688: global encode scale numerator
FLT_MAX = _f32(3.4028234663852886e38)  # largest finite fp32
INV_FP4_MAX = _f32(1.0 / 6.0)  # fp32(1/6) = 0x3E2AAAAB; multiplied, never divided (numerics.md 2.2)
INV_FP4_E4M3_MAX = _f32(1.0 / 2688.0)  # fp32(1/2688), the dequantize factor (numerics.md 2.6)
GEMM_ALPHA_DIVISOR = FP4_E4M3_MAX * FP4_E4M3_MAX  # 2688**2 = 7225344, exact in fp32

# E2M1 code -> value for codes 0..7 (sign | 2-bit exponent, bias 1 | 1-bit mantissa);
# codes 8..15 are the negatives, code 8 is -0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_SIGN_BIT = 0x8

E4M3_MIN_NORMAL = 2.0**-6  # smallest normal float8_e4m3fn; below it 2**-9 subnormal steps
E4M3_SUBNORMAL_STEP = 2.0**-9
E4M3_NAN_CODE = 0x7F

RHT_DEFAULT_SIGN_MASK = 0xD7E8  # bit i set where sign i of TransformerEngine's vector is -1
RHT_SCALE = 0.25  # 1/sqrt(16), exact in every float format

SR_BITS_PER_ELEMENT = 8  # random bits per element for stochastic rounding (as TE's cvt.rs)
PHILOX_ROUNDS = 10  # Triton's default for tl.philox / tl.randint
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
SR_STREAM_ROWWISE = 0  # Philox counter word c1: which copy the bits are for
SR_STREAM_COLUMNWISE = 1
