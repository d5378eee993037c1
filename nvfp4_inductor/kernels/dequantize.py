"""NVFP4 -> bf16 deq() copies: the operands of the bf16-operand grouped GEMMs
(grouped_gemm_bf16.py).

    out[r, c] = bf16(e2m1(data)[r, c] * e4m3(scale)[r, c // 16])   (no global scale)

Kernel ``_dequantize_kernel``; launcher ``dequantize_bf16``; op ``nvfp4_kernels::dequantize_bf16``.
Reference twin: ``formats.block_values(data, scale).to(torch.bfloat16)`` -- bit for bit:
deq() has at most 6 significant bits and lies in [2**-10, 2688], so it is exact in bf16
and no rounding happens anywhere (numerics.md 7).

Arithmetic: integer bit placement, no fp8 casts:
* a code c (4 bits) placed as ``(c & 7) << 9 | (c & 8) << 12`` is the fp16 bit pattern of
  e2m1(c) * 2**-14 (the E2M1 exponent lands in fp16's exponent field, bias 15 instead of
  1; code 1 = 0.5 becomes the fp16 subnormal 2**-15, which is exact);
* an E4M3 scale s placed as ``(s & 0x7F) << 7`` is fp16(s) * 2**-8 (subnormals too);
  one exact fp16 multiply by 2**8 restores it (``_scale_fp16``);
* deq() * 2**-14 = fp16 code value times fp16 scale: one multiply, exact (the product has
  <= 6 significant bits and is a multiple of 2**-24, the smallest fp16 subnormal).
Each product (low nibble: element 2i, high nibble: element 2i+1) is widened to fp32
(exact), multiplied by 2**14 (exact) and narrowed to bf16 (exact, so the interpreter's
truncating cast gives the same bits), then the two are interleaved.

Memory-bound: reads 0.5625 B and writes 2 B per element. A program owns BR rows and
BC packed bytes (2 BC elements) of one row block, so each thread loads 16 contiguous bytes
and stores 32 contiguous bf16 (four 16-byte stores). Inputs of any leading shape
(R, C/2) + (R, C/16) or (G, N, K/2) + (G, N, K/16) are flattened to rows. Tiles:
``config.dequant_config``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._registry import cdiv, kernel_op, launch
from .config import dequant_config


@triton.jit
def _scale_fp16(s):
    """E4M3 scale bits (uint8 tile) -> the exact scale value in fp16 (scales are >= 0)."""
    bits = (s.to(tl.uint16) & 0x7F) << 7  # fp16 bits of s * 2**-8: exponent bias 15 vs 7
    return bits.to(tl.float16, bitcast=True) * 256.0  # exact (<= 448, subnormals become normal)


@triton.jit
def _deq_nibbles(data, scale):
    """Packed E2M1 bytes (R, C) uint8 and the fp16 scale of each byte (R, C) ->
    (low nibbles, high nibbles), each (R, C) fp16 holding deq() * 2**-14 exactly."""
    w = data.to(tl.uint16)
    lo = ((w & 0x7) << 9) | ((w & 0x8) << 12)  # element 2i: e2m1 * 2**-14 as fp16 bits
    hi = ((w & 0x70) << 5) | ((w & 0x80) << 8)  # element 2i+1
    return lo.to(tl.float16, bitcast=True) * scale, hi.to(tl.float16, bitcast=True) * scale


@triton.jit
def _expand_scales(s, R: tl.constexpr, BK: tl.constexpr):
    """(R, BK/16) per-block values -> (R, BK/2): byte i (elements 2i, 2i+1) takes block i // 8."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (R, BK // 16, 8)), (R, BK // 2))


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, out_ptr, R, C2, BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    kh = tl.program_id(1) * BC + tl.arange(0, BC)  # packed byte columns
    kb = tl.program_id(1) * (BC // 8) + tl.arange(0, BC // 8)  # 16-element block columns
    row_ok = rows < R
    r64 = rows.to(tl.int64)
    data = tl.load(data_ptr + r64[:, None] * C2 + kh[None, :], mask=row_ok[:, None] & (kh < C2)[None, :], other=0)
    s = tl.load(scale_ptr + r64[:, None] * (C2 // 8) + kb[None, :],
                mask=row_ok[:, None] & (kb < C2 // 8)[None, :], other=0)
    lo, hi = _deq_nibbles(data, _expand_scales(_scale_fp16(s), BR, 2 * BC))
    lo = (lo.to(tl.float32) * 16384.0).to(tl.bfloat16)  # exact: deq() * 2**-14 -> deq()
    hi = (hi.to(tl.float32) * 16384.0).to(tl.bfloat16)
    vals = tl.reshape(tl.join(lo, hi), (BR, 2 * BC))  # elements 2i, 2i+1 interleaved
    cols = tl.program_id(1) * (2 * BC) + tl.arange(0, 2 * BC)
    out_ptrs = out_ptr + r64[:, None] * (2 * C2) + cols[None, :]
    tl.store(out_ptrs, vals, mask=row_ok[:, None] & (cols < 2 * C2)[None, :])


@kernel_op("nvfp4_kernels::dequantize_bf16")
def _dequantize_op(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data (R, C/2) uint8, scale (R, C/16) uint8 bits, both contiguous -> (R, C) bf16."""
    rows, half = data.shape
    out = data.new_empty(rows, 2 * half, dtype=torch.bfloat16)
    if out.numel() == 0:
        return out
    cfg = dequant_config()
    launch(
        _dequantize_kernel, (cdiv(rows, cfg.block_r), cdiv(half, cfg.block_c)),
        data_ptr=data, scale_ptr=scale, out_ptr=out, R=rows, C2=half,
        BR=cfg.block_r, BC=cfg.block_c, num_warps=cfg.num_warps,
    )
    return out


def dequantize_bf16(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """deq() of an NVFP4 copy as bf16: data (..., C/2) uint8 and scale (..., C/16) E4M3
    (or its uint8 bits) -> (..., C) bf16, equal bit for bit to
    ``formats.block_values(data, scale).to(torch.bfloat16)`` (global scale not applied)."""
    if data.dim() < 1 or data.dtype != torch.uint8:
        raise ValueError(f"dequantize_bf16: data must be packed uint8 (..., C/2), got {data.dtype} {tuple(data.shape)}")
    half = data.shape[-1]
    if half % 8 or scale.shape != (*data.shape[:-1], half // 8):
        raise ValueError(f"dequantize_bf16: need C % 16 == 0 and scale (..., C/16); got data "
                         f"{tuple(data.shape)}, scale {tuple(scale.shape)}")
    bits = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    out = _dequantize_op(data.reshape(-1, half).contiguous(), bits.reshape(-1, half // 8).contiguous())
    return out.view(*data.shape[:-1], 2 * half)
