"""NVFP4 -> bf16 deq() copies: the operands of the bf16-operand grouped GEMMs
(grouped_gemm_bf16.py).

    out[r, c] = bf16(e2m1(data)[r, c] * e4m3(scale)[r, c // 16])   (no global scale)

Kernel ``_dequantize_kernel``; launcher ``dequantize_bf16``; op ``nvfp4_kernels::dequantize_bf16``.
Reference twin: ``formats.block_values(data, scale).to(torch.bfloat16)`` -- bit for bit:
deq() has at most 6 significant bits and lies in [2**-10, 2688], so it is exact in bf16
and no rounding happens anywhere (SPEC 7).

Arithmetic: the helpers of grouped_gemm.py (integer bit placement, no fp8 casts,
PITFALLS): ``scale_fp16`` gives the exact fp16 scale, ``deq_nibbles`` the exact fp16
products deq() * 2**-14 of the low (element 2i) and high (element 2i+1) nibbles; each is
widened to fp32 (exact), multiplied by 2**14 (exact) and narrowed to bf16 (exact, so the
interpreter's truncating cast gives the same bits), then the two are interleaved.

Memory-bound: reads 0.5625 B and writes 2 B per element. A program owns BR rows and
BC packed bytes (2 BC elements) of one row block, so each thread loads 16 contiguous bytes
and stores 32 contiguous bf16 (four 16-byte stores). Inputs of any leading shape
(R, C/2) + (R, C/16) or (G, N, K/2) + (G, N, K/16) are flattened to rows.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._registry import INTERPRET, cdiv, kernel_op, launch
from .grouped_gemm import deq_nibbles, expand_scales, scale_fp16


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
    lo, hi = deq_nibbles(data, expand_scales(scale_fp16(s), BR, 2 * BC))
    lo = (lo.to(tl.float32) * 16384.0).to(tl.bfloat16)  # exact: deq() * 2**-14 -> deq()
    hi = (hi.to(tl.float32) * 16384.0).to(tl.bfloat16)
    vals = tl.reshape(tl.join(lo, hi), (BR, 2 * BC))  # elements 2i, 2i+1 interleaved
    cols = tl.program_id(1) * (2 * BC) + tl.arange(0, 2 * BC)
    out_ptrs = out_ptr + r64[:, None] * (2 * C2) + cols[None, :]
    tl.store(out_ptrs, vals, mask=row_ok[:, None] & (cols < 2 * C2)[None, :])


@dataclasses.dataclass(frozen=True)
class DequantConfig:
    block_r: int  # rows per program
    block_c: int  # packed bytes per program row (2 * block_c elements), a multiple of 8
    num_warps: int


_OVERRIDE: list[DequantConfig] = []


def dequant_config() -> DequantConfig:
    if _OVERRIDE:
        return _OVERRIDE[-1]
    if INTERPRET:  # numpy: few, large programs
        return DequantConfig(64, 64, 4)
    # 16 bytes in / 64 bytes out per thread: 32 x 128 bytes over 8 warps of 32 threads
    return DequantConfig(32, 128, 8)


class override_config:
    """``with override_config(DequantConfig(...))``: pin the tile (no result bit depends on it)."""

    def __init__(self, cfg: DequantConfig):
        self.cfg = cfg

    def __enter__(self):
        _OVERRIDE.append(self.cfg)
        return self

    def __exit__(self, *exc):
        _OVERRIDE.pop()


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
