"""The compiled path on a GPU (`pytest -m gpu` on the H200): compiled == eager bitwise,
recompute on == off bitwise, two identical runs identical, for every activation with
stochastic rounding on and off, at shapes that fill the machine a little."""

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor.lowerings import SiteSpec, choose_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXPERTS, HIDDEN, FFN, TOKENS = 8, 512, 256, 4096


def _model(activation, seed=0):
    torch.manual_seed(seed)
    clamp = 4.0 if activation == "tanh_srelu" else None
    mlp = nv.GroupedMLP(EXPERTS, HIDDEN, FFN, activation, clamp, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16().requires_grad_()
    ids = torch.randint(0, EXPERTS, (TOKENS,), device="cuda", generator=gen)
    sizes = torch.bincount(ids, minlength=EXPERTS)
    sizes[3] = 0  # an empty expert
    sizes[4] += TOKENS - int(sizes.sum())
    probs = torch.rand(TOKENS, device="cuda", generator=gen).requires_grad_()
    return mlp, (x, sizes, probs)


ACTIVATIONS = ["srelu", "tanh_srelu", "swiglu"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cuda_sites_plan_the_triton_target_with_its_fused_kernels(activation):
    """On SM80+ with Triton, every site runs the Triton target with both fused kernels (D's
    amaxes from an amax pass: the Triton fc1 kernel has none), and explain reports that plan."""
    plan = choose_plan(SiteSpec.on("cuda", activation, hidden=HIDDEN, ffn=FFN), nv.Recipe())
    assert (plan.target, plan.fused_fc1, plan.fused_amax, plan.fused_dgrad) == ("triton", True, False, True), plan
    mlp, args = _model(activation)
    [site] = nv.explain(mlp)(*args).sites
    assert site.target == "triton" and site.reason == plan.reason
    assert site.traced and "launches: traced, Inductor's generated code launches each kernel" in str(
        nv.explain(mlp)(*args))
    major, minor = torch.cuda.get_device_capability()
    if major < 10:  # Hopper and older: explain says why the Blackwell target was passed over
        assert f"cudnn needs compute capability >= 10.0, the device has {major}.{minor}" in site.reason, site.reason
    assert "amax pass over D (pre + post RHT)" in dict(site.forward_steps)
ROUNDING = pytest.mark.parametrize("stochastic_rounding", [True, False], ids=["sr", "rne"])


@pytest.mark.parametrize("activation", ACTIVATIONS)
@ROUNDING
def test_compiled_equals_eager_on_gpu(activation, stochastic_rounding):
    mlp, args = _model(activation)
    mlp.recipe = nv.Recipe(stochastic_rounding=stochastic_rounding)
    report = nv.compare(mlp)(*args)
    assert report.bitwise, str(report)


def test_compare_is_bitwise_on_a_model_that_adds_with_atomics():
    """torchtitan's MoE combines with scatter_add, whose CUDA atomics make two runs of one
    compiled program differ (the H200, 2026-12-05); compare runs in deterministic mode."""
    import moe_models as mm

    torch.manual_seed(0)
    moe = mm.TitanMoE().cuda()
    x = moe.inputs(0)[0].cuda().requires_grad_()
    report = nv.compare(moe)(x)
    assert report.sites == 1 and report.bitwise, str(report)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@ROUNDING
def test_recompute_on_equals_off_on_gpu(activation, stochastic_rounding):
    mlp, args = _model(activation)
    mlp.recipe = nv.Recipe(stochastic_rounding=stochastic_rounding)
    runs = []
    for recompute in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(7)
        step = torch.compile(mlp, backend=nv.backend(recompute=recompute))
        y = step(*args)
        grads = torch.autograd.grad(y, (args[0], mlp.fc1_weight, mlp.fc2_weight, args[2]), torch.ones_like(y))
        runs.append((y, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_two_identical_runs_are_identical_on_gpu():
    mlp, args = _model("swiglu")
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        y = mlp(*args)
        outs.append((y, *torch.autograd.grad(y, (args[0], mlp.fc1_weight), torch.ones_like(y))))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_step_never_syncs_the_host(compiled):
    """Routing stays on the device: a whole forward + backward raises under CUDA's
    sync debug mode if anything (an .item(), a .tolist(), a nonzero) waits for the GPU."""
    mlp, args = _model("swiglu")
    step = torch.compile(mlp, backend="nvfp4") if compiled else mlp
    y = step(*args)  # compile and warm up outside the checked region
    torch.autograd.grad(y, (args[0], mlp.fc1_weight), torch.ones_like(y))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = step(*args)
        torch.autograd.grad(y, (args[0], mlp.fc1_weight), torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_inductor_launches_the_triton_targets_kernels_itself(activation):
    """On the Triton target the fused ops are inlined when traced (target_ops.py):
    Inductor's generated code launches our kernels, with no opaque fused op left; the
    stochastic-rounding seeds stay one opaque op (drawn as eager draws them); and the
    step still equals eager bit for bit (test_compiled_equals_eager_on_gpu)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    mlp, args = _model(activation)
    step = torch.compile(mlp, backend="nvfp4")

    def train_step():
        y = step(*args)
        return torch.autograd.grad(y, (args[0], mlp.fc1_weight, mlp.fc2_weight, args[2]), torch.ones_like(y))

    _, codes = run_and_get_code(train_step)
    code = "\n".join(codes)
    assert len(codes) == 2, "one forward and one backward module"
    for opaque in ("grouped_mlp_fwd", "grouped_mlp_bwd_fc2", "nvfp4.grouped_gemm"):
        assert opaque not in code, f"{opaque} was not inlined"
    for kernel in ("_group_cast_kernel", "_dequantize", "draw_sr_seeds"):
        assert kernel in code, f"{kernel} missing from the generated code"
    torch._dynamo.reset()


def test_untraced_launches_give_the_same_bits():
    """``trace_launches=False`` keeps each fused op one call, with the traced path's bits."""
    from torch._inductor.utils import run_and_get_code

    runs = []
    for traced in (True, False):
        torch._dynamo.reset()
        mlp, args = _model("swiglu")
        torch.manual_seed(5)
        step = torch.compile(mlp, backend=nv.backend(trace_launches=traced))

        def train_step():
            y = step(*args)
            return (y, *torch.autograd.grad(y, (args[0], mlp.fc1_weight, mlp.fc2_weight, args[2]),
                                            torch.ones_like(y)))

        outs, codes = run_and_get_code(train_step)
        assert ("grouped_mlp_fwd" in "\n".join(codes)) is not traced
        runs.append(outs)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    torch._dynamo.reset()



def test_early_compiles_are_the_binaries_inductor_loads(tmp_path):
    """The backend hands our kernels to Inductor's compile workers at the rewrite
    (compiler/early_compile.py); Inductor's own compile of each then finds Triton's cache
    entry: in a fresh process with empty caches, one training step leaves exactly one
    binary per kernel source started early, none compiled a second time under another key,
    and every Triton launcher library (gcc) built by the early compiles' thread, none on the
    main thread; a second process, with the marker in Triton's cache, starts none."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"""
import json, re, sys, threading, torch
import triton.runtime.build as build
sys.path.insert(0, {os.path.join(root, 'tests')!r})
from test_gpu_end_to_end import _model
from nvfp4_inductor.compiler import early_compile
builds, gcc = [], build._build
def _build(name, *args):
    builds.append((name, threading.current_thread().name))
    return gcc(name, *args)
build._build = _build
mlp, args = _model("swiglu")
y = torch.compile(mlp, backend="nvfp4")(*args)
torch.autograd.grad(y, (args[0], mlp.fc1_weight, mlp.fc2_weight, args[2]), torch.ones_like(y))
torch.cuda.synchronize()
names = [re.search(r"@triton.jit\\ndef (\\w+)\\(", source)[1] for source in early_compile._submitted]
json.dump(dict(names=names, builds=builds), open(sys.argv[1], "w"))
"""
    env = dict(os.environ, PYTHONPATH=root, TRITON_CACHE_DIR=str(tmp_path / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    started, builds = [], []
    for run in range(2):
        out = tmp_path / f"names{run}.json"
        done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=root, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(out.read_text())
        started.append(result["names"])
        builds += result["builds"]
    first, second = started
    assert len(first) >= 10 and second == []
    binaries = [f.name[:-len(".cubin")] for f in (tmp_path / "triton").rglob("*.cubin")]
    ours = sorted(name for name in binaries if name in set(first))
    assert ours == sorted(first)
    launchers = [thread for name, thread in builds if name == "__triton_launcher"]
    assert launchers and set(launchers) == {"nvfp4-early-compile"}, builds
