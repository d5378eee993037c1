"""Containers for quantized tensors: what a quantizer returns and a GEMM consumes.

Plain dataclasses of torch tensors (not tensor subclasses): they cross the
``nvfp4::*`` op boundary as tuples (``as_tuple``); ops return an empty tensor for a
missing copy and ``quantize.py`` turns those back into None. A GEMM takes one copy of
each of its two operands: an ``Operand`` (``rowwise()`` / ``columnwise()``), flattened to
its three tensors only in an op's schema (``ops.py``, the kernels' ``kernel_op`` ops).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from .constants import BLOCK
from .formats import dequantize_blocks


class Operand(NamedTuple):
    """One copy of a quantized tensor, as a GEMM reads it: data (packed E2M1 codes, or
    their deq() values in bf16 with an empty scale: ``formats.operand_values``), its
    per-block decode scales, and its amax (one per group or expert)."""

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor


@dataclasses.dataclass
class NVFP4Tensor:
    """One (M, K) tensor in NVFP4.

    rowwise_data:     uint8 (M, K/2), two E2M1 codes per byte, even index in the low nibble
    rowwise_scale:    float8_e4m3fn (M, K/16), one decode scale per 1x16 block, unswizzled
                      (2D quantization: each 16x16 tile's scale repeated on its 16 rows)
    rowwise_amax:     fp32 scalar, the global amax of x
    columnwise_data:  uint8 (K, M/2), the quantization of x^T (RHT'd along M when `rht`)
    columnwise_scale: float8_e4m3fn (K, M/16)
    columnwise_amax:  fp32 scalar, amax of x^T after the RHT (= rowwise_amax without RHT)
    A copy that was not asked for is None.
    """

    rowwise_data: Optional[torch.Tensor]
    rowwise_scale: Optional[torch.Tensor]
    rowwise_amax: Optional[torch.Tensor]
    columnwise_data: Optional[torch.Tensor]
    columnwise_scale: Optional[torch.Tensor]
    columnwise_amax: Optional[torch.Tensor]

    def dequantize(self, columnwise: bool = False) -> torch.Tensor:
        """fp32 (M, K) from the row-wise copy, or fp32 (K, M) from the column-wise copy
        (which holds RHT(x^T) when it was quantized with `rht`)."""
        if columnwise:
            return _dequantize_copy(self.columnwise_data, self.columnwise_scale, self.columnwise_amax, "columnwise")
        return _dequantize_copy(self.rowwise_data, self.rowwise_scale, self.rowwise_amax, "rowwise")

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclasses.dataclass
class NVFP4GroupedTensor:
    """A (T, K) tensor whose rows are G groups (experts) of sizes m_g, quantized per group.

    rowwise_data:       uint8 (T, K/2), groups back to back
    rowwise_scale:      float8_e4m3fn (T, K/16)
    rowwise_amax:       fp32 (G,), per-group amax (0 for an empty group)
    columnwise_data:    uint8 (K, P/2): group g's column-wise copy (the quantization of its
                        rows transposed, RHT'd in runs of 16 tokens when `rht`) is the
                        column slice [p_g/2, (p_g + m_g')/2), m_g' = m_g rounded up to 16,
                        p_g = m_0' + ... + m_{g-1}'. Rows past a group's end are zeros.
    columnwise_scale:   float8_e4m3fn (K, P/16), sliced alike in units of 16 tokens
    columnwise_amax:    fp32 (G,), post-RHT amax per group
    columnwise_offsets: int64 (G + 1,), p_0 = 0, ..., p_G (on the device)
    group_sizes:        int64 (G,), the m_g (on the device)

    P = capacity(T, G) = round_up(T + 15 G, 16) is fixed by the shapes alone, so the
    buffers are allocated without reading group sizes on the host:

        tokens  0 ........ m_0-1 | pad | m_0 ...... m_0+m_1-1 | pad | ...   | unused
        column  p_0=0            p_1=m_0'                     p_2      ... p_G     P
    """

    rowwise_data: Optional[torch.Tensor]
    rowwise_scale: Optional[torch.Tensor]
    rowwise_amax: Optional[torch.Tensor]
    columnwise_data: Optional[torch.Tensor]
    columnwise_scale: Optional[torch.Tensor]
    columnwise_amax: Optional[torch.Tensor]
    columnwise_offsets: torch.Tensor
    group_sizes: torch.Tensor

    def rowwise(self) -> Operand:
        """The the row-wise copy: a GEMM step's operand."""
        return Operand(self.rowwise_data, self.rowwise_scale, self.rowwise_amax)

    def columnwise(self) -> Operand:
        """The the column-wise copy: a wgrad step's operand."""
        return Operand(self.columnwise_data, self.columnwise_scale, self.columnwise_amax)

    def columnwise_chunks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group, (data (K, m_g'/2), scale (K, m_g'/16)). Reads offsets on the host."""
        if self.columnwise_data is None:
            raise ValueError("columnwise_chunks: this tensor was quantized without the column-wise copy")
        offsets = self.columnwise_offsets.tolist()
        return [
            (self.columnwise_data[:, lo // 2 : hi // 2], self.columnwise_scale[:, lo // BLOCK : hi // BLOCK])
            for lo, hi in zip(offsets[:-1], offsets[1:])
        ]

    def dequantize(self, columnwise: bool = False):
        """Row-wise: fp32 (T, K). Column-wise: a list of fp32 (K, m_g') per group."""
        if columnwise:
            amaxes = self.columnwise_amax.tolist()
            return [
                _dequantize_copy(data, scale, torch.tensor(amax, device=data.device), "columnwise")
                for (data, scale), amax in zip(self.columnwise_chunks(), amaxes)
            ]
        if self.rowwise_data is None:
            raise ValueError("dequantize: this tensor was quantized without the row-wise copy")
        group_of_row = torch.repeat_interleave(
            torch.arange(len(self.group_sizes), device=self.group_sizes.device),
            self.group_sizes,
            output_size=self.rowwise_data.shape[0],
        )
        return dequantize_blocks(self.rowwise_data, self.rowwise_scale, self.rowwise_amax[group_of_row].unsqueeze(1))

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def _dequantize_copy(data, scale, amax, which: str) -> torch.Tensor:
    if data is None:
        raise ValueError(f"dequantize: this tensor was quantized without the {which} copy")
    return dequantize_blocks(data, scale, amax)




@dataclasses.dataclass
class NVFP4WeightStack:
    """A (G, N, K) stack of expert weights, quantized per expert (numerics.md 4: 16x16 tiles).

    rowwise_data:     uint8 (G, N, K/2)   feeds fprop (x . W^T, contraction over K)
    rowwise_scale:    float8_e4m3fn (G, N, K/16)
    columnwise_data:  uint8 (G, K, N/2)   the quantization of each W^T; feeds dgrad
    columnwise_scale: float8_e4m3fn (G, K, N/16)
    amax:             fp32 (G,), per-expert amax, shared by both copies (no RHT on weights)
    With 16x16 tiles the column-wise copy is the exact transpose of the row-wise one.
    """

    rowwise_data: torch.Tensor
    rowwise_scale: torch.Tensor
    columnwise_data: torch.Tensor
    columnwise_scale: torch.Tensor
    amax: torch.Tensor

    def rowwise(self) -> Operand:
        """The the row-wise copy: fprop's weight operand."""
        return Operand(self.rowwise_data, self.rowwise_scale, self.amax)

    def columnwise(self) -> Operand:
        """The the column-wise copy: dgrad's weight operand."""
        return Operand(self.columnwise_data, self.columnwise_scale, self.amax)

    def dequantize(self, columnwise: bool = False) -> torch.Tensor:
        """fp32 (G, N, K) from the row-wise copy, or (G, K, N) from the column-wise copy."""
        data, scale = (self.columnwise_data, self.columnwise_scale) if columnwise else (self.rowwise_data, self.rowwise_scale)
        g, n, half = data.shape
        amax = self.amax.float().repeat_interleave(n).unsqueeze(1)
        return dequantize_blocks(data.reshape(g * n, half), scale.reshape(g * n, -1), amax).reshape(g, n, 2 * half)

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))
