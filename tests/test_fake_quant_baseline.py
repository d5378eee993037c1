"""The fake-quant row of benchmarks/grouped_mlp.py quantizes the operands our chain
quantizes (benchmarks/fake_quant.py): each GEMM of a layer, forward, dgrad and wgrad,
against the reference GEMMs on the reference quantizations (SR off). They differ only by
where the global scale is applied (folded into the bf16 operands vs the fp32 accumulator),
a rounding of ~2**-9 per operand value; any operand quantized differently (no RHT on a
wgrad operand, a row-wise copy where a column-wise one belongs) is off by ~10%."""

import os
import sys

import torch

from nvfp4_inductor import numerics

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from fake_quant import FakeQuantGroupedMM  # noqa: E402


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fake_quant_layer_quantizes_what_the_chain_quantizes():
    gen = torch.Generator().manual_seed(3)
    sizes, (t, k, n) = torch.tensor([37, 0, 80, 43]), (160, 64, 48)
    a = torch.randn(t, k, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(4, n, k, generator=gen) * 0.2).bfloat16().requires_grad_()
    dout = torch.randn(t, n, generator=gen).bfloat16()
    out = FakeQuantGroupedMM.apply(a, w, sizes, False)
    da, dw = torch.autograd.grad(out, (a, w), dout)

    aq = numerics.group_quantize_torch(a.detach(), sizes, rowwise=True, columnwise=True, rht=True)
    wq = numerics.quantize_weights_torch(w.detach())
    gq = numerics.group_quantize_torch(dout, sizes, rowwise=True, columnwise=True, rht=True)
    out_ref = numerics.grouped_gemm_torch(aq.rowwise(), wq.rowwise(), sizes)
    da_ref = numerics.grouped_gemm_torch(gq.rowwise(), wq.columnwise(), sizes)
    dw_ref = numerics.grouped_gemm_wgrad_torch(gq.columnwise(), aq.columnwise(), aq.columnwise_offsets)
    for name, got, ref in (("forward", out, out_ref), ("dgrad", da, da_ref), ("wgrad", dw, dw_ref)):
        assert _rel(got, ref) < 1e-2, f"{name}: fake-quant off the reference by {_rel(got, ref):.3g}"
    assert torch.all(dw[1] == 0), "the empty group's weight gradient"
