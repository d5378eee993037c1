"""The cuDNN frontend target (lowerings/cudnn.py): its probe read from wrapper signatures,
the policy's choices for capability x frontend version x sign mask x activation, and the
reasons ``explain`` gives. No frontend call runs here: no Blackwell GPU is lent.

The 1.32.0 argument lists below were read with ``inspect.signature`` from the installed
wheel (``pip install nvidia-cudnn-frontend==1.32.0``); when the frontend is importable the
test comparing them with the installed wrappers runs too."""

import dataclasses
import importlib.util
import inspect

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor import lowerings
from nvfp4_inductor.lowerings import SiteSpec, choose_plan
from nvfp4_inductor.lowerings import cudnn as cd
from nvfp4_inductor.lowerings.reference import STEPS as REFERENCE_STEPS

ARGS_1_32 = {
    cd.FC1_SRELU: "a_tensor b_tensor sfa_tensor sfb_tensor padded_offsets alpha_tensor bias_tensor b_ptrs sfb_ptrs n "
                  "b_dtype b_major norm_const_tensor prob_tensor acc_dtype c_dtype d_dtype cd_major mma_tiler_mn "
                  "cluster_shape_mn sf_vec_size vector_f32 m_aligned discrete_col_sfd use_dynamic_sched "
                  "tanh_clamp_scale current_stream",
    cd.DGRAD_SRELU: "a_tensor b_tensor c_tensor sfa_tensor sfb_tensor padded_offsets alpha_tensor prob_tensor "
                    "dprob_tensor generate_dbias b_ptrs sfb_ptrs n b_dtype b_major norm_const_tensor acc_dtype "
                    "d_dtype cd_major mma_tiler_mn cluster_shape_mn sf_vec_size vector_f32 m_aligned "
                    "discrete_col_sfd use_dynamic_sched use_dsrelu_reuse deterministic tanh_clamp_scale "
                    "current_stream",
    cd.FC1_HADAMARD: "a_tensor sfa_tensor padded_offsets alpha_tensor prob_tensor b_tensor sfb_tensor b_ptrs sfb_ptrs "
                     "n b_dtype b_major bias_tensor acc_dtype c_dtype d_dtype cd_major mma_tiler_mn "
                     "cluster_shape_mn sf_vec_size vector_f32 m_aligned act_func situ_beta1 situ_beta2 "
                     "use_dynamic_sched use_tmem_post_rht_amax current_stream",
    cd.FC1_GLU: "a_tensor sfa_tensor padded_offsets alpha_tensor b_tensor sfb_tensor bias_tensor b_ptrs sfb_ptrs n "
                "b_dtype b_major norm_const_tensor prob_tensor acc_dtype c_dtype d_dtype cd_major mma_tiler_mn "
                "cluster_shape_mn sf_vec_size vector_f32 m_aligned discrete_col_sfd act_func linear_offset "
                "geglu_alpha glu_clamp_max glu_clamp_min situ_beta1 situ_beta2 use_dynamic_sched "
                "use_single_group_runtime_offsets current_stream generate_c sf_fp8_dtype_override "
                "scheduler_counter_tensor",
    cd.DGRAD_GLU: "a_tensor c_tensor sfa_tensor padded_offsets alpha_tensor beta_tensor prob_tensor dprob_tensor "
                  "b_tensor sfb_tensor generate_dbias b_ptrs sfb_ptrs n b_dtype b_major norm_const_tensor acc_dtype "
                  "d_dtype cd_major mma_tiler_mn cluster_shape_mn sf_vec_size sf_fp8_dtype_override vector_f32 "
                  "m_aligned discrete_col_sfd act_func linear_offset geglu_alpha glu_clamp_max glu_clamp_min "
                  "situ_beta1 situ_beta2 epilogue_op use_dynamic_sched use_single_group_runtime_offsets "
                  "current_stream round_dgrad_to_input_dtype activation_tensor deterministic",
    cd.GEMM: "a_tensor sfa_tensor padded_offsets alpha_tensor b_tensor sfb_tensor bias_tensor b_ptrs sfb_ptrs n "
             "b_dtype b_major norm_const_tensor prob_tensor row_scale_tensor acc_dtype d_dtype d_tensor cd_major "
             "mma_tiler_mn cluster_shape_mn sf_vec_size sf_fp8_dtype_override vector_f32 m_aligned "
             "discrete_col_sfd use_dynamic_sched use_single_group_runtime_offsets current_stream generate_amax "
             "scheduler_counter_tensor",
    cd.WGRAD: "a_tensor b_tensor sfa_tensor sfb_tensor offsets_tensor output_mode wgrad_tensor wgrad_ptrs "
              "global_scale_a global_scale_b acc_dtype wgrad_dtype mma_tiler_mn cluster_shape_mn sf_vec_size "
              "sf_fp8_dtype_override accumulate_on_output input_order current_stream descriptor_workspace",
}


def signature(args):
    return inspect.Signature([inspect.Parameter(a, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
                              for a in args.split()])


def signatures(drop=(), add=None):
    """Signatures of a frontend: 1.32.0's, less the `drop` pairs (wrapper, arg), plus `add`
    {wrapper: extra args}."""
    out = {}
    for name, args in ARGS_1_32.items():
        kept = [a for a in args.split() if (name, a) not in drop] + list((add or {}).get(name, ()))
        out[name] = signature(" ".join(kept))
    return out


FE_1_32 = signatures()
# 1.26-1.29: srelu/dsrelu without the tanh clamp (added in 1.30, PR #858).
FE_NO_CLAMP = signatures(drop={(cd.FC1_SRELU, "tanh_clamp_scale"), (cd.DGRAD_SRELU, "tanh_clamp_scale")})
# A future frontend whose Hadamard wrapper takes a sign mask (and the clamp).
FE_MASK = signatures(add={cd.FC1_HADAMARD: ("rht_sign_mask", "tanh_clamp_scale")})


def test_capabilities_of_1_32_from_its_signatures():
    caps = cd.capabilities_from_signatures(FE_1_32)
    assert caps.fused_activations == {"srelu", "tanh_srelu", "swiglu"}
    assert caps.fused_amax and not caps.fused_amax_signed_hadamard
    assert caps.fused_amax_activations == {"srelu", "swiglu"}  # the Hadamard wrapper has no clamp
    assert caps.alignment == 64 and caps.dtypes == {torch.bfloat16}
    assert cd.capabilities_from_signatures(FE_NO_CLAMP).fused_activations == {"srelu", "swiglu"}
    # the clamp only on the forward wrapper is not enough: the backward must match it
    half = signatures(drop={(cd.DGRAD_SRELU, "tanh_clamp_scale")})
    assert "tanh_srelu" not in cd.capabilities_from_signatures(half).fused_activations
    future = cd.capabilities_from_signatures(FE_MASK)
    assert future.fused_amax_signed_hadamard and future.fused_amax_activations == {"srelu", "tanh_srelu", "swiglu"}
    assert cd.sign_mask_parameter(FE_MASK[cd.FC1_HADAMARD]) == "rht_sign_mask"


def test_probe_reasons_for_a_frontend_it_cannot_use():
    missing = dict(FE_1_32)
    del missing[cd.FC1_HADAMARD]
    assert cd.capabilities_from_signatures(missing) == (
        "cudnn: the installed nvidia-cudnn-frontend has no grouped_gemm_glu_hadamard_wrapper_sm100")
    broken = dict(FE_1_32, **{cd.GEMM: "ImportError: No module named 'cutlass'"})
    assert "grouped_gemm_quant_wrapper_sm100 cannot be imported (ImportError: No module named 'cutlass')" in (
        cd.capabilities_from_signatures(broken))
    renamed = signatures(drop={(cd.DGRAD_GLU, "beta_tensor")})
    assert cd.capabilities_from_signatures(renamed) == (
        "cudnn: the installed grouped_gemm_dglu_wrapper_sm100 takes no beta_tensor")


def test_read_signatures_of_a_module():
    class Fake:
        pass

    module = Fake()
    for name, sig in FE_1_32.items():
        fn = lambda *a, **k: None  # noqa: E731
        fn.__signature__ = sig
        setattr(module, name, fn)
    assert cd.capabilities_from_signatures(cd.read_signatures(module)) == cd.capabilities_from_signatures(FE_1_32)


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is None, reason="nvidia-cudnn-frontend not installed")
def test_recorded_signatures_are_the_installed_frontends():
    import cudnn

    installed = cd.read_signatures(cudnn)
    for name, args in ARGS_1_32.items():
        assert not isinstance(installed[name], str), installed[name]
        assert set(args.split()) <= set(installed[name].parameters), name
    assert not isinstance(cd.capabilities_from_signatures(installed), str)


def test_registered_first_and_refused_on_this_machine():
    assert [t.name for t in lowerings.targets()] == ["cudnn", "triton_fp4", "triton", "reference"]
    reason = lowerings.get_target("cudnn").probe(torch.device("cuda"))
    assert isinstance(reason, str) and reason.startswith("cudnn: ")
    if importlib.util.find_spec("cudnn") is None:
        assert reason == "cudnn: nvidia-cudnn-frontend is not installed (pip install 'nvfp4_inductor[cudnn]')"


def test_explain_reason_below_sm100():
    p = choose_plan(SiteSpec("srelu", torch.device("cuda"), (9, 0)), nv.Recipe(),
                    candidates=[lowerings.get_target("cudnn"), lowerings.get_target("reference")])
    assert p.target == "reference"
    assert "cudnn needs compute capability >= 10.0, the device has 9.0" in p.reason
    # CPU sites pass it over silently
    cpu = choose_plan(SiteSpec("srelu", torch.device("cpu")), nv.Recipe())
    assert cpu.target == "reference" and "cudnn" not in cpu.reason


# ---------------------------------------------------------------------------------------
# The policy on the target as described by each frontend's signatures (its step table never runs)


def described(signatures_):
    """The registered cudnn target with the probe a frontend with these signatures gives."""
    caps = cd.capabilities_from_signatures(signatures_)
    return dataclasses.replace(lowerings.get_target("cudnn"), steps=lambda: REFERENCE_STEPS,
                               probe=lambda device: caps)


FRONTENDS = {"1.32": FE_1_32, "no_clamp": FE_NO_CLAMP, "sign_mask": FE_MASK}


def _plan(frontend, activation, sign_mask=0xD7E8, capability=(10, 0), rht=True):
    site = SiteSpec(activation, torch.device("cuda"), capability, hidden=128, ffn=256)
    return choose_plan(site, nv.Recipe(sign_mask=sign_mask, rht=rht),
                       candidates=[described(FRONTENDS[frontend]), lowerings.get_target("reference")])


# (frontend, activation, sign mask) -> (fused fc1, fused amax, fc1 wrapper or None)
TABLE = [
    ("1.32", "srelu", 0xD7E8, True, False, cd.FC1_SRELU),
    ("1.32", "srelu", 0, True, True, cd.FC1_HADAMARD),
    ("1.32", "swiglu", 0xD7E8, True, False, cd.FC1_GLU),
    ("1.32", "swiglu", 0, True, True, cd.FC1_HADAMARD),
    ("1.32", "tanh_srelu", 0xD7E8, True, False, cd.FC1_SRELU),
    ("1.32", "tanh_srelu", 0, True, False, cd.FC1_SRELU),  # the Hadamard wrapper has no clamp
    ("no_clamp", "tanh_srelu", 0xD7E8, False, False, None),
    ("no_clamp", "tanh_srelu", 0, False, False, None),
    ("no_clamp", "srelu", 0, True, True, cd.FC1_HADAMARD),
    ("sign_mask", "srelu", 0xD7E8, True, True, cd.FC1_HADAMARD),
    ("sign_mask", "swiglu", 0x1234, True, True, cd.FC1_HADAMARD),
    ("sign_mask", "tanh_srelu", 0xD7E8, True, True, cd.FC1_HADAMARD),
]


@pytest.mark.parametrize("frontend,activation,mask,fused_fc1,fused_amax,wrapper", TABLE)
def test_policy_table(frontend, activation, mask, fused_fc1, fused_amax, wrapper):
    p = _plan(frontend, activation, mask)
    assert p.target == "cudnn"
    assert (p.fused_fc1, p.fused_amax, p.fused_dgrad) == (fused_fc1, fused_amax, fused_fc1)
    if wrapper is None:
        assert f"no fused kernel for {activation}" in p.reason and cd.GEMM in p.reason
    else:
        assert f"fc1: {wrapper}" in p.reason
        assert cd.dgrad_wrapper(activation) in p.reason
    if fused_fc1 and not fused_amax:
        assert f"group Hadamard-amax pass with sign mask {mask:#06x}" in p.reason
    if activation == "tanh_srelu" and fused_fc1:
        assert "tanh_clamp_scale" in p.reason


def test_policy_without_rht_uses_the_hadamard_wrapper_for_its_amax():
    p = _plan("1.32", "srelu", rht=False)
    assert p.fused_amax and f"fc1: {cd.FC1_HADAMARD}" in p.reason and "RHT off" in p.reason


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0), (10, 3), (12, 0)])
def test_policy_by_capability(capability):
    p = _plan("1.32", "srelu", 0, capability=capability)
    assert (p.target == "cudnn") is ((10, 0) <= capability < (12, 0))
    if capability == (12, 0):
        assert "cudnn needs compute capability <= 11.99, the device has 12.0" in p.reason


def test_policy_alignment():
    site = SiteSpec("srelu", torch.device("cuda"), (10, 0), hidden=128, ffn=96)
    p = choose_plan(site, nv.Recipe(), candidates=[described(FE_1_32), lowerings.get_target("reference")])
    assert p.target == "reference" and "cudnn needs F % 64 == 0, got F = 96" in p.reason


def test_wired_capabilities():
    caps = cd.wired(cd.capabilities_from_signatures(FE_1_32))
    assert caps.fused_activations == {"srelu", "tanh_srelu", "swiglu"}
    assert caps.fused_amax_activations == {"srelu", "swiglu"}
    assert cd.wired(caps, fused=False).fused_activations == frozenset()
    target = lowerings.get_target("cudnn")
    assert target.min_capability == (10, 0) and target.max_capability == (11, 99)
