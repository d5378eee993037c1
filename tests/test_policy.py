"""Target selection and SPEC 6 rules 3-4, with described (not installed) targets."""

import pytest

from nvfp4_inductor import Recipe
from nvfp4_inductor.lowerings.policy import (
    CUDNN_CAPS,
    REFERENCE_CAPS,
    SiteSpec,
    TargetCapabilities,
    choose_plan,
    fused_amax_allowed,
)

FUSED_SIGNED = TargetCapabilities("signed", "cuda", fused_act_amax=True, fused_amax_takes_sign_mask=True,
                                  fused_tanh_clamp=True)
FUSED_NO_CLAMP = TargetCapabilities("noclamp", "cuda", fused_act_amax=True, fused_amax_takes_sign_mask=True,
                                    fused_tanh_clamp=False)


def site(activation="srelu", device="cuda", capability=(10, 0)):
    return SiteSpec(activation=activation, device_type=device, capability=capability)


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_unsigned_hadamard_kernel_fuses_only_with_mask_zero(activation):
    allowed, why = fused_amax_allowed(CUDNN_CAPS, site(activation), Recipe())
    assert not allowed and "0xd7e8" in why and "unsigned" in why
    allowed, _ = fused_amax_allowed(CUDNN_CAPS, site(activation), Recipe(sign_mask=0))
    assert allowed


def test_unsigned_kernel_fuses_when_rht_is_off():
    assert fused_amax_allowed(CUDNN_CAPS, site(), Recipe(rht=False))[0]


def test_signed_kernel_fuses_with_any_mask():
    assert fused_amax_allowed(FUSED_SIGNED, site("swiglu"), Recipe(sign_mask=0x1234))[0]


def test_tanh_srelu_fuses_only_where_the_kernel_has_the_clamp():
    assert fused_amax_allowed(FUSED_SIGNED, site("tanh_srelu"), Recipe())[0]
    allowed, why = fused_amax_allowed(FUSED_NO_CLAMP, site("tanh_srelu"), Recipe())
    assert not allowed and "tanh" in why
    assert fused_amax_allowed(FUSED_NO_CLAMP, site("srelu"), Recipe())[0]


def test_no_fused_kernel_means_the_amax_pass():
    allowed, why = fused_amax_allowed(REFERENCE_CAPS, site(device="cpu", capability=None), Recipe())
    assert not allowed and "amax pass" in why


def test_choose_plan_prefers_capable_available_targets():
    plan = choose_plan(site(capability=(10, 0)), Recipe(sign_mask=0), targets=(CUDNN_CAPS, FUSED_SIGNED),
                       available={"cudnn", "signed"})
    assert plan.target == "cudnn" and plan.fused_amax
    plan = choose_plan(site(capability=(9, 0)), Recipe(), targets=(CUDNN_CAPS, FUSED_SIGNED),
                       available={"cudnn", "signed"})
    assert plan.target == "signed" and "compute capability" in plan.reason
    plan = choose_plan(site(capability=(10, 0)), Recipe(), targets=(CUDNN_CAPS,), available=set())
    assert plan.target == "reference" and "not installed" in plan.reason


def test_cpu_sites_run_the_reference():
    plan = choose_plan(site(device="cpu", capability=None), Recipe())
    assert plan.target == "reference" and not plan.fused_amax
