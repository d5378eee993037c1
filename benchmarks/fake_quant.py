"""The NVFP4 training chain written as plain PyTorch ops: the "fake-quant" row of
benchmarks/grouped_mlp.py, which stock ``torch.compile`` (Inductor) compiles end to end.

It quantizes what our fused ops quantize, with the reference functions of
``nvfp4_inductor.numerics`` called directly (no custom ops, so Inductor sees and fuses
every step), and dequantizes each copy to bf16 (fp32 deq() times its global scale, then
rounded) for ``torch._grouped_mm``:

    forward   fc1: x row-wise (per-expert amax), W1 16x16 tiles     -> act(C) * p = D (bf16)
              fc2: D row-wise, W2 16x16 tiles                        -> Y
    backward  dgrad: dY / dC row-wise with stochastic rounding, W2 / W1 column-wise tiles
              wgrad: dY / dC and D / x column-wise, random Hadamard transform over each
                     expert's tokens (16-token runs, padded layout), SR on the gradients

Differences from our chain, on purpose (this row is a cost baseline, not a twin): the
global scale is folded into the bf16 operands instead of multiplying the fp32
accumulator; D is saved in bf16 (no recompute); the Philox seeds are fixed per call
site rather than drawn per step (the random bytes are still computed on the device every
step, so the cost is the same). Gradients go straight through the quantizers.
"""

from __future__ import annotations

import torch

from nvfp4_inductor import numerics
from nvfp4_inductor.constants import INV_FP4_E4M3_MAX
from nvfp4_inductor.formats import block_values, dequantize_blocks


def _ends(sizes: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(sizes, 0, dtype=torch.int32)


def _rows(q, sizes: torch.Tensor) -> torch.Tensor:
    """bf16 values of a grouped row-wise copy (T, K)."""
    group_of_row = numerics.group_layout(sizes, q.rowwise_data.shape[0])[0]
    return dequantize_blocks(q.rowwise_data, q.rowwise_scale, q.rowwise_amax[group_of_row].unsqueeze(1)).bfloat16()


def _columns(q, tokens: int) -> torch.Tensor:
    """bf16 values of a grouped column-wise copy (K, P) of `tokens` tokens, zeros in the padding."""
    group_of_padded = numerics.group_layout(q.group_sizes, tokens)[3]
    return (block_values(q.columnwise_data, q.columnwise_scale)
            * (q.columnwise_amax[group_of_padded] * INV_FP4_E4M3_MAX)).bfloat16()


def _weights(w: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """bf16 values of a (G, N, K) weight stack's row-wise copy, or (G, K, N) of its column-wise one."""
    q = numerics.quantize_weights_torch(w)
    data, scale = (q.columnwise_data, q.columnwise_scale) if columnwise else (q.rowwise_data, q.rowwise_scale)
    g, rows, half = data.shape
    amax = q.amax.repeat_interleave(rows).unsqueeze(1)
    return dequantize_blocks(data.reshape(g * rows, half), scale.reshape(g * rows, -1), amax).reshape(
        g, rows, 2 * half).bfloat16()


class FakeQuantGroupedMM(torch.autograd.Function):
    """out[t] = a[t] . w_g^T for t in group g, every operand of the forward, dgrad and
    wgrad GEMMs quantize-dequantized as NVFP4 (module docstring). `seed` fixes the
    stochastic rounding of this call site's gradient."""

    @staticmethod
    def forward(ctx, a, w, sizes, seed):
        ctx.save_for_backward(a, w, sizes)
        ctx.seed = seed  # None: round to nearest
        aq = numerics.group_quantize_torch(a, sizes, rowwise=True)
        return torch._grouped_mm(_rows(aq, sizes), _weights(w, False).transpose(1, 2), offs=_ends(sizes))

    @staticmethod
    def backward(ctx, dout):
        a, w, sizes = ctx.saved_tensors
        gq = numerics.group_quantize_torch(dout.contiguous(), sizes, rowwise=True, columnwise=True, rht=True,
                                           stochastic_rounding=ctx.seed is not None, seed=ctx.seed)
        da = torch._grouped_mm(_rows(gq, sizes), _weights(w, True).transpose(1, 2), offs=_ends(sizes))
        aq = numerics.group_quantize_torch(a, sizes, rowwise=False, columnwise=True, rht=True)
        offs = gq.columnwise_offsets[1:].to(torch.int32)
        dw = torch._grouped_mm(_columns(gq, a.shape[0]), _columns(aq, a.shape[0]).t(), offs=offs)
        return da, dw, None, None


def fake_quant_mlp(activation_fn, stochastic_rounding: bool = True):
    """(x, w1, w2, sizes, probs) -> Y of the grouped MLP with `activation_fn(C fp32)`."""
    seeds = (0x5EED1, 0x5EED2) if stochastic_rounding else (None, None)

    def run(x, w1, w2, sizes, probs):
        c = FakeQuantGroupedMM.apply(x, w1, sizes, seeds[0])
        d = (activation_fn(c.float()) * probs[:, None]).bfloat16()
        return FakeQuantGroupedMM.apply(d, w2, sizes, seeds[1])

    return run
