"""A CPU simulator of the cuDNN frontend (1.32) grouped-GEMM wrappers the cudnn target calls.

Two uses: CI runs the cudnn step table over it (``nvfp4_inductor.testing``), and the cudnn
target's self-check (``self_check.py``) compares the real wrappers with it on the user's GPU,
which is why it lives in the package. ``frontend(semantics)`` gives it as a frontend module
whose dSReLU or Hadamard fc1 wrapper computes v1.23's published contract instead of 1.32's
(``SEMANTICS``; the two differ there, and only there, from v1.23's test code).

Each function has the installed wrapper's signature (tests compare them with
``inspect.signature`` when the frontend is importable), takes the tensors in the wrapper's
documented legacy layouts, and computes the contract NVIDIA states for it: the kernels'
docstrings and epilogue code in the 1.32 wheel, and the frontend tests' references
(dequantize A and B with their 128x4-tiled scales, per-expert fp32 ``einsum("mk,nk->mn")``,
times alpha, then the epilogue). It is written from that statement, not from our adapters:
it reads scale factors through the (32, 4, rm, 4, rk, L) kernel view directly.

Simulated: ``grouped_gemm_quant_wrapper_sm100`` (bf16 D), ``grouped_gemm_srelu_wrapper_sm100``
(with ``tanh_clamp_scale``), ``grouped_gemm_glu_wrapper_sm100`` (swiglu),
``grouped_gemm_glu_hadamard_wrapper_sm100`` (srelu, swiglu),
``grouped_gemm_dsrelu_wrapper_sm100`` (with ``use_dsrelu_reuse`` and the clamp),
``grouped_gemm_dglu_wrapper_sm100`` (dswiglu), ``grouped_gemm_wgrad_wrapper_sm100`` (NVFP4,
dense output, Tensor2D inputs; the kernel's epilogue and per-expert scale-factor descriptor
in the 1.32 wheel, and the frontend tests' ``_wgrad_independent_reference``). Not
simulated: other activations, FP8/FP4 outputs, bias, discrete weights. The kernels' approximate
transcendentals (``tanh.approx``, ``rcp.approx`` of ``1 + exp2``) are torch's exact ones here.

What the kernels compute that our contract (docs/numerics.md) does not:

1. the epilogue activation reads the fp32 ``alpha * acc``, not the bf16 C it stores;
2. D's amax is of the fp32 activation values before D is rounded to bf16, and starts at
   -inf (srelu) or 0 (glu_hadamard) for an expert with no rows;
3. tanh-SReLU: ``t = sat(tanh(C * fp32(1/s)))``, ``D = (t * t) * (fp32(s*s) * prob)``
   (one multiply by the reciprocal, s^2 folded into prob; the kernel's tanh is
   ``tanh.approx``, torch's tanh here);
4. dsrelu: the upstream gradient ``alpha * acc`` is used in fp32 (our G is rounded to
   bf16 first); ``dA = ((g * r) * 2) * prob`` (r = relu(C)) in the kernel's order; dprob
   sums over the row in the simulator's (torch's) order;
5. the post-RHT amax uses the unsigned Hadamard on bf16 D, ``max |(D^T H16) * 0.25|``
   without a bf16 rounding of the transformed values;
6. dSwiGLU: alpha is applied as ``alpha * alpha`` on the accumulator (so the caller passes
   sqrt(A_a A_b) / 2688), gradients in the kernel's order (docstring of
   ``grouped_gemm_dglu_wrapper_sm100`` here);
7. GEMM sums: the tensor core's order (here torch's fp32 matmul order);
8. hence D regenerated from the bf16 C (dsrelu's ``use_dsrelu_reuse``) is not the fused
   forward's D, made from the fp32 C: the target's plans save D's column-wise copy instead
   (docs/numerics.md section 6, rule 5).
"""

from __future__ import annotations

import enum
import functools
import inspect
import types
from typing import Optional

import torch

from ..formats import e2m1_decode, e4m3_decode, unpack_fp4
from ..numerics import hadamard16

SF_VEC = 16


class TupleDict(dict):
    """The frontend's result type: a dict whose values also unpack as a tuple, in order."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, int) else super().__getitem__(key)


def _sf_ref(sf: torch.Tensor, mn: int, k: int, l: int) -> torch.Tensor:
    """Scale factors from the (32, 4, rm, 4, rk, L) kernel view, expanded to (mn, k, l) fp32
    (the frontend tests' ``create_scale_factor_tensor`` reference)."""
    sf = sf.view(torch.uint8) if sf.dtype != torch.uint8 else sf
    m = torch.arange(mn)
    kk = torch.arange(k // SF_VEC)
    vals = sf[(m % 32)[:, None], ((m // 32) % 4)[:, None], (m // 128)[:, None], (kk % 4)[None, :],
              (kk // 4)[None, :], :]  # (mn, k/16, l)
    return e4m3_decode(vals).repeat_interleave(SF_VEC, dim=1)[:, :k, :l]


def _fp4_ref(t: torch.Tensor) -> torch.Tensor:
    """(R, K/2, L) float4_e2m1fn_x2 -> (R, K, L) fp32 E2M1 values."""
    raw = t.view(torch.uint8).permute(2, 0, 1)  # (L, R, K/2)
    return e2m1_decode(unpack_fp4(raw)).permute(1, 2, 0)


def _grouped_acc(a_tensor, b_tensor, sfa_tensor, sfb_tensor, padded_offsets, alpha_tensor):
    """alpha[e] * sum_k (A*SFA)[m, k] (B*SFB)[n, k] for the rows m of expert e: (valid_m, N) fp32."""
    valid_m = a_tensor.shape[0]
    n, _, experts = b_tensor.shape
    a = _fp4_ref(a_tensor)[:, :, 0]
    k = a.shape[1]
    a = a * _sf_ref(sfa_tensor, valid_m, k, 1)[:, :, 0]
    b = _fp4_ref(b_tensor) * _sf_ref(sfb_tensor, n, k, experts)
    out = torch.zeros(valid_m, n, dtype=torch.float32)
    ends = padded_offsets.tolist()
    assert ends[-1] == valid_m, "padded_offsets[-1] must equal a_tensor.shape[0]"
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            acc = torch.einsum("mk,nk->mn", a[start:end], b[:, :, e])
            out[start:end] = acc * alpha_tensor[e].float()
        start = end
    return out


def _expert_amax(v: torch.Tensor, padded_offsets, init: float) -> torch.Tensor:
    out = torch.full((len(padded_offsets), 1), init, dtype=torch.float32)
    start = 0
    for e, end in enumerate(padded_offsets.tolist()):
        if end > start:
            out[e, 0] = torch.maximum(out[e, 0], v[start:end].abs().max())
        start = end
    return out


def _srelu(c32: torch.Tensor, prob: torch.Tensor, tanh_clamp_scale: Optional[float]) -> torch.Tensor:
    p = prob.view(-1, 1).float()
    if tanh_clamp_scale is None:
        r = torch.relu(c32)
        return (r * r) * p
    rcp = torch.tensor(1.0 / tanh_clamp_scale, dtype=torch.float32)
    s2 = torch.tensor(tanh_clamp_scale * tanh_clamp_scale, dtype=torch.float32)
    t = torch.tanh(c32 * rcp).clamp(0.0, 1.0)
    return (t * t) * (p * s2)


def _gate_up(c32: torch.Tensor):
    """(M, 2N) with gate/up alternating in 32-column blocks (the frontend tests' gate_idx =
    block_cols[0::2], up_idx = block_cols[1::2]) -> gate (M, N), up (M, N)."""
    m, n2 = c32.shape
    blocks = c32.reshape(m, n2 // 32, 32)
    return blocks[:, 0::2].reshape(m, -1), blocks[:, 1::2].reshape(m, -1)


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    m, n = gate.shape
    return torch.stack((gate.reshape(m, n // 32, 32), up.reshape(m, n // 32, 32)), dim=2).reshape(m, 2 * n)


def _swiglu(c32: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    gate, up = _gate_up(c32)
    return ((gate * torch.sigmoid(gate)) * up) * prob.view(-1, 1).float()


def _per_row(values: torch.Tensor, padded_offsets, rows: int) -> torch.Tensor:
    ends = padded_offsets.to(torch.int64)
    expert = torch.searchsorted(ends, torch.arange(rows), right=True).clamp(max=len(ends) - 1)
    return values.float()[expert].view(-1, 1)


def _check_batch_strides(name: str, t: torch.Tensor) -> None:
    """The stride check of the wrappers that describe their tensors without canonical strides
    (1.32's Hadamard fc1 and dGLU): an (M, N, 1) A or C must have strides (N, 1, M*N), the
    batch stride of a contiguous (1, M, N); an ``unsqueeze(-1)`` view (N, 1, 1) is refused
    there. Checked for every wrapper here, so a layout only some wrappers accept fails in CI."""
    m, n, l = t.shape
    if l == 1 and t.stride() != (n, 1, m * n):
        raise ValueError(f"{name} stride mismatch: expected {(n, 1, m * n)}, got {t.stride()}: "
                         f"{name} must be a (M, N, 1) view of a contiguous (1, M, N) tensor")


def _check(a_tensor, m_aligned, sf_vec_size, c_tensor=None):
    _check_batch_strides("a_tensor", a_tensor)
    if c_tensor is not None:
        _check_batch_strides("c_tensor", c_tensor)
    if m_aligned != 256:
        raise ValueError("m_aligned must be 256")
    if sf_vec_size != SF_VEC:
        raise ValueError("the simulator takes NVFP4 (sf_vec_size=16) only")
    if a_tensor.dtype != torch.float4_e2m1fn_x2:
        raise ValueError("the simulator takes float4_e2m1fn_x2 A and B")


def grouped_gemm_quant_wrapper_sm100(a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor=None,
                                     sfb_tensor=None, bias_tensor=None, b_ptrs=None, sfb_ptrs=None, n=None,
                                     b_dtype=None, b_major='k', norm_const_tensor=None, prob_tensor=None,
                                     row_scale_tensor=None, acc_dtype=None, d_dtype=None, d_tensor=None,
                                     cd_major='n', mma_tiler_mn=(256, 256), cluster_shape_mn=None, sf_vec_size=16,
                                     sf_fp8_dtype_override=None, vector_f32=False, m_aligned=256,
                                     discrete_col_sfd=False, use_dynamic_sched=False,
                                     use_single_group_runtime_offsets=False, current_stream=None, *,
                                     generate_amax=True, scheduler_counter_tensor=None):
    """D = alpha[e] * row_scale[m] * (A B^T) * prob[m] in d_dtype (bf16 here)."""
    _check(a_tensor, m_aligned, sf_vec_size)
    d32 = _grouped_acc(a_tensor, b_tensor, sfa_tensor, sfb_tensor, padded_offsets, alpha_tensor)
    if row_scale_tensor is not None:
        d32 = d32 * row_scale_tensor.view(-1, 1).float()
    if prob_tensor is not None:
        d32 = d32 * prob_tensor.view(-1, 1).float()
    d = d32.to(d_dtype or torch.bfloat16).unsqueeze(-1)
    amax = _expert_amax(d32, padded_offsets, float("-inf")) if generate_amax else None
    return TupleDict(d_tensor=d, d_col_tensor=None, amax_tensor=amax, sfd_row_tensor=None, sfd_col_tensor=None)


def grouped_gemm_srelu_wrapper_sm100(a_tensor, b_tensor=None, sfa_tensor=None, sfb_tensor=None, padded_offsets=None,
                                     alpha_tensor=None, bias_tensor=None, b_ptrs=None, sfb_ptrs=None, n=None,
                                     b_dtype=None, b_major='k', norm_const_tensor=None, prob_tensor=None,
                                     acc_dtype=None, c_dtype=None, d_dtype=None, cd_major='n',
                                     mma_tiler_mn=(256, 256), cluster_shape_mn=None, sf_vec_size=16,
                                     vector_f32=False, m_aligned=256, discrete_col_sfd=False,
                                     use_dynamic_sched=False, tanh_clamp_scale=None, current_stream=None):
    """C = alpha * AB (stored c_dtype); D = prob * srelu(fp32 C) (stored d_dtype); amax of fp32 D."""
    _check(a_tensor, m_aligned, sf_vec_size)
    if prob_tensor is None:
        raise ValueError("prob_tensor is required")
    c32 = _grouped_acc(a_tensor, b_tensor, sfa_tensor, sfb_tensor, padded_offsets, alpha_tensor)
    d32 = _srelu(c32, prob_tensor, tanh_clamp_scale)
    return TupleDict(c_tensor=c32.to(c_dtype or torch.bfloat16).unsqueeze(-1),
                     d_tensor=d32.to(d_dtype or torch.bfloat16).unsqueeze(-1), d_col_tensor=None,
                     amax_tensor=_expert_amax(d32, padded_offsets, float("-inf")), sfd_row_tensor=None,
                     sfd_col_tensor=None)


def grouped_gemm_glu_hadamard_wrapper_sm100(a_tensor, sfa_tensor, padded_offsets, alpha_tensor, prob_tensor,
                                            b_tensor=None, sfb_tensor=None, b_ptrs=None, sfb_ptrs=None, n=None,
                                            b_dtype=None, b_major='k', bias_tensor=None, acc_dtype=None,
                                            c_dtype=None, d_dtype=None, cd_major='n', mma_tiler_mn=(256, 256),
                                            cluster_shape_mn=None, sf_vec_size=16, vector_f32=False, m_aligned=256,
                                            act_func='swiglu', situ_beta1=4.0, situ_beta2=25.0,
                                            use_dynamic_sched=False, use_tmem_post_rht_amax=False,
                                            current_stream=None):
    """As the srelu wrapper, plus post_rht_amax[e] = max |(D_bf16^T H16 over 16-token runs) * 0.25|
    (unsigned Hadamard, no sign mask); amaxes start at 0 (1.32's code;
    ``frontend(glu_hadamard="1.23")`` gives v1.23's)."""
    return _glu_hadamard(locals(), "1.32")


def _glu_hadamard(args: dict, semantics: str):
    """The Hadamard fc1 in `semantics`: "1.32" (plain D, D's amax before the RHT, and a separate
    token-direction post-RHT amax x 0.25) or "1.23" (v1.23's test reference: D is stored
    transformed along its features, in 16-column runs times H16 x 0.25, and both amaxes are of
    that transformed D)."""
    _check(args["a_tensor"], args["m_aligned"], args["sf_vec_size"])
    act_func, padded_offsets = args["act_func"], args["padded_offsets"]
    if act_func not in ("srelu", "swiglu"):
        raise NotImplementedError(f"the simulator runs act_func 'srelu' and 'swiglu', not {act_func!r}")
    c32 = _grouped_acc(args["a_tensor"], args["b_tensor"], args["sfa_tensor"], args["sfb_tensor"], padded_offsets,
                       args["alpha_tensor"])
    d32 = _srelu(c32, args["prob_tensor"], None) if act_func == "srelu" else _swiglu(c32, args["prob_tensor"])
    d_dtype, c_dtype = args["d_dtype"] or torch.bfloat16, args["c_dtype"] or torch.bfloat16
    h = hadamard16()
    if semantics == "1.23":
        d32 = (d32.reshape(d32.shape[0], -1, 16) @ h).reshape(d32.shape) * 0.25
        amax = _expert_amax(d32, padded_offsets, 0.0)
        return TupleDict(c_tensor=c32.to(c_dtype).unsqueeze(-1), d_tensor=d32.to(d_dtype).unsqueeze(-1),
                         amax_tensor=amax, post_rht_amax_tensor=amax.clone())
    d = d32.to(d_dtype)
    post = torch.zeros(len(padded_offsets), 1)
    start = 0
    for e, end in enumerate(padded_offsets.tolist()):
        if end > start:
            runs = d[start:end].float().t().reshape(d.shape[1], -1, 16)
            post[e, 0] = ((runs @ h) * 0.25).abs().max()
        start = end
    return TupleDict(c_tensor=c32.to(c_dtype).unsqueeze(-1), d_tensor=d.unsqueeze(-1),
                     amax_tensor=_expert_amax(d32, padded_offsets, 0.0), post_rht_amax_tensor=post)


def grouped_gemm_dsrelu_wrapper_sm100(a_tensor, b_tensor=None, c_tensor=None, sfa_tensor=None, sfb_tensor=None,
                                      padded_offsets=None, alpha_tensor=None, prob_tensor=None, dprob_tensor=None,
                                      generate_dbias=False, b_ptrs=None, sfb_ptrs=None, n=None, b_dtype=None,
                                      b_major='k', norm_const_tensor=None, acc_dtype=None, d_dtype=None,
                                      cd_major='n', mma_tiler_mn=(256, 256), cluster_shape_mn=None, sf_vec_size=16,
                                      vector_f32=False, m_aligned=256, discrete_col_sfd=False,
                                      use_dynamic_sched=False, use_dsrelu_reuse=False, deterministic=None,
                                      tanh_clamp_scale=None, current_stream=None):
    """g = alpha * acc (fp32); dA = g * f'(C) * prob; dprob += sum_n f(C) * g; with
    use_dsrelu_reuse also d_srelu = f(C) * prob (the forward's expression) in d_dtype
    (1.32's docstring; ``frontend(dsrelu="1.23")`` gives v1.23's reading)."""
    return _dsrelu(locals(), "1.32")


def _dsrelu(args: dict, semantics: str):
    """dSReLU in `semantics`: "1.32" (the 1.32 docstring: C is the saved pre-activation, the
    GEMM the upstream gradient: ``2 * relu(C) * alpha * GEMM * prob``) or "1.23" (v1.23's test
    reference with its kernel's single alpha: the GEMM is the pre-activation, C the upstream
    gradient: ``2 * relu(alpha * GEMM) * C * prob``, dprob from f(alpha * GEMM) * C)."""
    _check(args["a_tensor"], args["m_aligned"], args["sf_vec_size"], args["c_tensor"])
    g = _grouped_acc(args["a_tensor"], args["b_tensor"], args["sfa_tensor"], args["sfb_tensor"],
                     args["padded_offsets"], args["alpha_tensor"])
    c_tensor, prob_tensor, clamp = args["c_tensor"], args["prob_tensor"], args["tanh_clamp_scale"]
    c = c_tensor.view(c_tensor.shape[0], -1).float()
    if semantics == "1.23":
        g, c = c, g  # the roles swap: the GEMM is the pre-activation, C the upstream gradient
    p = prob_tensor.view(-1, 1).float()
    if clamp is None:
        r = torch.relu(c)
        da = ((g * r) * 2.0) * p
        f = r * r
    else:
        s = torch.tensor(clamp, dtype=torch.float32)
        t = torch.tanh(c * torch.tensor(1.0 / clamp, dtype=torch.float32)).clamp(0.0, 1.0)
        cc = s * t
        da = (((g * cc) * 2.0) * (1.0 - t * t)) * p
        f = cc * cc
    dprob = args["dprob_tensor"] if args["dprob_tensor"] is not None else torch.zeros(c.shape[0], 1, 1)
    dprob += (f * g).sum(dim=1).view(-1, 1, 1)
    d_dtype = args["d_dtype"] or torch.bfloat16
    d_srelu = _srelu(c, prob_tensor, clamp).to(d_dtype).unsqueeze(-1) if args["use_dsrelu_reuse"] else None
    return TupleDict(d_row_tensor=da.to(d_dtype).unsqueeze(-1), d_col_tensor=None,
                     d_srelu_tensor=d_srelu, dprob_tensor=dprob, dbias_tensor=None, amax_tensor=None,
                     sfd_row_tensor=None, sfd_col_tensor=None)


def grouped_gemm_glu_wrapper_sm100(a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor=None, sfb_tensor=None,
                                   bias_tensor=None, b_ptrs=None, sfb_ptrs=None, n=None, b_dtype=None, b_major='k',
                                   norm_const_tensor=None, prob_tensor=None, acc_dtype=None, c_dtype=None,
                                   d_dtype=None, cd_major='n', mma_tiler_mn=(256, 256), cluster_shape_mn=None,
                                   sf_vec_size=16, vector_f32=False, m_aligned=256, discrete_col_sfd=False,
                                   act_func='swiglu', linear_offset=None, geglu_alpha=1.702, glu_clamp_max=7.0,
                                   glu_clamp_min=-7.0, situ_beta1=4.0, situ_beta2=25.0, use_dynamic_sched=False,
                                   use_single_group_runtime_offsets=False, current_stream=None, generate_c=False,
                                   sf_fp8_dtype_override=None, *, scheduler_counter_tensor=None):
    """C = alpha * AB, gate/up interleaved in 32-column blocks (stored only with generate_c);
    D = silu(gate) * up * prob from the fp32 C; amax of fp32 D (starts at -inf)."""
    _check(a_tensor, m_aligned, sf_vec_size)
    if act_func != "swiglu":
        raise NotImplementedError(f"the simulator runs act_func='swiglu' only, not {act_func!r}")
    c32 = _grouped_acc(a_tensor, b_tensor, sfa_tensor, sfb_tensor, padded_offsets, alpha_tensor)
    prob = prob_tensor if prob_tensor is not None else torch.ones(c32.shape[0])
    d32 = _swiglu(c32, prob)
    c = c32.to(c_dtype or torch.bfloat16).unsqueeze(-1) if generate_c else None
    return TupleDict(c_tensor=c, d_tensor=d32.to(d_dtype or torch.bfloat16).unsqueeze(-1), d_col_tensor=None,
                     amax_tensor=_expert_amax(d32, padded_offsets, float("-inf")), sfd_row_tensor=None,
                     sfd_col_tensor=None)


def grouped_gemm_dglu_wrapper_sm100(a_tensor, c_tensor, sfa_tensor, padded_offsets, alpha_tensor, beta_tensor,
                                    prob_tensor, dprob_tensor, b_tensor=None, sfb_tensor=None, generate_dbias=False,
                                    b_ptrs=None, sfb_ptrs=None, n=None, b_dtype=None, b_major='k',
                                    norm_const_tensor=None, acc_dtype=None, d_dtype=None, cd_major='n',
                                    mma_tiler_mn=(256, 256), cluster_shape_mn=None, sf_vec_size=16,
                                    sf_fp8_dtype_override=None, vector_f32=False, m_aligned=256,
                                    discrete_col_sfd=False, act_func='dswiglu', linear_offset=None, geglu_alpha=1.702,
                                    glu_clamp_max=7.0, glu_clamp_min=-7.0, situ_beta1=4.0, situ_beta2=25.0,
                                    epilogue_op=None, use_dynamic_sched=False, use_single_group_runtime_offsets=False,
                                    current_stream=None, round_dgrad_to_input_dtype=False, activation_tensor=None,
                                    deterministic=False):
    """dSwiGLU, the kernel's ``dswiglu`` epilogue: g = acc * fp32(alpha * alpha) (alpha applied
    to both operand sides); a, u = beta * gate, beta * up of the saved C (interleaved);
    sig = sigmoid(a) (the kernel: rcp.approx(1 + exp2(-a log2 e))), swish = a * sig;
    dprob += sum_n (u * swish) * g; gp = g * prob; d_up = gp * swish;
    d_gate = ((gp * u) * sig) * (a * (1 - sig) + 1); d_row interleaved like C."""
    _check(a_tensor, m_aligned, sf_vec_size, c_tensor)
    if act_func != "dswiglu":
        raise NotImplementedError(f"the simulator runs act_func='dswiglu' only, not {act_func!r}")
    square = alpha_tensor.float() * alpha_tensor.float()
    g = _grouped_acc(a_tensor, b_tensor, sfa_tensor, sfb_tensor, padded_offsets, square)
    rows = g.shape[0]
    beta = _per_row(beta_tensor, padded_offsets, rows)
    gate, up = _gate_up(c_tensor.reshape(rows, -1).float())
    a, u = gate * beta, up * beta
    sig = torch.sigmoid(a)
    swish = a * sig
    dprob = dprob_tensor if dprob_tensor is not None else torch.zeros(rows, 1, 1)
    dprob += ((u * swish) * g).sum(dim=1).view(-1, 1, 1)
    gp = g * prob_tensor.view(-1, 1).float() if prob_tensor is not None else g
    d_up = gp * swish
    d_gate = ((gp * u) * sig) * (a * (1.0 - sig) + 1.0)
    d_row = _interleave(d_gate, d_up).to(d_dtype or torch.bfloat16).unsqueeze(-1)
    return TupleDict(d_row_tensor=d_row, d_col_tensor=None, dprob_tensor=dprob, dbias_tensor=None,
                     amax_tensor=None, sfd_row_tensor=None, sfd_col_tensor=None)


class WGradInputOrder(enum.Enum):
    """The frontend's enum of wgrad input layouts (the default of ``input_order``)."""

    Tensor2D = "tensor2d"
    TensorRagged = "tensor_ragged"


def _expert_sf(sf: torch.Tensor, rows: int, token_offset: int, tokens: int) -> torch.Tensor:
    """One expert's scale factors, (rows, tokens) fp32 per element: the kernel's descriptor
    starts at element round_up(rows, 128) * token_offset / 16 of the buffer and lays the
    expert's (rows, tokens / 16) scales out in 128x4 tiles (the frontend tests'
    ``_wgrad_to_blocked``: 512-byte tiles row tile by column tile, inside one byte
    (r % 32) * 16 + ((r % 128) // 32) * 4 + k % 4)."""
    flat = sf.view(torch.uint8).reshape(-1)
    padded_rows = -(-rows // 128) * 128
    cols = tokens // SF_VEC
    r = torch.arange(rows).unsqueeze(1)
    k = torch.arange(cols).unsqueeze(0)
    index = (padded_rows * token_offset // SF_VEC + ((r // 128) * (cols // 4) + k // 4) * 512 + (r % 32) * 16
             + ((r % 128) // 32) * 4 + k % 4)
    return e4m3_decode(flat[index]).repeat_interleave(SF_VEC, dim=1)


def grouped_gemm_wgrad_wrapper_sm100(a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor, output_mode='dense',
                                     wgrad_tensor=None, wgrad_ptrs=None, global_scale_a=None, global_scale_b=None,
                                     acc_dtype=None, wgrad_dtype=None, mma_tiler_mn=(256, 256), cluster_shape_mn=None,
                                     sf_vec_size=16, sf_fp8_dtype_override=None, accumulate_on_output=False,
                                     input_order=WGradInputOrder.Tensor2D, current_stream=None, *,
                                     descriptor_workspace=None):
    """wgrad[e] = bf16((global_scale_a[e] * global_scale_b[e]) * sum over expert e's tokens t of
    (A * SFA)[m, t] (B * SFB)[t, n]): A (M, tokens) and B (tokens, N) float4_e2m1fn_x2, both
    token-major (B a transposed view); offsets_tensor (E,) int32 token ends; an expert with no
    tokens gives zeros. The scale factors are read as the kernel's per-expert descriptors
    read them, which tile only when every expert's token count is a multiple of 64 (the
    frontend tests use 256 and 384): refused otherwise."""
    if a_tensor.dtype != torch.float4_e2m1fn_x2 or b_tensor.dtype != torch.float4_e2m1fn_x2:
        raise ValueError("the simulator takes float4_e2m1fn_x2 A and B")
    if sf_vec_size != SF_VEC or global_scale_a is None or global_scale_b is None:
        raise ValueError("NVFP4 wgrad requires sf_vec_size=16, global_scale_a and global_scale_b")
    if output_mode != "dense" or accumulate_on_output or WGradInputOrder(input_order) != WGradInputOrder.Tensor2D:
        raise NotImplementedError("the simulator runs dense, non-accumulating Tensor2D wgrad only")
    if offsets_tensor.dtype != torch.int32:
        raise ValueError("offsets_tensor must be int32")
    a = e2m1_decode(unpack_fp4(a_tensor.view(torch.uint8)))  # (M, tokens)
    b = e2m1_decode(unpack_fp4(b_tensor.t().view(torch.uint8)))  # (N, tokens)
    (m, tokens), n = a.shape, b.shape[0]
    ends = offsets_tensor.tolist()
    if ends and ends[-1] > tokens:
        raise ValueError(f"offsets_tensor's last value {ends[-1]} exceeds the {tokens} tokens")
    out = torch.zeros(len(ends), m, n, dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends):
        if (end - start) % 64:
            raise ValueError(f"expert {e} has {end - start} tokens: its scale factors do not tile (multiple of 64)")
        if end > start:
            a_e = a[:, start:end] * _expert_sf(sfa_tensor, m, start, end - start)
            b_e = b[:, start:end] * _expert_sf(sfb_tensor, n, start, end - start)
            out[e] = torch.einsum("mt,nt->mn", a_e, b_e) * (global_scale_a[e].float() * global_scale_b[e].float())
        start = end
    return TupleDict(wgrad_tensor=out.to(wgrad_dtype or torch.bfloat16))


# ---------------------------------------------------------------------------------------
# Semantics: the two wrappers whose contract changed between the frontend's releases

# wrapper -> (its semantics, in the order the self-check tries them; the first is 1.32's)
SEMANTICS = {
    "grouped_gemm_dsrelu_wrapper_sm100": ("1.32", "1.23"),
    "grouped_gemm_glu_hadamard_wrapper_sm100": ("1.32", "1.23"),
}
SEMANTICS_TEXT = {
    "grouped_gemm_dsrelu_wrapper_sm100": {
        "1.32": "2 * relu(C) * alpha * GEMM * prob, C the saved pre-activation",
        "1.23": "2 * relu(alpha * GEMM) * C * prob, C the upstream gradient"},
    "grouped_gemm_glu_hadamard_wrapper_sm100": {
        "1.32": "plain D, D's amax before the RHT, a token-direction post-RHT amax x 0.25",
        "1.23": "D stored Hadamard-transformed along its features, amax of that"},
}
_IMPLS = {"grouped_gemm_dsrelu_wrapper_sm100": _dsrelu, "grouped_gemm_glu_hadamard_wrapper_sm100": _glu_hadamard}


def frontend(semantics: Optional[dict] = None) -> types.SimpleNamespace:
    """The simulator as a frontend module whose wrappers in `semantics` ({wrapper name:
    "1.32" | "1.23"}; default: every one 1.32's) compute that release's contract, with the
    same signatures: a stand-in for a frontend that computes the other contract."""
    semantics = dict(semantics or {})
    unknown = {k: v for k, v in semantics.items() if v not in SEMANTICS.get(k, ())}
    if unknown:
        raise ValueError(f"semantics must map a wrapper of {sorted(SEMANTICS)} to one of its semantics "
                         f"{SEMANTICS}; got {unknown}")
    module = globals()
    names = [n for n in module if n.endswith("_wrapper_sm100")] + ["WGradInputOrder"]
    out = types.SimpleNamespace(**{n: module[n] for n in names})
    for name, which in semantics.items():
        setattr(out, name, _with_semantics(module[name], _IMPLS[name], which))
    return out


def _with_semantics(public, impl, semantics: str):
    signature = inspect.signature(public)

    @functools.wraps(public)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return impl(dict(bound.arguments), semantics)

    return wrapper
