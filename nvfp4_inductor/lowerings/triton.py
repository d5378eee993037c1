"""The Triton target's steps (SM80+, tuned on SM90): the kernels of ``nvfp4_inductor.kernels``.

Quantizers are bit-exact twins of the reference. GEMMs feed exact deq() values to 16-bit
tensor cores with fp32 accumulation (their summation order is the kernel's, so GEMM
outputs match the reference to fp32-accumulation level, not bit for bit). The
activation kernels take bf16 C (GEMM outputs); other dtypes (fp64 gradcheck) run the
reference formulas. The fused steps (fc1 + activation + D's amaxes; fc2 dgrad + activation
backward) are bit-identical to these unfused steps (tests/test_kernels_epilogue.py).

``FP4_STEPS`` (the triton_fp4 target, SM10x): the same table but for the plain GEMM steps,
which multiply the packed copies on the FP4 tensor cores (``kernels/grouped_gemm_fp4.py``).
Their sums are the tensor core's, so there a fused step and the unfused steps it replaces
agree to fp32-accumulation level, not bitwise; the plan picks one for eager and compiled
runs alike, and D is still the activation of the stored bf16 C (rule 5).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import activations, kernels
from ..kernels.activation import activation_backward as _act_bwd_kernel
from ..kernels.activation import activation_forward as _act_fwd_kernel
from ..kernels.grouped_gemm_act import grouped_gemm_act
from ..kernels.grouped_gemm_dact import grouped_gemm_dact
from ..kernels.grouped_gemm_bf16 import grouped_gemm_via_bf16, grouped_gemm_wgrad_via_bf16
from ..kernels.grouped_gemm_fp4 import grouped_gemm_fp4, grouped_gemm_wgrad_fp4
from .steps import Steps


def _reference_activation(c, activation) -> bool:
    """Other dtypes (fp64 gradcheck) and activations without a Triton kernel
    (``triton_code`` None) run the reference formulas."""
    return c.dtype != torch.bfloat16 or activations.get_activation(activation).triton_code is None


def activation_forward(c, probs, activation, tanh_clamp_scale=None):
    if _reference_activation(c, activation):
        return activations.activation_forward(c, probs, activation, tanh_clamp_scale)
    return _act_fwd_kernel(c, probs, activation, tanh_clamp_scale)


def activation_backward(g, c, probs, activation, tanh_clamp_scale=None, *, regenerate=False):
    if _reference_activation(c, activation):
        return activations.activation_backward(g, c, probs, activation, tanh_clamp_scale, regenerate=regenerate)
    return _act_bwd_kernel(g, c, probs, activation, tanh_clamp_scale, regenerate=regenerate)


# Activations whose D the cast makes from C as it loads it (``kernels.activation_group_quantize``).
# SReLU's math adds ~6 SASS instructions an element to the column-wise cast (sm_90a, local
# Triton 3.9, 128 groups: 30.0 -> 36.6, 196 registers, no spills: benchmarks/cast_sass.py),
# and saves the activation kernel's pass (C read, D written, D read again by the cast): on
# the H200, at its own tiles (config.cast_config's act_in), 115 / 75 / 58 us at S4 / S1 / S3
# against the two launches' 147 / 95 / 74 (docs/decisions.md, Casts). tanh-SReLU and SwiGLU
# multiply the cast's instructions by 2.4 and 2.3 (SwiGLU with 304 bytes of spills) in a
# kernel bound by its instruction issue and latency: SwiGLU's fused cast measured 219 / 174 /
# 110 us against 175 / 115 / 90 (same section), so they stay two launches (activation kernel, then cast).
_D_MADE_IN_CAST = frozenset({"srelu"})


def group_quantize(x, group_sizes, cast):
    return kernels.group_quantize(x, group_sizes, **cast.keywords())


def group_hadamard_amax(x, group_sizes, cast):
    return kernels.group_hadamard_amax(x, group_sizes, cast.sign_mask)


def activation_quantize(c, probs, activation, tanh_clamp_scale, group_sizes, cast):
    """D = activation_forward(C) cast by group_quantize: one launch where the activation is
    in ``_D_MADE_IN_CAST`` (D never stored), else the two steps."""
    if activation in _D_MADE_IN_CAST and not _reference_activation(c, activation):
        return kernels.activation_group_quantize(c, probs, activation, tanh_clamp_scale, group_sizes,
                                                 **cast.keywords())
    return group_quantize(activation_forward(c, probs, activation, tanh_clamp_scale), group_sizes, cast)


STEPS = Steps(
    quantize=kernels.quantize,
    group_quantize=group_quantize,
    group_hadamard_amax=group_hadamard_amax,
    quantize_weights=kernels.quantize_weights,
    # fprop/dgrad and wgrad: dequantize -> bf16 GEMM, 1.3-2.25x faster than in-register
    # dequant (docs/decisions.md, GEMM operands). fc1_act_amax / fc2_dgrad_act run the same
    # dequantize and the same K loop (grouped_gemm_bf16.bf16_tile_acc, natural K order, so
    # their own tile configs change no bit), so the fused steps stay bit-identical to
    # grouped_gemm -> activation: fusing changes no bit of this target's results, and D
    # regenerates from the saved C (rule 5).
    grouped_gemm=grouped_gemm_via_bf16,
    grouped_gemm_wgrad=grouped_gemm_wgrad_via_bf16,
    activation_forward=activation_forward,
    activation_backward=activation_backward,
    fc1_act_amax=grouped_gemm_act,
    fc2_dgrad_act=grouped_gemm_dact,
    activation_quantize=activation_quantize,  # the recompute's D, made inside its cast (SReLU)
    deq_operands=True,  # the casts write the forward GEMMs' operands as deq() (group_cast's ROW_DEQ)
    d_after_dgrad=True,  # D rebuilt after the dgrad, whose bf16 operand copies are gone by then
)


# The triton_fp4 target's table (SM10x-11x, after its self-check: ``triton_fp4_target.py``):
# the plain grouped GEMMs (fc2 fprop, the dgrads, the wgrads) on Blackwell's FP4 tensor cores,
# reading the packed copies as the containers hold them (``tl.dot_scaled``, no dequantize
# pass); the fused fc1 + activation and fc2 dgrad + activation backward keep their
# bf16-operand kernels and the deq() copies the casts write for them (``packed_gemm_operands``).
FP4_STEPS = dataclasses.replace(STEPS, grouped_gemm=grouped_gemm_fp4, grouped_gemm_wgrad=grouped_gemm_wgrad_fp4,
                                packed_gemm_operands=True)
