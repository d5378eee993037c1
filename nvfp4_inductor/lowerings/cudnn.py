"""The cuDNN frontend target: native NVFP4 on Blackwell (SM10x) through
``nvidia-cudnn-frontend``'s CuTe-DSL grouped GEMMs (the ``[cudnn]`` extra).

Status: nothing here has run on a Blackwell GPU in this project's CI (none is lent to it).
The step table is wired for the plain grouped GEMM, the grouped wgrad and the fused SReLU /
tanh-SReLU / SwiGLU kernels and runs in CI over the CPU simulator (``cudnn_sim``). The
kernels' fused epilogues compute something other than our unfused steps (the activation on
the fp32 accumulator: docs/numerics.md section 7), so on this target "eager" means the plan's
fused kernels (the eager chain runs them too, and compiled == eager holds bitwise), and D is
not regenerable from the saved C (``fused_d_from_stored_c`` False: rule 5 saves D's
column-wise copy).

The simulator is written from the wrappers' documented contract, so CI proves our wiring
against that contract only; whether the real wrappers take our layouts and keep their
contract is checked on the user's GPU before the target is chosen: ``probe`` runs the
self-check (``self_check.py``, cached per machine and software stack) and refuses the target
where a basis step fails; a fused wrapper that fails turns off its own fused step
(``self_check.restricted``). The target is declared in ``lowerings/cudnn_target.py``. What is
here:

* ``capabilities_from_signatures``: a pure function of the installed wrappers'
  ``inspect.signature`` (never a version string): which activations the fused fc1 /
  fc2-dgrad wrappers implement (tanh-SReLU only where both the srelu and the dsrelu
  wrapper take ``tanh_clamp_scale``), whether the Hadamard wrapper's post-RHT amax can
  take a sign mask (any parameter whose name contains ``sign_mask``; none in 1.32), and
  the kernels' N alignment (64);
* ``installed_capabilities``: imports ``cudnn`` lazily, reads the signatures once per process;
* ``describe``: which wrapper each fused step would call, and why (rules 3 and 4 of
  docs/numerics.md section 6), appended to the plan's reason by ``choose_plan``;
* ``make_steps``: the step table over a frontend's wrappers.

The wrappers' layouts (256-row expert padding, 128x4 swizzled scale factors, the 32-column
GLU interleave, per-expert alpha, the wgrad's token-major operands) are pure adapters in
``lowerings/cudnn_layout.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Mapping, Optional, Union

import torch

from .target import Capabilities

PACKAGE = "nvidia-cudnn-frontend"

# The wrappers the step table calls (cudnn-frontend >= 1.30 names; all re-exported lazily
# at the top of the ``cudnn`` package).
FC1_SRELU = "grouped_gemm_srelu_wrapper_sm100"  # fc1 GEMM + (tanh-)SReLU * prob, no amax of ours
FC1_GLU = "grouped_gemm_glu_wrapper_sm100"  # fc1 GEMM + SwiGLU * prob
FC1_HADAMARD = "grouped_gemm_glu_hadamard_wrapper_sm100"  # + D's amax and unsigned post-RHT amax
DGRAD_SRELU = "grouped_gemm_dsrelu_wrapper_sm100"  # fc2 dgrad + dSReLU, dprob, regenerated D
DGRAD_GLU = "grouped_gemm_dglu_wrapper_sm100"  # fc2 dgrad + dSwiGLU, dprob
GEMM = "grouped_gemm_quant_wrapper_sm100"  # plain grouped NVFP4 GEMM (fc2 fprop, fc1 dgrad)
WGRAD = "grouped_gemm_wgrad_wrapper_sm100"  # grouped NVFP4 wgrad over token-major copies (dW1, dW2)
WRAPPERS = (FC1_SRELU, FC1_GLU, FC1_HADAMARD, DGRAD_SRELU, DGRAD_GLU, GEMM, WGRAD)

# Arguments the step table passes, per wrapper: the probe refuses an installed frontend
# whose wrapper lacks one (a renamed argument must not reach a kernel call).
REQUIRED_ARGS = {
    FC1_SRELU: ("a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "padded_offsets", "alpha_tensor",
                "prob_tensor", "c_dtype", "d_dtype", "sf_vec_size", "m_aligned"),
    FC1_GLU: ("a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "padded_offsets", "alpha_tensor",
              "prob_tensor", "c_dtype", "d_dtype", "sf_vec_size", "m_aligned", "act_func"),
    FC1_HADAMARD: ("a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "padded_offsets", "alpha_tensor",
                   "prob_tensor", "c_dtype", "d_dtype", "sf_vec_size", "m_aligned", "act_func"),
    DGRAD_SRELU: ("a_tensor", "b_tensor", "c_tensor", "sfa_tensor", "sfb_tensor", "padded_offsets",
                  "alpha_tensor", "prob_tensor", "dprob_tensor", "d_dtype", "sf_vec_size", "m_aligned",
                  "use_dsrelu_reuse"),
    DGRAD_GLU: ("a_tensor", "b_tensor", "c_tensor", "sfa_tensor", "sfb_tensor", "padded_offsets",
                "alpha_tensor", "beta_tensor", "prob_tensor", "dprob_tensor", "d_dtype", "sf_vec_size",
                "m_aligned", "act_func"),
    GEMM: ("a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "padded_offsets", "alpha_tensor",
           "prob_tensor", "d_dtype", "sf_vec_size", "m_aligned"),
    WGRAD: ("a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor", "global_scale_a",
            "global_scale_b", "acc_dtype", "wgrad_dtype", "sf_vec_size"),
}

TANH_CLAMP_ARG = "tanh_clamp_scale"
M_ALIGNED = 256  # rows per expert block: the kernels' FIX_PAD_SIZE, the wrappers' m_aligned
N_ALIGNMENT = 64  # N % 64 == 0 for every fused wrapper (GLU: 2 x 32-column blocks)
GLU_INTERLEAVE = 32  # gate/up alternate in 32-row blocks of W1 (32-column blocks of C)
MAX_EXPERTS = 1024

Signatures = Mapping[str, Union[inspect.Signature, str]]


def sign_mask_parameter(signature: inspect.Signature) -> Optional[str]:
    """The Hadamard wrapper's sign-mask argument, if the installed version has one (1.32:
    none; its post-RHT amax uses the unsigned Hadamard)."""
    return next((name for name in signature.parameters if "sign_mask" in name), None)


def capabilities_from_signatures(signatures: Signatures) -> Union[Capabilities, str]:
    """The target's Capabilities from the installed wrappers' signatures (a wrapper missing
    or not importable: its reason as a str), or why the target cannot run."""
    for name in WRAPPERS:
        sig = signatures.get(name)
        if sig is None:
            return f"cudnn: the installed {PACKAGE} has no {name}"
        if isinstance(sig, str):
            return f"cudnn: {name} cannot be imported ({sig})"
        missing = [arg for arg in REQUIRED_ARGS[name] if arg not in sig.parameters]
        if missing:
            return f"cudnn: the installed {name} takes no {', '.join(missing)}"
    takes_clamp = all(TANH_CLAMP_ARG in signatures[name].parameters for name in (FC1_SRELU, DGRAD_SRELU))
    fused = frozenset({"srelu", "swiglu"} | ({"tanh_srelu"} if takes_clamp else set()))
    hadamard = signatures[FC1_HADAMARD]
    amax_acts = {"srelu", "swiglu"} | ({"tanh_srelu"} if takes_clamp and TANH_CLAMP_ARG in hadamard.parameters
                                       else set())
    return Capabilities(
        fused_activations=fused,
        fused_amax=True,
        fused_amax_activations=frozenset(amax_acts),
        fused_amax_signed_hadamard=sign_mask_parameter(hadamard) is not None,
        fused_d_from_stored_c=False,  # the epilogues read the fp32 alpha * acc (numerics.md 7, difference 1)
        dtypes=frozenset({torch.bfloat16}),
        alignment=N_ALIGNMENT,
    )


def read_signatures(module) -> dict[str, Union[inspect.Signature, str]]:
    """``inspect.signature`` of each wrapper of `module` (the ``cudnn`` package, or a
    simulator with the same names); a wrapper that fails to import gives its error text."""
    out: dict[str, Union[inspect.Signature, str]] = {}
    for name in WRAPPERS:
        try:
            fn = getattr(module, name)
        except AttributeError:
            continue
        except ImportError as err:  # the lazy re-export imports the CuTe DSL
            out[name] = f"{type(err).__name__}: {err}"
            continue
        out[name] = inspect.signature(fn)
    return out


@functools.lru_cache(maxsize=1)
def installed_capabilities() -> Union[Capabilities, str]:
    """Capabilities of the installed frontend (read once per process)."""
    try:
        import cudnn
    except ImportError:
        return f"cudnn: {PACKAGE} is not installed (pip install 'nvfp4_inductor[cudnn]')"
    return capabilities_from_signatures(read_signatures(cudnn))


def wired(caps: Capabilities, fused: bool = True) -> Capabilities:
    """`caps` restricted to what ``make_steps`` wires (no fused kernels when not `fused`)."""
    acts = caps.fused_activations & WIRED if fused else frozenset()
    amax = caps.fused_amax_activations
    return dataclasses.replace(caps, fused_activations=acts,
                               fused_amax_activations=None if amax is None else amax & acts)


def fc1_wrapper(activation: str, fused_amax: bool) -> str:
    if fused_amax:
        return FC1_HADAMARD
    return FC1_GLU if activation == "swiglu" else FC1_SRELU


def dgrad_wrapper(activation: str) -> str:
    return DGRAD_GLU if activation == "swiglu" else DGRAD_SRELU


def describe(plan, site, recipe) -> str:
    """Which wrapper each fused step calls, and why (appended to the plan's reason)."""
    act = site.activation
    clamp = f" with {TANH_CLAMP_ARG}" if act == "tanh_srelu" else ""
    if not plan.fused_fc1 and not plan.fused_dgrad:
        return f"cudnn: fc1 and fc2 dgrad through {GEMM}, activation apart; wgrads: {WGRAD}"
    if plan.fused_amax:
        mask = "RHT off" if not recipe.rht else (
            "sign mask 0, the unsigned Hadamard it uses" if recipe.sign_mask == 0 else
            f"its sign-mask argument takes {recipe.sign_mask:#06x}")
        fc1 = f"fc1: {FC1_HADAMARD} (act_func={act}), its amax and post-RHT amax feed D's casts ({mask})"
    elif plan.fused_fc1:
        fc1 = (f"fc1: {fc1_wrapper(act, False)}{clamp} (no amax), then our group Hadamard-amax pass with sign "
               f"mask {recipe.sign_mask:#06x}")
    else:
        fc1 = f"fc1: {GEMM}, then the activation"
    dgrad = f"fc2 dgrad: {dgrad_wrapper(act)}{clamp}" if plan.fused_dgrad else (
        f"fc2 dgrad: {GEMM}, then the activation backward")
    return f"{fc1}; {dgrad}; fc2 fprop and fc1 dgrad: {GEMM}; wgrads: {WGRAD}"


def wrappers_used(plan, activation: str) -> list[str]:
    """The wrappers a plan calls, in the order ``describe`` names them."""
    used = []
    if plan.fused_fc1:
        used.append(fc1_wrapper(activation, plan.fused_amax))
    if plan.fused_dgrad:
        used.append(dgrad_wrapper(activation))
    return used + [GEMM, WGRAD]


# ---------------------------------------------------------------------------------------
# The step table over a frontend (the ``cudnn`` package, or ``cudnn_sim``)


def make_steps(fe, base):
    """The cudnn step table: `base`'s quantizers and unfused activations; the grouped GEMM
    (fc2 fprop, fc1 dgrad) through ``grouped_gemm_quant_wrapper_sm100``; the wgrads through
    ``grouped_gemm_wgrad_wrapper_sm100``; the fused fc1 (srelu / glu wrapper, or the
    Hadamard wrapper when the plan takes its amax) and fc2 dgrad (dsrelu / dglu wrapper)
    kernels; `fe` supplies the wrappers."""
    import dataclasses

    from . import cudnn_layout as lay

    def layout(group_sizes, tokens):
        rows = lay.padded_rows(group_sizes, tokens)
        capacity = lay.padded_capacity(tokens, group_sizes.numel())
        return rows, capacity, lay.padded_offsets(group_sizes, tokens)

    def operands(a, b, rows, capacity, glu=False):
        a_tensor, sfa = lay.activation_operand(a.data, a.scale, rows, capacity)
        b_tensor, sfb = lay.weight_operand(b.data, b.scale, glu=glu)
        return dict(a_tensor=lay.batch_view(a_tensor), sfa_tensor=lay.kernel_view(sfa),
                    b_tensor=b_tensor.permute(1, 2, 0), sfb_tensor=lay.kernel_view(sfb), sf_vec_size=16,
                    m_aligned=M_ALIGNED, acc_dtype=torch.float32)

    def grouped_gemm(a, b, group_sizes):
        rows, capacity, offsets = layout(group_sizes, a.data.shape[0])
        out = getattr(fe, GEMM)(padded_offsets=offsets, alpha_tensor=lay.alpha(a.amax, b.amax),
                                d_dtype=torch.bfloat16, generate_amax=False, **operands(a, b, rows, capacity))
        return lay.unpad_rows(out["d_tensor"][:, :, 0], rows)

    def grouped_gemm_wgrad(a, b, padded_offsets):
        rows, capacity, ends = lay.wgrad_layout(padded_offsets, a.data.shape[1] * 2)
        a_tensor, sfa = lay.wgrad_operand(a.data, a.scale, rows, capacity, ends)
        b_tensor, sfb = lay.wgrad_operand(b.data, b.scale, rows, capacity, ends)
        alpha = lay.alpha(a.amax, b.amax)
        # the epilogue multiplies the accumulator by global_scale_a * global_scale_b (fp32):
        # (alpha, 1) makes that our alpha exactly, where the decode scales (A / 2688 each)
        # would round their product differently (numerics.md 5.4)
        out = getattr(fe, WGRAD)(a_tensor=a_tensor, b_tensor=b_tensor.t(), sfa_tensor=sfa, sfb_tensor=sfb,
                                 offsets_tensor=ends, global_scale_a=alpha, global_scale_b=torch.ones_like(alpha),
                                 acc_dtype=torch.float32, wgrad_dtype=torch.bfloat16, sf_vec_size=16)
        return out["wgrad_tensor"]

    def clamp_kwargs(activation, tanh_clamp_scale):
        return {TANH_CLAMP_ARG: tanh_clamp_scale} if activation == "tanh_srelu" else {}

    def fc1_act_amax(a, b, group_sizes, probs, activation, tanh_clamp_scale, d_cast, *, want_amax=True):
        del d_cast  # the Hadamard wrapper's post-RHT amax is unsigned: fused only where D's cast's is (rule 4)
        if activation not in WIRED:
            raise NotImplementedError(f"cudnn: no fused fc1 step for {activation}")
        glu = activation == "swiglu"
        rows, capacity, offsets = layout(group_sizes, a.data.shape[0])
        args = dict(padded_offsets=offsets, alpha_tensor=lay.alpha(a.amax, b.amax),
                    prob_tensor=lay.prob_view(probs, rows, capacity), c_dtype=torch.bfloat16,
                    d_dtype=torch.bfloat16, **operands(a, b, rows, capacity, glu))
        if want_amax:
            out = getattr(fe, FC1_HADAMARD)(act_func="swiglu" if glu else "srelu", **args,
                                            **clamp_kwargs(activation, tanh_clamp_scale))
            pre, post = out["amax_tensor"].view(-1), out["post_rht_amax_tensor"].view(-1)
        elif glu:
            out = getattr(fe, FC1_GLU)(act_func="swiglu", generate_c=True, **args)
            pre = post = None
        else:
            out = getattr(fe, FC1_SRELU)(**args, **clamp_kwargs(activation, tanh_clamp_scale))
            pre = post = None
        c = lay.unpad_rows(out["c_tensor"][:, :, 0], rows)
        d = lay.unpad_rows(out["d_tensor"][:, :, 0], rows)
        return (lay.deinterleave_glu(c, dim=-1) if glu else c), d, pre, post

    def fc2_dgrad_act(a, b, group_sizes, c, probs, activation, tanh_clamp_scale, *, regenerate=False):
        if activation not in WIRED:
            raise NotImplementedError(f"cudnn: no fused fc2 dgrad step for {activation}")
        rows, capacity, offsets = layout(group_sizes, a.data.shape[0])
        common = dict(padded_offsets=offsets, prob_tensor=lay.prob_view(probs, rows, capacity),
                      dprob_tensor=torch.zeros(capacity, 1, 1, dtype=torch.float32, device=c.device),
                      d_dtype=torch.bfloat16, deterministic=True,
                      **operands(a, b, rows, capacity))
        if activation == "swiglu":
            out = getattr(fe, DGRAD_GLU)(
                c_tensor=lay.batch_view(lay.interleave_glu(lay.pad_rows(c, rows, capacity), dim=-1)),
                alpha_tensor=lay.dglu_alpha(a.amax, b.amax), act_func="dswiglu",
                beta_tensor=torch.ones(group_sizes.numel(), dtype=torch.float32, device=c.device), **common)
            dc = lay.deinterleave_glu(lay.unpad_rows(out["d_row_tensor"][:, :, 0], rows), dim=-1)
            # the dGLU kernel emits no D: regenerate it as the unfused step does, from the bf16 C
            d = base.activation_forward(c, probs, activation) if regenerate else None
        else:
            out = getattr(fe, DGRAD_SRELU)(
                c_tensor=lay.batch_view(lay.pad_rows(c, rows, capacity)), alpha_tensor=lay.alpha(a.amax, b.amax),
                use_dsrelu_reuse=regenerate, **common, **clamp_kwargs(activation, tanh_clamp_scale))
            dc = lay.unpad_rows(out["d_row_tensor"][:, :, 0], rows)
            d = lay.unpad_rows(out["d_srelu_tensor"][:, :, 0], rows) if regenerate else None
        dp = lay.unpad_rows(out["dprob_tensor"].view(-1), rows) if probs is not None else None
        return dc, dp, d

    # deq_operands off: the cuDNN kernels read the packed NVFP4 copies themselves
    return dataclasses.replace(base, grouped_gemm=grouped_gemm, grouped_gemm_wgrad=grouped_gemm_wgrad,
                               fc1_act_amax=fc1_act_amax, fc2_dgrad_act=fc2_dgrad_act, deq_operands=False)


# What the wired step table fuses.
WIRED = frozenset({"srelu", "tanh_srelu", "swiglu"})
