"""The triton_fp4 target's self-check: its FP4 tensor-core GEMMs (``kernels/grouped_gemm_fp4.py``,
``tl.dot_scaled``) run on the user's own GPU against the exact products, once per machine and
software stack, before any plan names the target (docs/blackwell.md).

    verdict(device, stack, steps, caps)   the cached Verdict (``self_check.cached``, kind
                                          "triton_fp4"), or run() now and cache it
    run(device, stack, steps, caps)       every case below, then one training step
    check_case(device, steps, field)      one case

Cases (``CASES``), one per GEMM step of the table whose kernel reads packed operands: the
plain grouped GEMM (fc2 fprop and the dgrads; fc1 too where no fused kernel runs) and the
wgrad, each on a small problem quantized by the reference: ragged groups with an empty one,
an all-zero expert weight (alpha 0), and docs/numerics.md section 8's edge values
(``self_check.edge_tokens``: an all-zero block, bf16 subnormals, block scales that
underflow, a block that sets its group's amax, -0.0). K and N are not multiples of the GPU
tiles (``fp4_gemm_config``: 256 elements of K, 128 columns a step), so a whole K step, the
K tail and the clamped columns all run.

Tolerance (docs/numerics.md section 7: targets' GEMMs agree to fp32-accumulation level).
Each output element, against the exact product of the same deq() values (fp64, on the CPU):

    |out - exact| <= 1.01 (2^-8 |exact| + 2 K 2^-24 alpha sum_k |deq(a)_k deq(b)_k|)

(bf16's rounding, alpha's fp32 rounding, and fp32 accumulation in any order: the bound the
bf16-operand GEMMs meet, tests/test_kernels_gemm_bf16.py), and +0 exactly where alpha is 0
or the group is empty. A tensor core that accumulated with fewer bits than fp32 would fail it.

Then one training step through the table, SReLU only (the GEMMs do not depend on the
activation): the fused ops == the eager chain bitwise (``self_check.training_step_check``).

Any failure refuses the target (the triton target's bf16-operand GEMMs run), with one
warning per failed case naming the kernel. ``counters["nvfp4"]["triton_fp4_self_check_runs"]``
counts the checks run.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..formats import block_values
from ..numerics import gemm_alpha
from ..recipe import QuantizeOptions
from ..tensor import Operand
from . import self_check
from .steps import Steps
from .target import Capabilities

KIND = "triton_fp4"

# (step, field of the step table)
CASES = (
    ("fc2 fprop / dgrads", "grouped_gemm"),
    ("wgrads", "grouped_gemm_wgrad"),
)

# The fprop case: K = 272, one 256-element GPU step and a 16-element tail, N = 48 < 128 (clamped
# columns), groups ragged with an empty one. The wgrad case: K = the padded tokens, a group of 280
# of them (a GPU step and a tail), N x M = 48 x 32. Small: the Triton interpreter runs them in CI.
FPROP_SIZES, FPROP_K, FPROP_N = (24, 0, 40, 17), 272, 48
WGRAD_SIZES, WGRAD_N, WGRAD_M = (24, 0, 280, 17), 48, 32
SLACK = 1.01


def _reference():
    from .reference import STEPS

    return STEPS


def _fprop_operands(generator):
    """(a, b, group sizes) of a (T, K) x (G, N, K)^T grouped GEMM, and K."""
    sizes = torch.tensor(FPROP_SIZES)
    tokens = int(sizes.sum())
    xq = _reference().group_quantize(self_check.edge_tokens(tokens, FPROP_K, generator), sizes, QuantizeOptions())
    w = torch.randn(len(sizes), FPROP_N, FPROP_K, generator=generator).bfloat16()
    w[2] = 0.0  # an all-zero expert weight: alpha 0
    return (xq.rowwise(), _reference().quantize_weights(w).rowwise(), sizes), FPROP_K


def _wgrad_operands(generator):
    """(a, b, padded offsets) of a wgrad over column-wise copies of (T, N) and (T, M), and K
    (the padded token axis)."""
    sizes = torch.tensor(WGRAD_SIZES)
    tokens = int(sizes.sum())
    cols = QuantizeOptions(rowwise=False, columnwise=True)
    a = _reference().group_quantize(self_check.edge_tokens(tokens, WGRAD_N, generator), sizes, cols)
    b = _reference().group_quantize(self_check.edge_tokens(tokens, WGRAD_M, generator), sizes, cols)
    return (a.columnwise(), b.columnwise(), a.columnwise_offsets), 2 * a.columnwise_data.shape[1]


def exact(field: str, a: Operand, b: Operand, layout: torch.Tensor):
    """(the exact fp64 product, alpha * sum of |products|) of a step's packed operands, on CPU."""
    av = block_values(a.data.reshape(-1, a.data.shape[-1]), a.scale.reshape(-1, a.scale.shape[-1])).double()
    bv = block_values(b.data.reshape(-1, b.data.shape[-1]), b.scale.reshape(-1, b.scale.shape[-1])).double()
    alpha = gemm_alpha(a.amax, b.amax).double()
    if field == "grouped_gemm":  # rows of a by group; b (G, N, K)
        bv = bv.view(*b.data.shape[:2], -1)
        ends = [0, *torch.cumsum(layout, 0).tolist()]
        parts = [(av[p:q], bv[g], alpha[g]) for g, (p, q) in enumerate(zip(ends, ends[1:]))]
        return (torch.cat([x @ w.T * s for x, w, s in parts]), torch.cat([x.abs() @ w.abs().T * s for x, w, s in parts]))
    ends = layout.tolist()  # columns (padded tokens) of a and b by group
    parts = [(av[:, p:q], bv[:, p:q], alpha[g]) for g, (p, q) in enumerate(zip(ends, ends[1:]))]
    return (torch.stack([x @ w.T * s for x, w, s in parts]), torch.stack([x.abs() @ w.abs().T * s for x, w, s in parts]))


def _zero_outputs(field: str, out: torch.Tensor, a: Operand, b: Operand, layout: torch.Tensor) -> torch.Tensor:
    """The outputs that must be +0: groups with alpha 0 (and, for the wgrad, empty groups)."""
    dead = gemm_alpha(a.amax, b.amax) == 0
    if field == "grouped_gemm":
        return out[torch.repeat_interleave(dead, layout)]
    return out[dead | (layout[1:] == layout[:-1])]


def disagreement(field: str, got: torch.Tensor, args, k: int) -> Optional[str]:
    """Why `got` (the step's output, on CPU) is outside the tolerance (module docstring), or None."""
    a, b, layout = args
    want, size = exact(field, a, b, layout)
    if got.shape != want.shape or got.dtype != torch.bfloat16:
        return f"out is {got.dtype} {tuple(got.shape)}, expected bfloat16 {tuple(want.shape)}"
    err = (got.double() - want).abs()
    bound = SLACK * (2.0 ** -8 * want.abs() + 2 * k * 2.0 ** -24 * size)
    bad = ~(err <= bound)  # NaN is bad
    if bad.any():
        worst = float((err / bound.clamp_min(1e-300)).nan_to_num(float("inf")).max())
        rel = float((got.double() - want).norm() / want.norm().clamp_min(1e-300))
        return (f"{int(bad.sum())} of {bad.numel()} outputs outside the fp32-accumulation bound of the exact product "
                f"(worst error / bound {worst:.3g}; relative L2 {rel:.2e})")
    zeros = _zero_outputs(field, got, a, b, layout)
    if zeros.view(torch.int16).any():
        return f"{int((zeros.view(torch.int16) != 0).sum())} outputs of alpha-0 or empty groups are not +0"
    return None


def check_case(device: torch.device, steps: Steps, field: str, seed: int = 0) -> self_check.Case:
    """Run `field` of `steps` on `device` on its problem and compare it with the exact product."""
    step = next(s for s, f in CASES if f == field)
    generator = torch.Generator().manual_seed(seed)
    args, k = (_fprop_operands if field == "grouped_gemm" else _wgrad_operands)(generator)
    kernel = steps.runs(field)
    on_device = tuple(Operand(*(t.to(device) for t in op)) for op in args[:2]) + (args[2].to(device),)
    try:
        got = getattr(steps, field)(*on_device).cpu()
    except Exception as err:  # noqa: BLE001 - any refusal on the device (a compile error) is this case's verdict
        return self_check.Case(step, kernel, None, False, f"{type(err).__name__}: {str(err).splitlines()[0]}")
    why = disagreement(field, got, args, k)
    return self_check.Case(step, kernel, None, why is None, why or "")


def run(device: torch.device, stack: self_check.Stack, steps: Steps, caps: Capabilities) -> self_check.Verdict:
    """Every case, then the training step (module docstring; ``self_check.checked``)."""
    srelu = dataclasses.replace(caps, fused_activations=caps.fused_activations & {"srelu"},
                                fused_dgrad_activations=None)
    return self_check.checked("triton_fp4_self_check_runs", stack,
                              lambda: tuple(check_case(device, steps, field) for _, field in CASES),
                              lambda partial, step_check: step_check(srelu, lambda: steps, device))


def verdict(device: torch.device, stack: self_check.Stack, steps: Steps, caps: Capabilities) -> self_check.Verdict:
    """The verdict for `stack`: this process's, else the cached file's, else ``run`` now."""
    return self_check.cached(KIND, stack, lambda: run(device, stack, steps, caps),
                             lambda case: "the triton_fp4 target is off: the triton target's bf16-operand GEMMs run")
