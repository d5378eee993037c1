"""The triton_fp4 target (lowerings/triton_fp4_target.py) and its self-check
(lowerings/fp4_self_check.py) on a faked SM10x without the cuDNN frontend
(``testing.simulated_sm100_fp4``: the CPU as the GPU, the FP4 GEMMs under the Triton
interpreter with their one MMA replaced by its exact sum). The check runs once for the
module (its verdict then comes from this process's cache, as on a GPU); a wrong kernel
stand-in is checked under another stack.

What only an SM10x GPU can show: that ``tcgen05.mma`` computes within the check's bound
(tests/test_native_fp4.py says why), and the traced launches of the FP4 kernels."""

import dataclasses
import json
import warnings

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor import lowerings
from nvfp4_inductor.lowerings import Plan, SiteSpec, choose_plan, fp4_self_check, self_check

pytest.importorskip("triton")
from nvfp4_inductor import kernels  # noqa: E402

if not kernels.available("cpu"):
    pytest.skip("the FP4 kernels run on CPU only under TRITON_INTERPRET=1", allow_module_level=True)

from nvfp4_inductor.kernels.grouped_gemm_fp4 import grouped_gemm_fp4  # noqa: E402
from nvfp4_inductor.lowerings.triton import FP4_STEPS, STEPS  # noqa: E402
from nvfp4_inductor.program import SiteOptions, recorded_steps  # noqa: E402
from nvfp4_inductor.testing import SIMULATED_STACK, simulated_sm100_fp4  # noqa: E402

FP4 = "kernels.grouped_gemm_fp4.grouped_gemm_fp4"
FP4_WGRAD = "kernels.grouped_gemm_fp4.grouped_gemm_wgrad_fp4"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One Inductor cache dir (the verdicts' home) for the module: the passing check runs once."""
    path = tmp_path_factory.mktemp("inductor_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
        self_check.forget()
        yield path
        self_check.forget()


@pytest.fixture(scope="module")
def passed(cache_dir):
    """The FP4 self-check's verdict on the faked SM10x, run here under the interpreter."""
    from torch._dynamo.utils import counters

    runs = counters["nvfp4"]["triton_fp4_self_check_runs"]
    with simulated_sm100_fp4():
        plan = choose_plan(SiteSpec("srelu", CPU), nv.Recipe())
    assert counters["nvfp4"]["triton_fp4_self_check_runs"] == runs + 1
    return plan, self_check.known(SIMULATED_STACK, fp4_self_check.KIND)


def _model():
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(3, 64, 128, "srelu")
    return mlp, (torch.randn(40, 64, dtype=torch.bfloat16), torch.tensor([10, 0, 30]), torch.rand(40))


def test_the_check_runs_the_fp4_kernels_and_passes(passed, cache_dir):
    plan, verdict = passed
    assert [(c.step, c.wrapper, c.ok) for c in verdict.cases] == [
        ("fc2 fprop / dgrads", FP4, True), ("wgrads", FP4_WGRAD, True),
        ("training step", "fused ops == eager chain", True)], verdict.cases
    assert plan.target == "triton_fp4" and plan.fused_fc1 and plan.fused_dgrad
    path = self_check.cache_path(SIMULATED_STACK, fp4_self_check.KIND)
    assert path.is_relative_to(cache_dir) and path.parent.name == "triton_fp4_self_check"
    assert self_check.Verdict.from_json(json.loads(path.read_text())) == verdict


def test_a_passing_check_selects_the_fp4_gemms_and_explain_says_so(passed):
    mlp, args = _model()
    with simulated_sm100_fp4():
        [site] = nv.explain(mlp)(*args).sites
    assert site.target == "triton_fp4"
    date = passed[1].date[:10]
    for kernel in (FP4, FP4_WGRAD):
        assert f"{kernel}: self-checked on {SIMULATED_STACK.gpu}, {date}: pass" in site.reason
    assert "fc2 fprop, fc1 dgrad, the wgrads on the FP4 tensor cores" in site.reason
    forward, backward = dict(site.forward_steps), dict(site.backward_steps)
    assert forward["fc2 GEMM -> Y"] == FP4
    assert forward["fc1 GEMM + activation * p -> C (saved), D, one kernel"].endswith("grouped_gemm_act")
    assert backward["fc1 dgrad -> dX"] == FP4 and backward["fc2 wgrad -> dW2"] == FP4_WGRAD


def _swapped_nibbles(a, b, group_sizes):
    """A wrong kernel: reads a's element 2i from the high nibble (a packing mistake on one
    operand; on both it would only permute K, and pass)."""
    return grouped_gemm_fp4(a._replace(data=(a.data >> 4) | (a.data << 4)), b, group_sizes)


def test_a_wrong_kernel_fails_the_check_and_the_bf16_gemms_run(passed):
    """A control: the check can fail. The plan falls to the triton target, one warning names the kernel."""
    stack = dataclasses.replace(SIMULATED_STACK, gpu="simulated B200 with a wrong FP4 kernel")
    wrong = dataclasses.replace(FP4_STEPS, grouped_gemm=_swapped_nibbles)
    mlp, args = _model()
    with simulated_sm100_fp4(wrong, stack), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = choose_plan(SiteSpec("srelu", CPU), nv.Recipe())
        [site] = nv.explain(mlp)(*args).sites
    kernel = "test_fp4_self_check._swapped_nibbles"
    named = [str(w.message) for w in caught if "triton_fp4 self-check" in str(w.message)]
    assert len(named) == 1 and kernel in named[0] and "bf16-operand GEMMs run" in named[0], named
    verdict = self_check.known(stack, fp4_self_check.KIND)
    assert [c.ok for c in verdict.cases] == [False, True]  # no training step after a failed kernel
    assert "outside the fp32-accumulation bound of the exact product" in verdict.cases[0].why
    assert plan.target == "triton" and site.target == "triton"
    assert f"triton_fp4: its self-check on {stack.gpu}" in site.reason and f"failed: {kernel}: " in site.reason
    assert dict(site.forward_steps)["fc2 GEMM -> Y"].endswith("grouped_gemm_via_bf16")


def test_the_cudnn_target_goes_first_and_cudnn_off_gives_the_fp4_gemms(passed):
    cudnn = lowerings.Target("cudnn", lambda: STEPS, lambda device: lowerings.Capabilities(), device_types=("cpu",))
    with simulated_sm100_fp4():
        candidates = [cudnn, *(t for t in lowerings.targets() if t.name != "cudnn")]
        assert choose_plan(SiteSpec("srelu", CPU), nv.Recipe(), candidates).target == "cudnn"
        assert choose_plan(SiteSpec("srelu", CPU), nv.Recipe(), candidates, cudnn="off").target == "triton_fp4"


def test_the_real_target_runs_on_sm10x_only():
    target = lowerings.get_target("triton_fp4")
    assert [t.name for t in lowerings.targets()] == ["cudnn", "triton_fp4", "triton", "reference"]
    for capability, why in [((9, 0), "needs compute capability >= 10.0"), ((12, 0), "<= 11.99, the device has 12.0")]:
        assert why in target.device_mismatch("cuda", capability)
    assert target.device_mismatch("cuda", (10, 3)) is None and target.device_mismatch("cpu", None)


# ---------------------------------------------------------------------------------------
# How operands reach each kernel: packed copies for the FP4 GEMMs, deq() for the bf16 ones


def _casts(steps, fused: bool):
    opts = SiteOptions("srelu", None, nv.Recipe(), Plan("t", fused, False, fused, ""), recompute=True)
    forward, backward = recorded_steps(steps, opts)
    return {text.split(":")[0]: "(row as deq() values)" in text for text, _ in forward + backward
            if text.startswith("quantize")}


def test_fused_steps_get_deq_copies_and_fp4_gemms_packed_ones():
    assert _casts(FP4_STEPS, fused=True) == {"quantize x": True, "quantize W1": True, "quantize D": False,
                                             "quantize W2": False, "quantize dY": True, "quantize dC": False}
    assert not any(_casts(FP4_STEPS, fused=False).values())  # fc1 and fc2's dgrad are FP4 GEMMs too
    # the Triton target (SM90): unchanged, every forward GEMM operand and dY's as deq()
    assert _casts(STEPS, fused=True) == {"quantize x": True, "quantize W1": True, "quantize D": True,
                                         "quantize W2": True, "quantize dY": True, "quantize dC": False}
    assert _casts(STEPS, fused=False) == _casts(STEPS, fused=True)
