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
accumulator; D is saved in bf16 (no recompute); the stochastic-rounding bytes come from
``torch.randint`` (Inductor's own RNG, one draw per element) rather than numerics.md's Philox
words per 16-element block: with ``numerics.sr_random_bytes`` inlined, Inductor's
lowering of the backward took over 5 minutes (its per-node op counting is quadratic in
the 10-round Philox chains; CPU profile, 2026-11-29). Gradients go straight through
the quantizers.
"""

from __future__ import annotations

import torch

from nvfp4_inductor import numerics
from nvfp4_inductor.constants import BLOCK, INV_FP4_E4M3_MAX, RHT_DEFAULT_SIGN_MASK
from nvfp4_inductor.formats import block_values, dequantize_blocks
from nvfp4_inductor.tensor import NVFP4GroupedTensor


def _ends(sizes: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(sizes, 0, dtype=torch.int32)


def _rows(q) -> torch.Tensor:
    """bf16 values of a grouped row-wise copy (T, K)."""
    group_of_row = numerics.group_layout(q.group_sizes, q.rowwise_data.shape[0])[0]
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


def _group_quantize(x, sizes, *, rowwise=True, columnwise=False, stochastic_rounding=False):
    """``numerics.group_quantize_torch`` with the column-wise copy RHT'd, and SR bytes from
    ``torch.randint`` (module docstring)."""
    tokens, k = x.shape
    groups = sizes.numel()
    group_of_row, padded_row, padded_offsets, group_of_padded_row = numerics.group_layout(sizes, tokens)
    q = NVFP4GroupedTensor(None, None, None, None, None, None, padded_offsets, sizes.to(torch.int64))

    def random_bytes(shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=x.device) if stochastic_rounding else None

    if rowwise:
        q.rowwise_amax = numerics.group_amax(x, group_of_row, groups)
        q.rowwise_data, q.rowwise_scale = numerics.quantize_rows(x, q.rowwise_amax[group_of_row].unsqueeze(1),
                                                                 rbytes=random_bytes(x.shape))
    if columnwise:
        xt = numerics.rht16(numerics.pad_groups(x, padded_row, numerics.columnwise_capacity(tokens, groups)).t(),
                            RHT_DEFAULT_SIGN_MASK)
        q.columnwise_amax = numerics.group_amax(xt.t(), group_of_padded_row, groups)
        q.columnwise_data, q.columnwise_scale = numerics.quantize_rows(
            xt, q.columnwise_amax[group_of_padded_row[::BLOCK]].unsqueeze(0), rbytes=random_bytes(xt.shape))
    return q


class FakeQuantGroupedMM(torch.autograd.Function):
    """out[t] = a[t] . w_g^T for t in group g, every operand of the forward, dgrad and
    wgrad GEMMs quantize-dequantized as NVFP4 (module docstring); `stochastic_rounding`
    on the incoming gradient."""

    @staticmethod
    def forward(ctx, a, w, sizes, stochastic_rounding):
        ctx.save_for_backward(a, w, sizes)
        ctx.stochastic_rounding = stochastic_rounding
        aq = _group_quantize(a, sizes)
        return torch._grouped_mm(_rows(aq), _weights(w, False).transpose(1, 2), offs=_ends(sizes))

    @staticmethod
    def backward(ctx, dout):
        a, w, sizes = ctx.saved_tensors
        gq = _group_quantize(dout.contiguous(), sizes, columnwise=True, stochastic_rounding=ctx.stochastic_rounding)
        da = torch._grouped_mm(_rows(gq), _weights(w, True).transpose(1, 2), offs=_ends(sizes))
        aq = _group_quantize(a, sizes, rowwise=False, columnwise=True)
        offs = gq.columnwise_offsets[1:].to(torch.int32)
        dw = torch._grouped_mm(_columns(gq, a.shape[0]), _columns(aq, a.shape[0]).t(), offs=offs)
        return da, dw, None, None


def fake_quant_mlp(activation_fn, stochastic_rounding: bool = True):
    """(x, w1, w2, sizes, probs) -> Y of the grouped MLP with `activation_fn(C fp32)`."""

    def run(x, w1, w2, sizes, probs):
        c = FakeQuantGroupedMM.apply(x, w1, sizes, stochastic_rounding)
        d = (activation_fn(c.float()) * probs[:, None]).bfloat16()
        return FakeQuantGroupedMM.apply(d, w2, sizes, stochastic_rounding)

    return run
