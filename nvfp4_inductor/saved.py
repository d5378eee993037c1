"""What the grouped MLP's forward keeps for its backward, as one named structure.

The eager chain (``nn.py``) and the fused ops (``compiler/fused.py``) save the same fields;
the fused forward op returns them after Y, in field order (``flatten`` / ``unflatten``),
and ``explain`` lists them by their labels. Shapes: T tokens, H hidden, F1 fc1 outputs
(F, or 2F for a gated activation), F fc2 inputs, G experts, P the padded column-wise
capacity (``numerics.columnwise_capacity``).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from .tensor import Operand


class SavedForBackward(NamedTuple):
    c: Tensor  # (T, F1) bf16: fc1's output, the pre-activation (D is regenerated from it)
    x_col_data: Tensor  # (H, P/2) uint8: x's column-wise (RHT) copy, for fc1's wgrad
    x_col_scale: Tensor  # (H, P/16) e4m3
    x_col_amax: Tensor  # (G,) fp32
    offsets: Tensor  # (G+1,) int64: padded group offsets of the column-wise copies
    w1_col_data: Tensor  # (G, H, F1/2) uint8: W1's column-wise copy, for fc1's dgrad
    w1_col_scale: Tensor  # (G, H, F1/16) e4m3
    w1_amax: Tensor  # (G,) fp32
    w2_col_data: Tensor  # (G, F, H/2) uint8: W2's column-wise copy, for fc2's dgrad
    w2_col_scale: Tensor  # (G, F, H/16) e4m3
    w2_amax: Tensor  # (G,) fp32
    d_col_amax: Tensor  # (G,) fp32: D's column-wise amax (post-RHT with RHT), for fc2's wgrad
    d_col_data: Tensor  # (F, P/2) uint8: D's column-wise copy; empty (0,) with recompute
    d_col_scale: Tensor  # (F, P/16) e4m3; empty (0,) with recompute

    # The saved copies as the backward's GEMM operands
    def x_col(self) -> Operand:
        return Operand(self.x_col_data, self.x_col_scale, self.x_col_amax)

    def w1_col(self) -> Operand:
        return Operand(self.w1_col_data, self.w1_col_scale, self.w1_amax)

    def w2_col(self) -> Operand:
        return Operand(self.w2_col_data, self.w2_col_scale, self.w2_amax)

    def d_col(self) -> Operand:
        return Operand(self.d_col_data, self.d_col_scale, self.d_col_amax)

    def flatten(self) -> list[Tensor]:
        return list(self)

    @classmethod
    def unflatten(cls, tensors) -> "SavedForBackward":
        return cls(*tensors)


# For explain: what each field is, in a person's words.
LABELS = {
    "c": "C", "x_col_data": "x col data", "x_col_scale": "x col scale", "x_col_amax": "x col amax",
    "offsets": "padded offsets", "w1_col_data": "W1 col data", "w1_col_scale": "W1 col scale",
    "w1_amax": "W1 amax", "w2_col_data": "W2 col data", "w2_col_scale": "W2 col scale", "w2_amax": "W2 amax",
    "d_col_amax": "D col amax", "d_col_data": "D col data", "d_col_scale": "D col scale",
}
# Fields left empty when the backward regenerates D (recompute).
REGENERATED = ("d_col_data", "d_col_scale")
