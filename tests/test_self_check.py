"""The cudnn target's self-check (lowerings/self_check.py) over a simulated SM10x device: the
simulator stands in for the real wrappers (``testing.simulated_sm100``: the registry's
"cudnn" target over ``cudnn_sim.frontend(semantics)`` on CPU tensors, with a faked stack),
so its probe runs the check exactly as on a Blackwell GPU. Each test has its own Inductor
cache dir (the verdicts' home)."""

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor.lowerings import SiteSpec, choose_plan, self_check
from nvfp4_inductor.lowerings import cudnn as cd
from nvfp4_inductor.testing import SIMULATED_STACK, cudnn_sim, simulated_sm100

V123_DSRELU = {cd.DGRAD_SRELU: "1.23"}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    self_check.forget()
    yield tmp_path
    self_check.forget()


def _model(activation="srelu"):
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(3, 64, 128, activation, tanh_clamp_scale=3.0 if activation == "tanh_srelu" else None)
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    return mlp, (x, torch.tensor([10, 0, 30]), torch.rand(40, requires_grad=True))


def _grads(mlp, args, compiled):
    torch._dynamo.reset()
    mlp.zero_grad()
    for a in args:
        a.grad = None
    model = torch.compile(mlp, backend=nv.backend(compiler="aot_eager")) if compiled else mlp
    torch.manual_seed(1)
    y = model(*args)
    y.backward(torch.randn_like(y))
    return [y.detach(), args[0].grad, args[2].grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]


def test_a_passing_check_selects_cudnn_and_explain_says_so():
    """The probe's first call is inside Dynamo's fake-tensor run of the eager chain's graph
    node: the check runs outside every dispatch mode, on real tensors."""
    mlp, args = _model()
    with simulated_sm100():
        [site] = nv.explain(mlp)(*args).sites
    assert site.target == "cudnn"
    assert f"fc2 dgrad: {cd.DGRAD_SRELU}" in site.reason
    date = self_check.known(SIMULATED_STACK).date[:10]
    for wrapper in (cd.FC1_SRELU, cd.DGRAD_SRELU, cd.GEMM, cd.WGRAD):
        assert f"{wrapper}: self-checked on {SIMULATED_STACK.gpu}, {date}: pass" in site.reason
    verdict = self_check.known(SIMULATED_STACK)
    assert all(c.ok for c in verdict.cases) and verdict.cases[-1].step == "training step"
    assert verdict.case(cd.DGRAD_SRELU, "srelu").semantics == "1.32"


def test_the_check_fails_a_wrapper_that_computes_something_else():
    """A control: the check can fail. A frontend whose quant GEMM drops alpha refuses the target."""
    broken = cudnn_sim.frontend()
    real = broken.grouped_gemm_quant_wrapper_sm100

    def no_alpha(**kwargs):
        return real(**dict(kwargs, alpha_tensor=torch.ones_like(kwargs["alpha_tensor"])))

    case = self_check.check_case(type("Fe", (), dict(vars(broken), grouped_gemm_quant_wrapper_sm100=staticmethod(
        no_alpha)))(), torch.device("cpu"), cd.GEMM, None)
    assert not case.ok and "differs from the simulator (1.32) by relative L2" in case.why


@pytest.mark.parametrize("activation", ["srelu", "tanh_srelu"])
def test_v1_23_dsrelu_is_detected_and_its_step_falls_back(activation):
    mlp, args = _model(activation)
    reference = _grads(mlp, args, compiled=False)  # CPU: the reference target
    with simulated_sm100(V123_DSRELU), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        [site] = nv.explain(mlp)(*args).sites
        eager = _grads(mlp, args, compiled=False)
        compiled = _grads(mlp, args, compiled=True)
    verdict = self_check.known(SIMULATED_STACK)
    case = verdict.case(cd.DGRAD_SRELU, activation)
    assert not case.ok and case.semantics == "1.23" and "computes v1.23's contract" in case.why
    named = [str(w.message) for w in caught if cd.DGRAD_SRELU in str(w.message)]
    assert len([m for m in named if f"({activation})" in m]) == 1 and "its fused step runs unfused" in named[0]
    assert site.target == "cudnn" and "fused fc2 dgrad is off" in site.reason
    assert f"{cd.DGRAD_SRELU}: self-checked on {SIMULATED_STACK.gpu}" in site.reason and "fail (computes v1.23" in (
        site.reason)
    assert f"fc1: {cd.FC1_SRELU}" in site.reason  # fc1's fused step stays on
    assert verdict.case(cd.FC1_SRELU, activation).ok and verdict.cases[-1].ok  # training step
    for name, a, b, r in zip(("Y", "dX", "dprobs", "dW1", "dW2"), compiled, eager, reference):
        assert torch.equal(a, b), name
        assert float((a.float() - r.float()).norm() / r.float().norm()) < 0.1, name  # numerics.md 7


def test_v1_23_hadamard_is_detected():
    with simulated_sm100({cd.FC1_HADAMARD: "1.23"}), pytest.warns(UserWarning, match=cd.FC1_HADAMARD):
        plan = choose_plan(SiteSpec("swiglu", torch.device("cpu")), nv.Recipe(sign_mask=0))
    assert plan.target == "cudnn" and plan.fused_fc1 and not plan.fused_amax
    case = self_check.known(SIMULATED_STACK).case(cd.FC1_HADAMARD, "swiglu")
    assert case.semantics == "1.23" and "Hadamard-transformed" in case.why


def test_a_second_process_reads_the_cache(cache_dir):
    with simulated_sm100():
        choose_plan(SiteSpec("srelu", torch.device("cpu")), nv.Recipe())
    path = self_check.cache_path(SIMULATED_STACK)
    assert path.is_relative_to(cache_dir) and json.loads(path.read_text())["stack"]["gpu"] == SIMULATED_STACK.gpu
    code = ("import torch, nvfp4_inductor as nv\n"
            "from torch._dynamo.utils import counters\n"
            "from nvfp4_inductor.lowerings import SiteSpec, choose_plan\n"
            "from nvfp4_inductor.testing import simulated_sm100\n"
            "with simulated_sm100():\n"
            "    plan = choose_plan(SiteSpec('srelu', torch.device('cpu')), nv.Recipe())\n"
            "print(plan.target, counters['nvfp4']['cudnn_self_check_runs'])\n")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cudnn", "0"]
    # another stack (a new driver) is checked again
    with simulated_sm100(stack=dataclasses.replace(SIMULATED_STACK, driver="other")):
        choose_plan(SiteSpec("srelu", torch.device("cpu")), nv.Recipe())
    assert len(list(path.parent.glob("*.json"))) == 2


def _broken_gemm_stack():
    return dataclasses.replace(SIMULATED_STACK, gpu="simulated B200 with a broken GEMM")


def test_require_on_a_failed_check_is_a_clear_error():
    """A cached verdict whose basis step failed (as a GPU whose GEMM disagrees would write)."""
    mlp, args = _model()
    fail = self_check.Case("fc2 fprop / fc1 dgrad", cd.GEMM, None, False, "out differs from the simulator")
    stack = _broken_gemm_stack()
    verdict = self_check.Verdict(stack, "2026-12-06T00:00:00+00:00", 0.0, (fail,))
    path = self_check.cache_path(stack)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(verdict.to_json()))
    with simulated_sm100(stack=stack):
        # Dynamo wraps the backend's error (BackendCompilerFailed), keeping its text
        with pytest.raises((NotImplementedError, torch._dynamo.exc.BackendCompilerFailed), match="option cudnn='require': the cudnn target cannot run this srelu "
                                                      "grouped MLP on cpu: .*its self-check on simulated B200 with a "
                                                      "broken GEMM .*failed: grouped_gemm_quant_wrapper_sm100: out "
                                                      "differs"):
            nv.explain(mlp, backend=nv.backend(cudnn="require"))(*args)
        [site] = nv.explain(mlp)(*args).sites  # auto: passed over, with the reason
        assert site.target == "reference" and "self-check on simulated B200 with a broken GEMM" in site.reason


def test_cudnn_off_passes_the_target_over_and_the_option_is_checked():
    mlp, args = _model()
    with simulated_sm100():
        [site] = nv.explain(mlp, backend=nv.backend(cudnn="off"))(*args).sites
        assert site.target == "reference"
    with pytest.raises(ValueError, match="option 'cudnn' must be one of \\('auto', 'require', 'off'\\); got 'on'"):
        nv.backend(cudnn="on")
