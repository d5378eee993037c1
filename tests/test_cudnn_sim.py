"""The cudnn target's step table run over the CPU simulator of the frontend's wrappers
(lowerings/cudnn_sim.py), registered through the public registry.

What holds, and what does not (each difference is named in cudnn_sim's docstring and in
docs/numerics.md section 7):
* the plain grouped GEMM (quant wrapper) gives the reference's bits on CPU;
* each fused step differs from the unfused steps it replaces by about one bf16 rounding
  (the kernels apply the activation to the fp32 alpha * acc, not to the bf16 C), within
  the tolerances stated in its test;
* the eager chain runs the plan's fused steps, so a compiled training step through
  lowerings/cudnn.py equals the eager chain bitwise, with the fused kernels on or off,
  recompute on or off;
* with the fused kernels off, that step also equals the reference target bitwise; with
  them on, it differs from the reference within the tolerance stated below."""

import importlib.util
import inspect

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor import lowerings, numerics
from nvfp4_inductor.lowerings import cudnn as cd
from nvfp4_inductor.lowerings.reference import STEPS as R
from nvfp4_inductor.recipe import QuantizeOptions
from nvfp4_inductor.testing import cudnn_sim, simulated_target
from test_cudnn_target import ARGS_1_32

SIMULATED = cd.WRAPPERS


@pytest.mark.parametrize("name", SIMULATED)
def test_simulator_has_the_wrappers_signature(name):
    assert list(inspect.signature(getattr(cudnn_sim, name)).parameters) == ARGS_1_32[name].split()


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is None, reason="nvidia-cudnn-frontend not installed")
def test_simulator_signatures_equal_the_installed_frontends():
    import cudnn

    for name in SIMULATED:
        real = inspect.signature(getattr(cudnn, name))
        sim = inspect.signature(getattr(cudnn_sim, name))
        # defaults by repr: the wgrad's input_order default is the frontend's enum, mirrored
        assert [(p.name, p.kind, repr(p.default)) for p in real.parameters.values()] == [
            (p.name, p.kind, repr(p.default)) for p in sim.parameters.values()], name


def _operands(sizes=(10, 0, 30, 300), h=64, n=128, seed=0):
    torch.manual_seed(seed)
    sizes = torch.tensor(sizes)
    tokens = int(sizes.sum())
    xq = numerics.group_quantize_torch(torch.randn(tokens, h, dtype=torch.bfloat16), sizes)
    wq = numerics.quantize_weights_torch(torch.randn(len(sizes), n, h, dtype=torch.bfloat16))
    return (xq.rowwise(), wq.rowwise(), sizes), torch.rand(tokens)


STEPS = cd.make_steps(cudnn_sim, R)
UNSIGNED = QuantizeOptions(rowwise=True, columnwise=True, rht=True, sign_mask=0)  # D's casts, the unsigned Hadamard


def test_plain_gemm_is_the_references():
    args, _ = _operands()
    assert torch.equal(STEPS.grouped_gemm(*args), R.grouped_gemm(*args))


def _wgrad_operands(sizes, m=64, n=160):
    torch.manual_seed(0)
    sizes = torch.tensor(sizes)
    tokens = int(sizes.sum())
    a = numerics.group_quantize_torch(torch.randn(tokens, m, dtype=torch.bfloat16), sizes, columnwise=True)
    b = numerics.group_quantize_torch(torch.randn(tokens, n, dtype=torch.bfloat16), sizes, columnwise=True)
    return a.columnwise(), b.columnwise(), a.columnwise_offsets


@pytest.mark.parametrize("sizes", [(10, 0, 30, 300), (0, 0, 5), (256, 1, 17), (0, 64, 0)],
                         ids=lambda s: "-".join(map(str, s)))
def test_wgrad_is_the_references(sizes):
    """The wgrad wrapper over the 256-aligned token layout, with (alpha, 1) as its global
    scales: the reference's bits on CPU (extra zero tokens add +0; empty experts give 0;
    N = 160 spans two 128-row scale tiles, so a wrong per-expert tiling would show)."""
    args = _wgrad_operands(sizes)
    assert torch.equal(STEPS.grouped_gemm_wgrad(*args), R.grouped_gemm_wgrad(*args))


def test_wgrad_simulator_refuses_scales_that_do_not_tile():
    a = torch.zeros(64, 48, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    sf = torch.zeros(128, 6, dtype=torch.uint8).view(torch.float8_e4m3fn)
    one = torch.ones(2)
    with pytest.raises(ValueError, match="expert 0 has 32 tokens"):
        cudnn_sim.grouped_gemm_wgrad_wrapper_sm100(a, a.t(), sf, sf, torch.tensor([32, 96], dtype=torch.int32),
                                                   global_scale_a=one, global_scale_b=one)


@pytest.mark.parametrize("activation,clamp,want_amax", [("srelu", None, False), ("srelu", None, True),
                                                         ("tanh_srelu", 3.0, False), ("swiglu", None, False),
                                                         ("swiglu", None, True)])
def test_fused_fc1_against_the_unfused_steps(activation, clamp, want_amax):
    args, p = _operands()
    c, d, pre, post = STEPS.fc1_act_amax(*args, p, activation, clamp, UNSIGNED, want_amax=want_amax)
    c_ref = R.grouped_gemm(*args)
    d_ref = R.activation_forward(c_ref, p, activation, clamp)
    assert torch.equal(c, c_ref)  # C: the same bf16(alpha * acc)
    # D from the fp32 C: within one bf16 rounding of C, propagated (2 |dC/C| for srelu;
    # silu(a) amplifies it by |1 + a| where the gate a is very negative and D tiny: an
    # absolute bound there, relative to max |D|)
    atol = 2 ** -8 * float(d_ref.float().abs().max()) if activation == "swiglu" else 1e-30
    torch.testing.assert_close(d.float(), d_ref.float(), rtol=2 ** -6, atol=atol)
    assert not torch.equal(d, d_ref)
    if want_amax:
        pre_ref, post_ref = R.group_hadamard_amax(d_ref, args[2], UNSIGNED)
        torch.testing.assert_close(pre, pre_ref, rtol=2 ** -6, atol=0)
        torch.testing.assert_close(post, post_ref, rtol=2 ** -6, atol=0)
    else:
        assert pre is None and post is None


@pytest.mark.parametrize("activation,clamp", [("srelu", None), ("tanh_srelu", 3.0), ("swiglu", None)])
def test_fused_dgrad_against_the_unfused_steps(activation, clamp):
    args, p = _operands(n=128)
    c = torch.randn(args[0].data.shape[0], 256 if activation == "swiglu" else 128, dtype=torch.bfloat16)
    dc, dp, d = STEPS.fc2_dgrad_act(*args, c, p, activation, clamp, regenerate=True)
    g = R.grouped_gemm(*args)
    # the dsrelu kernel reads the fp32 alpha * acc, our G is its bf16 rounding: dC within
    # that rounding; dp (a signed sum) within it relative to the row's sum of |terms|
    dc_ref, dp_ref, d_ref = R.activation_backward(g, c, p, activation, clamp, regenerate=True)
    assert dc.shape == dc_ref.shape and dp.shape == p.shape
    # dSwiGLU: alpha as sqrt(.)^2 as well; both within a few bf16 roundings (SwiGLU: an
    # absolute bound relative to max |dC| too, as for D)
    atol = 2 ** -8 * float(dc_ref.float().abs().max()) if activation == "swiglu" else 1e-30
    torch.testing.assert_close(dc.float(), dc_ref.float(), rtol=2 ** -6, atol=atol)
    f = d_ref.float() / p.view(-1, 1)
    bound = (f * g.float()).abs().sum(dim=1) * 2 ** -7 + 1e-30
    assert bool(((dp - dp_ref).abs() <= bound).all())
    if activation in ("srelu", "swiglu"):
        assert torch.equal(d, d_ref)  # regenerated D from the same bf16 C: (r * r) * p; SwiGLU's is ours
    else:
        torch.testing.assert_close(d.float(), d_ref.float(), rtol=2 ** -6, atol=1e-30)


# ---------------------------------------------------------------------------------------
# The training step through lowerings/cudnn.py over the simulator, eager and compiled


def _model(activation, recipe=None):
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(3, 64, 128, activation, tanh_clamp_scale=3.0 if activation == "tanh_srelu" else None,
                        recipe=recipe)
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    return mlp, (x, torch.tensor([10, 0, 30]), torch.rand(40, requires_grad=True))


def _grads(mlp, args, compiled, recompute=True):
    """[Y, dX, dprobs, dW1, dW2] of one training step, eager or compiled (AOTAutograd)."""
    torch._dynamo.reset()
    mlp.zero_grad()
    for a in args:
        a.grad = None
    model = torch.compile(mlp, backend=nv.backend(compiler="aot_eager", recompute=recompute)) if compiled else mlp
    torch.manual_seed(1)
    y = model(*args)
    y.backward(torch.randn_like(y))
    return [y.detach(), args[0].grad, args[2].grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_unfused_step_compiled_equals_eager_and_reference(activation):
    mlp, args = _model(activation)
    reference = _grads(mlp, args, compiled=False)  # CPU: the reference target
    with lowerings.registered(simulated_target(fused=False)):
        [site] = nv.explain(mlp)(*args).sites
        assert site.target == "cudnn_sim" and cd.GEMM in site.reason
        eager = _grads(mlp, args, compiled=False)
        compiled = _grads(mlp, args, compiled=True)
    for a, b, c in zip(compiled, eager, reference):
        assert torch.equal(a, b) and torch.equal(b, c)


# (activation, sign mask, recompute); sign mask 0 lets the Hadamard wrapper's amaxes feed
# D's casts (rule 4), which tanh-SReLU's lack of a clamp there rules out
FUSED_CASES = [(act, 0xD7E8, recompute) for act in ("srelu", "tanh_srelu", "swiglu") for recompute in (True, False)]
FUSED_CASES += [("srelu", 0, True), ("swiglu", 0, True)]


@pytest.mark.parametrize("activation,sign_mask,recompute", FUSED_CASES)
def test_fused_step_compiled_equals_eager(activation, sign_mask, recompute):
    """With the fused kernels on, the eager chain runs the plan's fused steps too, so
    compiled == eager bitwise for Y and every gradient. D's column-wise copy is saved
    whatever the recompute option (rule 5: the fused fc1 makes D from the fp32 accumulator,
    which the backward cannot rebuild from the saved C), so recompute on == off as well."""
    recipe = nv.Recipe(sign_mask=sign_mask)
    mlp, args = _model(activation, recipe)
    with lowerings.registered(simulated_target()):
        [site] = nv.explain(mlp, backend=nv.backend(recipe=recipe, recompute=recompute))(*args).sites
        assert site.target == "cudnn_sim"
        assert f"fc1: {cd.fc1_wrapper(activation, sign_mask == 0)}" in site.reason
        assert f"fc2 dgrad: {cd.dgrad_wrapper(activation)}" in site.reason
        assert "D's column-wise copy is saved, recompute or not" in site.reason
        assert "D col data" in [name for name, *_ in site.saved]
        eager = _grads(mlp, args, compiled=False)
        compiled = _grads(mlp, args, compiled=True, recompute=recompute)
    for name, a, b in zip(("Y", "dX", "dprobs", "dW1", "dW2"), compiled, eager):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("activation", ["srelu", "tanh_srelu", "swiglu"])
def test_fused_step_against_the_reference_within_tolerance(activation):
    """The cudnn target with its fused kernels (eager, which is compiled) against the
    reference target: not bitwise, through the named contract differences (docs/numerics.md
    section 7): the activation reads the fp32 accumulator (1; every activation), tanh-SReLU's
    own form (4), dSReLU's fp32 upstream gradient and order (5), dSwiGLU's alpha and order
    (6). Each moves a value by about one bf16 rounding (the step tests above); once an NVFP4
    code of D or dC flips, everything downstream moves by a quantization step. Tolerance:
    relative L2 < 0.1 per output and gradient (measured over 4 seeds, sign masks 0xD7E8 and
    0: 0.1-6.3%; dprobs at most 0.25%)."""
    mlp, args = _model(activation)
    reference = _grads(mlp, args, compiled=False)
    with lowerings.registered(simulated_target()):
        cudnn = _grads(mlp, args, compiled=False)
    assert not torch.equal(cudnn[0], reference[0])  # the fused kernels ran
    for name, a, b in zip(("Y", "dX", "dprobs", "dW1", "dW2"), cudnn, reference):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 0.1, name


class Recording:
    """A frontend that records the keyword arguments each wrapper is called with and runs
    the simulator."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        fn = getattr(cudnn_sim, name)

        def call(*args, **kwargs):
            assert not args, f"{name} is called with keywords only"
            self.calls.append((name, kwargs))
            return fn(**kwargs)

        return call


def test_argument_sets_bind_to_the_wrappers_signatures():
    """Every argument set the step table passes binds to 1.32's signatures (recorded), and
    to the installed frontend's when it is importable."""
    from test_cudnn_target import FE_1_32

    fe = Recording()
    steps = cd.make_steps(fe, R)
    args, p = _operands()
    steps.grouped_gemm(*args)
    steps.fc1_act_amax(*args, p, "srelu", None, UNSIGNED, want_amax=True)
    steps.fc1_act_amax(*args, p, "tanh_srelu", 3.0, UNSIGNED, want_amax=False)
    c = torch.randn(args[0].data.shape[0], 128, dtype=torch.bfloat16)
    dargs, _ = _operands(n=128)
    steps.fc2_dgrad_act(*dargs, c, p, "tanh_srelu", 3.0, regenerate=True)
    steps.fc1_act_amax(*_operands(n=256)[0], p, "swiglu", None, UNSIGNED, want_amax=False)
    steps.fc2_dgrad_act(*dargs, torch.randn(c.shape[0], 256, dtype=torch.bfloat16), p, "swiglu", None)
    steps.grouped_gemm_wgrad(*_wgrad_operands((10, 0, 30)))
    assert {name for name, _ in fe.calls} == set(SIMULATED)
    installed = None
    if importlib.util.find_spec("cudnn") is not None:
        import cudnn as installed
    for name, kwargs in fe.calls:
        FE_1_32[name].bind(**kwargs)
        if installed is not None:
            inspect.signature(getattr(installed, name)).bind(**kwargs)


@pytest.mark.parametrize("wrapper", sorted(cudnn_sim.SEMANTICS))
def test_semantics_switch(wrapper):
    """``frontend(semantics)``: the same signatures; v1.23's contract gives other outputs than
    1.32's (so the self-check can tell them apart), the default is the module's own."""
    v123 = cudnn_sim.frontend({wrapper: "1.23"})
    assert inspect.signature(getattr(v123, wrapper)) == inspect.signature(getattr(cudnn_sim, wrapper))
    assert cudnn_sim.frontend().grouped_gemm_quant_wrapper_sm100 is cudnn_sim.grouped_gemm_quant_wrapper_sm100
    args, p = _operands(n=128)
    if wrapper == cd.DGRAD_SRELU:
        c = torch.randn(args[0].data.shape[0], 128, dtype=torch.bfloat16)
        run = lambda fe: cd.make_steps(fe, R).fc2_dgrad_act(*args, c, p, "srelu", None)[0]  # noqa: E731
    else:
        run = lambda fe: cd.make_steps(fe, R).fc1_act_amax(*args, p, "srelu", None, UNSIGNED)[1]  # noqa: E731
    assert torch.equal(run(cudnn_sim.frontend({wrapper: "1.32"})), run(cudnn_sim))
    assert not torch.equal(run(v123), run(cudnn_sim))
    with pytest.raises(ValueError, match="semantics must map a wrapper"):
        cudnn_sim.frontend({wrapper: "1.99"})
