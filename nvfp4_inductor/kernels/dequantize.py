"""NVFP4 -> bf16 deq() copies: the operands of the bf16-operand grouped GEMMs
(grouped_gemm_bf16.py, grouped_gemm_act.py, grouped_gemm_dact.py).

    out[r, c] = bf16(e2m1(data)[r, c] * e4m3(scale)[r, c // 16])   (no global scale)

Kernel ``_dequantize_kernel``; launchers ``dequantize_bf16_pair`` (a GEMM's two operands,
one launch), ``dequantize_bf16`` (one operand) and ``weight_slices`` (a weight stack's
copy a slice of rows at a time, the first slice with the token operand, inside another
op's body); op
``nvfp4_kernels::dequantize_bf16_pair``.
Reference twin: ``formats.block_values(data, scale).to(torch.bfloat16)`` -- bit for bit:
deq() has at most 6 significant bits and lies in [2**-10, 2688], so it is exact in bf16
and no rounding happens anywhere (numerics.md 7).

One launch per GEMM: both operands of every GEMM here have the same packed width (fprop /
dgrad: K-major, K = H or F; wgrad: rows of P padded tokens), so one grid covers the row
blocks of a, then those of b, and each program picks its operand from its row-block
index (a compiled training step makes 6 such launches instead of 12: fewer launches, less
host time). The two outputs are separate tensors: an op may not return
aliases of each other. A single operand is the pair with an empty b.

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
BC packed bytes (2 BC elements) of one row block of one operand, so each thread loads
16 contiguous bytes and stores 32 contiguous bf16 (four 16-byte stores). Inputs of any leading shape
(R, C/2) + (R, C/16) or (G, N, K/2) + (G, N, K/16) are flattened to rows. Tiles:
``config.dequant_config``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import is_deq_values
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
def _dequantize_rows(data_ptr, scale_ptr, out_ptr, R, C2, row_block, col_block, src_rpg, src_stride, src_off,
                     BR: tl.constexpr, BC: tl.constexpr):
    """Output rows row_block * BR + [0, BR), packed bytes col_block * BC + [0, BC) of one
    operand. Output row r reads source row (r // src_rpg) * src_stride + src_off + r % src_rpg:
    a slice of src_rpg rows at src_off of each group of src_stride rows (a whole operand:
    src_rpg = R, src_stride = 0, src_off = 0)."""
    rows = row_block * BR + tl.arange(0, BR)
    kh = col_block * BC + tl.arange(0, BC)  # packed byte columns
    kb = col_block * (BC // 8) + tl.arange(0, BC // 8)  # 16-element block columns
    row_ok = rows < R
    r64 = rows.to(tl.int64)
    src = (rows // src_rpg).to(tl.int64) * src_stride + src_off + rows % src_rpg
    data = tl.load(data_ptr + src[:, None] * C2 + kh[None, :], mask=row_ok[:, None] & (kh < C2)[None, :], other=0)
    # scales read as E4M3 code bytes (from an E4M3 tensor or its uint8 bits: a dtype view
    # outside the kernel would be one more host op per operand in a compiled step)
    s = tl.load(scale_ptr.to(tl.pointer_type(tl.uint8)) + src[:, None] * (C2 // 8) + kb[None, :],
                mask=row_ok[:, None] & (kb < C2 // 8)[None, :], other=0)
    lo, hi = _deq_nibbles(data, _expand_scales(_scale_fp16(s), BR, 2 * BC))
    lo = (lo.to(tl.float32) * 16384.0).to(tl.bfloat16)  # exact: deq() * 2**-14 -> deq()
    hi = (hi.to(tl.float32) * 16384.0).to(tl.bfloat16)
    vals = tl.reshape(tl.join(lo, hi), (BR, 2 * BC))  # elements 2i, 2i+1 interleaved
    cols = col_block * (2 * BC) + tl.arange(0, 2 * BC)
    out_ptrs = out_ptr + r64[:, None] * (2 * C2) + cols[None, :]
    tl.store(out_ptrs, vals, mask=row_ok[:, None] & (cols < 2 * C2)[None, :])


@triton.jit
def _dequantize_kernel(a_data_ptr, a_scale_ptr, a_out_ptr, RA, b_data_ptr, b_scale_ptr, b_out_ptr, RB, C2,
                       b_rpg, b_stride, b_off, BR: tl.constexpr, BC: tl.constexpr):
    """Row blocks of a first, then of b: the program's row block picks its operand. b may be
    a slice of rows of each group (``_dequantize_rows``)."""
    a_blocks = tl.cdiv(RA, BR)
    rb = tl.program_id(0)
    if rb < a_blocks:
        _dequantize_rows(a_data_ptr, a_scale_ptr, a_out_ptr, RA, C2, rb, tl.program_id(1), RA, 0, 0, BR, BC)
    else:
        _dequantize_rows(b_data_ptr, b_scale_ptr, b_out_ptr, RB, C2, rb - a_blocks, tl.program_id(1),
                         b_rpg, b_stride, b_off, BR, BC)


@kernel_op("nvfp4_kernels::dequantize_bf16_pair")
def _dequantize_op(
    a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """data (R, C/2) uint8, scale (R, C/16) E4M3 (or its uint8 bits), both contiguous, the
    same C for a and b -> ((Ra, C), (Rb, C)) bf16: two outputs, so neither aliases the other."""
    a_rows, half = a_data.shape
    b_rows = b_data.shape[0]
    a_out = a_data.new_empty(a_rows, 2 * half, dtype=torch.bfloat16)
    b_out = b_data.new_empty(b_rows, 2 * half, dtype=torch.bfloat16)
    cfg = dequant_config()
    launch(
        _dequantize_kernel, (cdiv(a_rows, cfg.block_r) + cdiv(b_rows, cfg.block_r), cdiv(half, cfg.block_c)),
        a_data_ptr=a_data, a_scale_ptr=a_scale, a_out_ptr=a_out, RA=a_rows,
        b_data_ptr=b_data, b_scale_ptr=b_scale, b_out_ptr=b_out, RB=b_rows, C2=half,
        b_rpg=max(b_rows, 1), b_stride=0, b_off=0, BR=cfg.block_r, BC=cfg.block_c, num_warps=cfg.num_warps,
    )
    return a_out, b_out


def weight_slices(data: torch.Tensor, scale: torch.Tensor, a_data: torch.Tensor, a_scale: torch.Tensor):
    """For a kernel op's body that makes a packed weight stack's bf16 copy a slice at a time
    (grouped_gemm_bf16.py, grouped_gemm_dact.py): data (G, N, C/2) uint8 and scale (G, N,
    C/16) E4M3 (or its uint8 bits), contiguous, and the GEMM's token operand a, (T, C) bf16
    deq() values (a_scale unread) or packed (T, C/2) + (T, C/16), contiguous -> a function
    (first, rows) that launches the deq() of rows [first, first + rows) of every expert into
    a new (G, rows, C) bf16 tensor and returns (a's bf16 copy, that slice). A packed a is
    dequantized by the first slice's launch, as a pair (one launch fewer than apart)."""
    groups, n, half = data.shape
    rows_data, rows_scale = data.view(groups * n, half), scale.view(groups * n, -1)
    cfg = dequant_config()
    a = a_data if is_deq_values(a_data) else None

    def make(first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal a
        out = data.new_empty(groups, rows, 2 * half, dtype=torch.bfloat16)
        if a is None:  # the first slice, with a's copy
            a = data.new_empty(a_data.shape[0], 2 * half, dtype=torch.bfloat16)
            a_rows, a_src, a_scales, a_out = a_data.shape[0], a_data, a_scale, a
        else:  # no rows of a: its output an empty tensor of its own (passed `out` twice, a traced
            # launch would have two outputs alias, and Inductor copies one of them first)
            a_rows, a_src, a_scales, a_out = 0, rows_data, rows_scale, out.new_empty(0)
        launch(
            _dequantize_kernel, (cdiv(a_rows, cfg.block_r) + cdiv(groups * rows, cfg.block_r), cdiv(half, cfg.block_c)),
            a_data_ptr=a_src, a_scale_ptr=a_scales, a_out_ptr=a_out, RA=a_rows,
            b_data_ptr=rows_data, b_scale_ptr=rows_scale, b_out_ptr=out, RB=groups * rows, C2=half,
            b_rpg=rows, b_stride=n, b_off=first, BR=cfg.block_r, BC=cfg.block_c, num_warps=cfg.num_warps,
        )
        return a, out

    return make


def _rows(data: torch.Tensor, scale: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked (rows, C/2) data and (rows, C/16) scales (E4M3 or its uint8 bits), contiguous."""
    if data.dim() < 1 or data.dtype != torch.uint8:
        raise ValueError(f"{name}: data must be packed uint8 (..., C/2), got {data.dtype} {tuple(data.shape)}")
    half = data.shape[-1]
    if half % 8 or scale.shape != (*data.shape[:-1], half // 8):
        raise ValueError(f"{name}: need C % 16 == 0 and scale (..., C/16); got data "
                         f"{tuple(data.shape)}, scale {tuple(scale.shape)}")
    if scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"{name}: scale must be E4M3 (torch.float8_e4m3fn) or its uint8 bits, got {scale.dtype}")
    return data.reshape(-1, half).contiguous(), scale.reshape(-1, half // 8).contiguous()


def dequantize_bf16_pair(
    a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dequantize_bf16`` of a GEMM's two operands in one launch: (deq(a), deq(b)). Their
    packed widths must be equal, as they are for every GEMM here (fprop/dgrad: both
    K-major; wgrad: both rows of P tokens)."""
    if a_data.shape[-1:] != b_data.shape[-1:]:
        raise ValueError(f"dequantize_bf16_pair: a and b need the same packed width, got data "
                         f"{tuple(a_data.shape)} and {tuple(b_data.shape)}")
    a, b = _dequantize_op(*_rows(a_data, a_scale, "dequantize_bf16_pair"),
                          *_rows(b_data, b_scale, "dequantize_bf16_pair"))
    return a.view(*a_data.shape[:-1], a.shape[1]), b.view(*b_data.shape[:-1], b.shape[1])


def bf16_operands(
    a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A GEMM's two bf16 deq() operands: an operand already given as its deq() values
    (``formats.is_deq_values``) is used as is; the packed ones are dequantized, both in one
    launch."""
    a_deq, b_deq = is_deq_values(a_data), is_deq_values(b_data)
    if not (a_deq or b_deq):
        return dequantize_bf16_pair(a_data, a_scale, b_data, b_scale)
    a = a_data if a_deq else dequantize_bf16(a_data, a_scale)
    return a, (b_data if b_deq else dequantize_bf16(b_data, b_scale))


def dequantize_bf16(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """deq() of an NVFP4 copy as bf16: data (..., C/2) uint8 and scale (..., C/16) E4M3
    (or its uint8 bits) -> (..., C) bf16, equal bit for bit to
    ``formats.block_values(data, scale).to(torch.bfloat16)`` (global scale not applied).
    The pair launch with an empty second operand."""
    rows, scales = _rows(data, scale, "dequantize_bf16")
    # the empty second operand made with new_empty, not a slice: a traced step (fake CUDA
    # tensors on a CPU-only torch) failed on the slice
    out, _ = _dequantize_op(rows, scales, rows.new_empty(0, rows.shape[1]), scales.new_empty(0, scales.shape[1]))
    return out.view(*data.shape[:-1], out.shape[1])
