"""The step table every target fills in: one function per step of the grouped MLP."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class Steps:
    """One target's implementation of each step of the grouped MLP.

    Each field takes the arguments of the reference step named beside it
    (``lowerings/reference.py``) and returns the same types and bits. Quantized operands are
    the containers' copies (``tensor.Operand``: data, scale, amax; ``rowwise()`` /
    ``columnwise()``); a cast's options are one ``recipe.QuantizeOptions`` (`cast`):

      group_quantize(x, group_sizes, cast) -> NVFP4GroupedTensor
      group_hadamard_amax(x, group_sizes, cast) -> (pre-RHT amax, post-RHT amax), the amaxes
          `cast`'s copies use (its sign mask transforms the post-RHT one)
      grouped_gemm(a, b, group_sizes) -> (T, N) bf16          fprop / dgrad
      grouped_gemm_wgrad(a, b, padded_offsets) -> (G, N, M) bf16

    Optional fused steps (None: the target has no such kernel). Each returns the same bits
    as the unfused steps it replaces; the site's plan (``policy.Plan``) says whether they run:
      fc1_act_amax(a, b, group_sizes, probs, activation, tanh_clamp_scale, d_cast, *,
                   want_amax=True)
          -> (C, D, pre-RHT amax, post-RHT amax)   grouped_gemm -> activation_forward
                                                   -> group_hadamard_amax(D, sizes, d_cast)
                                                   (amaxes None unless want_amax; a target
                                                   without Capabilities.fused_amax, as Triton,
                                                   refuses want_amax=True: ValueError)
      fc2_dgrad_act(a, b, group_sizes, c, probs, activation, tanh_clamp_scale, *,
                    regenerate=False)
          -> (dC, dp or None, D or None)           grouped_gemm -> activation_backward
      activation_quantize(c, probs, activation, tanh_clamp_scale, group_sizes, cast (every
                          amax it asks for supplied))
          -> NVFP4GroupedTensor                    activation_forward -> group_quantize
                                                   (D made inside the cast where the target
                                                   can, never stored)
    """

    quantize: Callable  # numerics.quantize_torch (keywords: the lone ``nvfp4::quantize`` op's)
    group_quantize: Callable  # reference.group_quantize (numerics.group_quantize_torch)
    group_hadamard_amax: Callable  # reference.group_hadamard_amax (numerics.group_hadamard_amax_torch)
    quantize_weights: Callable  # numerics.quantize_weights_torch
    grouped_gemm: Callable  # numerics.grouped_gemm_torch (fprop, dgrad)
    grouped_gemm_wgrad: Callable  # numerics.grouped_gemm_wgrad_torch
    activation_forward: Callable  # activations.activation_forward
    activation_backward: Callable  # activations.activation_backward
    fc1_act_amax: Optional[Callable] = None  # fused fc1 + activation + D's amaxes
    fc2_dgrad_act: Optional[Callable] = None  # fused fc2 dgrad + activation backward
    activation_quantize: Optional[Callable] = None  # D = activation(C), cast as it is made where it can be
    # The quantize steps take ``rowwise_deq=True`` (group_quantize's cast, quantize_weights'): the
    # row-wise copy comes back as its deq() values, data bf16 at full width and an empty
    # scale, which the fprop/dgrad-shaped GEMM steps take as that operand
    # (formats.operand_values). The fused ops ask for it for the forward GEMMs' operands
    # (no dequantize launch); every other copy stays packed.
    deq_operands: bool = False
    # With deq_operands, only the fused steps' operands (fc1_act_amax's, fc2_dgrad_act's) come
    # as deq() copies: the plain GEMM steps read packed copies only (the FP4 tensor-core GEMMs,
    # ``kernels/grouped_gemm_fp4.py``, which multiply the E2M1 codes themselves).
    packed_gemm_operands: bool = False
    # With recompute, D is rebuilt by ``activation_forward`` from C after the fc2 dgrad step
    # rather than by that step's ``regenerate``: a target whose GEMMs read transient bf16
    # deq() operand copies would otherwise hold D (T x F bf16) beside them, C and dC (the
    # step's memory peak where fc1's GEMMs are smaller). Costs one launch and one read of C.
    d_after_dgrad: bool = False

    def runs(self, step: str) -> str:
        """What runs `step` (a field name), e.g. 'numerics.group_quantize_torch', for explain."""
        fn = getattr(self, step)
        module = getattr(fn, "__module__", None) or type(fn).__module__
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        return f"{module.removeprefix('nvfp4_inductor.')}.{name}"
