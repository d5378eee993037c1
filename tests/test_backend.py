"""The nvfp4 backend end to end: registration, options, compiled == eager bitwise,
what AOTAutograd saves (read from the real forward/backward graphs), recompiles,
inference, bad input.

Most compiled-vs-eager cases compile with ``compiler="aot_eager"``: the same rewrite,
AOTAutograd and min-cut partition as Inductor, without Inductor's C++ code generation,
which costs ~10 s per graph on CI's 2 cores. A representative subset runs Inductor.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import nvfp4_inductor as nv
from moe_models import BMM, ExpertLoop, GroupedMM, HFGroupedMMExperts, SparseMoeBlock
from _assertions import assert_bytes_equal
from compile_caches import with_graph_caches

ACTS = ["srelu_pow", "tanh_srelu", "swiglu_chunk"]


def _with_grad(args):
    return tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def _grouped_mlp_model(activation, probs):
    torch.manual_seed(0)
    clamp = 3.0 if activation == "tanh_srelu" else None
    mlp = nv.GroupedMLP(4, 32, 48, activation, clamp)  # H != F: saved tensors tell apart
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    p = torch.rand(64) if probs else None
    return mlp, (x, torch.tensor([10, 0, 31, 23]), p)


SPELLINGS = {
    "token_permutation": lambda act, prob: SparseMoeBlock(HFGroupedMMExperts(act)),
    "grouped_mm": lambda act, prob: GroupedMM(act, prob=prob and "out"),
    "grouped_mm_in_out": lambda act, prob: GroupedMM(act, prob=prob and "act", layout="in_out"),
    "expert_loop": lambda act, prob: ExpertLoop(act, prob=prob and "act"),
    "bmm": lambda act, prob: BMM(act),
}


# The bmm spelling (Llama4-style expert batch) carries no router probability; the
# token-permutation block (Hugging Face's grouped_mm experts behind a router) always does.
PROBS = {"bmm": (False,), "token_permutation": (True,)}
PLAIN_CASES = [
    pytest.param(spelling, act, probs, sr, id=f"{spelling}-{act}-{'probs' if probs else 'noprobs'}-{'sr' if sr else 'rne'}")
    for spelling in SPELLINGS
    for act in ACTS
    for probs in PROBS.get(spelling, (True, False))
    for sr in (True, False)
]


@pytest.mark.parametrize("spelling, act, probs, stochastic_rounding", PLAIN_CASES)
def test_plain_spellings_compiled_equal_eager(spelling, act, probs, stochastic_rounding):
    torch.manual_seed(0)
    model = SPELLINGS[spelling](act, probs)
    args = _with_grad(model.inputs(0))
    backend = nv.backend(recipe=nv.Recipe(stochastic_rounding=stochastic_rounding), compiler="aot_eager")
    report = nv.compare(model, backend=backend)(*args)
    assert report.bitwise, str(report)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "save"])
@pytest.mark.parametrize("probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("activation", ["srelu", "tanh_srelu", "swiglu"])
def test_grouped_mlp_module_compiled_equal_eager(activation, probs, recompute):
    mlp, args = _grouped_mlp_model(activation, probs)
    report = nv.compare(mlp, backend=nv.backend(recompute=recompute, compiler="aot_eager"))(*_with_grad(args))
    assert report.bitwise, str(report)
    assert len(report.rows) == 3 + (1 if probs else 0) + 1  # output, dx, dW1, dW2, dprobs


@pytest.mark.parametrize("activation", ["srelu", "tanh_srelu", "swiglu"])
def test_inductor_compiled_equal_eager(activation):
    mlp, args = _grouped_mlp_model(activation, probs=True)
    report = nv.compare(mlp)(*_with_grad(args))
    assert report.bitwise, str(report)


def test_inductor_token_permutation_recompute_off_equal_eager():
    model = GroupedMM("swiglu_chunk", prob="out")
    report = nv.compare(model, backend=nv.backend(recompute=False))(*_with_grad(model.inputs(1)))
    assert report.bitwise, str(report)


def _aot_graphs(model, args, recompute):
    """Forward and backward graphs AOTAutograd hands to the compiler for the rewritten
    Dynamo graph (the real partition, min-cut as Inductor's)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from nvfp4_inductor.compiler.backend import rewrite_graph
    from nvfp4_inductor.compiler.options import BackendOptions

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm.forward

        return compiler

    inner = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                         partition_fn=min_cut_rematerialization_partition)

    def backend(gm, example_inputs):
        rewrite_graph(gm, BackendOptions(recompute=recompute))
        return inner(gm, example_inputs)

    torch._dynamo.reset()
    y = torch.compile(model, backend=backend)(*args)
    y.backward(torch.randn_like(y))
    return graphs["forward"], graphs["backward"]


def _saved(forward_graph, num_outputs=1):
    out = next(n for n in forward_graph.graph.nodes if n.op == "output")
    return [n.meta["val"] for n in out.args[0][num_outputs:] if isinstance(n, torch.fx.Node)]


def _ops(graph):
    return [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_recompute_saves_neither_fc2_input_nor_its_columnwise_copy(activation):
    mlp, args = _grouped_mlp_model(activation, probs=True)
    t, f = args[0].shape[0], mlp.fc2_weight.shape[2]
    forward, backward = _aot_graphs(mlp, _with_grad(args), recompute=True)
    saved = _saved(forward)
    activations = [tuple(v.shape) for v in saved if v.dtype == torch.bfloat16 and v.dim() == 2 and v.shape[0] == t]
    assert activations == [(t, mlp.fc1_weight.shape[1])], f"only C may be saved, got {activations}"
    assert not any(v.dtype == torch.uint8 and v.dim() == 2 and v.shape[0] == f for v in saved), "D's column-wise copy is saved"
    forward_ops, backward_ops = _ops(forward), _ops(backward)
    assert "nvfp4.grouped_mlp_fwd.default" in forward_ops
    ours = [op for op in backward_ops if op.startswith("nvfp4.")]
    # fc1's two GEMMs in the order program.fc1_wgrad_last picks for the shapes
    assert ours[0] == "nvfp4.grouped_mlp_bwd_fc2.default", ours
    assert sorted(ours[1:]) == ["nvfp4.grouped_gemm.default", "nvfp4.grouped_gemm_wgrad.default"], ours
    # no separate column-wise quantize or amax reduction over D in either graph
    for op in ("nvfp4.group_quantize.default", "nvfp4.group_hadamard_amax.default", "aten.amax.default"):
        assert op not in forward_ops + backward_ops


def test_no_recompute_saves_fc2_input_columnwise_copy():
    mlp, args = _grouped_mlp_model("srelu", probs=True)
    f = mlp.fc2_weight.shape[2]
    forward, _ = _aot_graphs(mlp, _with_grad(args), recompute=False)
    assert any(v.dtype == torch.uint8 and v.dim() == 2 and v.shape[0] == f for v in _saved(forward))


def test_backward_casts_regenerated_fc2_input_with_saved_amax(use_steps):
    """Inside the fused backward: no amax pass, D quantized column-wise with the saved amax."""
    import dataclasses

    from nvfp4_inductor.lowerings.reference import STEPS

    calls = []
    use_steps(dataclasses.replace(
        STEPS,
        group_hadamard_amax=lambda *a, **k: calls.append("amax") or STEPS.group_hadamard_amax(*a, **k),
        group_quantize=lambda x, sizes, cast: calls.append(("quantize", cast.columnwise_amax is not None,
                                                            cast.rowwise)) or STEPS.group_quantize(x, sizes, cast),
    ))
    mlp, args = _grouped_mlp_model("srelu", probs=True)
    x = args[0].requires_grad_()
    y = torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))(x, *args[1:])
    forward_calls = list(calls)
    calls.clear()
    y.backward(torch.randn_like(y))
    assert forward_calls.count("amax") == 1
    assert "amax" not in calls
    assert ("quantize", True, False) in calls  # column-wise only, with the saved amax


def test_aot_eager_graphs_set_the_launch_allocator_in_their_own_thread(monkeypatch):
    """With compiler="aot_eager" the traced launches run as ``wrap_triton`` calls, which set
    no Triton allocator (the TMA kernels need one for their descriptors), and autograd may
    run the backward on a thread of its own: the backend sets the allocator in the thread of
    every graph it runs. The backward here runs on another thread (FSDP2 with aot_eager on the H200 failed
    without)."""
    import threading

    threads = []
    monkeypatch.setattr(nv.kernels, "set_launch_allocator", lambda: threads.append(threading.get_ident()))
    mlp, args = _grouped_mlp_model("srelu", probs=True)
    x = args[0].requires_grad_()
    y = torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))(x, *args[1:])
    assert threads == [threading.get_ident()]
    backward = threading.Thread(target=lambda: y.backward(torch.randn_like(y)))
    backward.start()
    backward.join()
    assert len(threads) == 2 and threads[1] == backward.ident and x.grad is not None


def test_compiled_step_draws_sr_seeds_as_device_tensors(use_steps):
    """Every SR seed reaches the steps as a tensor on the gradient's device, never a host
    int: a value read on the host would be frozen into a CUDA graph (every replay would
    round alike). tests/test_gpu_cudagraphs.py checks the replays themselves."""
    import dataclasses

    from nvfp4_inductor.lowerings.reference import STEPS

    seeds = []
    use_steps(dataclasses.replace(
        STEPS, group_quantize=lambda x, sizes, cast: seeds.append(cast.seed) or STEPS.group_quantize(x, sizes, cast)))
    mlp, args = _grouped_mlp_model("srelu", probs=True)
    x = args[0].requires_grad_()
    y = torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))(x, *args[1:])
    seeds.clear()
    y.backward(torch.randn_like(y))
    drawn = [s for s in seeds if s is not None]
    assert len(drawn) == 2, seeds  # dY's, then dC's
    assert all(isinstance(s, torch.Tensor) and s.device == x.device and s.dtype == torch.int64 for s in drawn)


def test_compiled_backward_frees_saved_tensors_after_their_last_reader(use_steps):
    """In Inductor's generated backward, C (saved by the forward op, read by fc2's backward
    op only) is freed before fc1's wgrad runs: what splitting the backward into three ops
    is for (compiler/fused.py grouped_mlp_bwd; benchmarks/memory_model.py)."""
    import dataclasses
    import weakref

    from nvfp4_inductor.lowerings.reference import STEPS as REFERENCE

    c_ref, c_alive_at_wgrad = [], []

    def gemm(*args):
        out = REFERENCE.grouped_gemm(*args)
        if not c_ref:  # the forward's first GEMM is fc1: its output is C
            c_ref.append(weakref.ref(out))
        return out

    def wgrad(*args):
        c_alive_at_wgrad.append(c_ref[0]() is not None)
        return REFERENCE.grouped_gemm_wgrad(*args)

    use_steps(dataclasses.replace(REFERENCE, grouped_gemm=gemm, grouped_gemm_wgrad=wgrad))
    torch._dynamo.reset()
    mlp, args = _grouped_mlp_model("srelu", probs=True)
    x = args[0].requires_grad_()
    y = torch.compile(mlp, backend="nvfp4")(x, *args[1:])
    y.backward(torch.randn_like(y))
    assert c_alive_at_wgrad == [True, False], f"C alive at (fc2 wgrad, fc1 wgrad): {c_alive_at_wgrad}"


@pytest.mark.parametrize("experts, ffn, wgrad_last", [(4, 48, False), (8, 64, True)])
def test_compiled_backward_runs_last_the_fc1_gemm_with_fewer_bf16_copies(use_steps, experts, ffn, wgrad_last):
    """The compiled backward graph holds fc1's dgrad and wgrad in the order
    compiler/program.fc1_wgrad_last picks (aot_eager runs the graph's order; Inductor may
    reorder independent ops by its own memory estimate, and on the reference target, whose
    ops stay whole, it does): the second one's transient bf16 operand copies sit beside
    both gradients (the step's peak). 64 tokens, H = 32: with 4 experts of F = 48 the
    dgrad's copies (W1 and dC row-wise, 4608 packed bytes against the wgrad's 5120) are the
    smaller set, with 8 of F = 64 the wgrad's (x and dC column-wise, 9216 against 10240)."""
    import dataclasses

    from nvfp4_inductor.lowerings.reference import STEPS as REFERENCE

    calls = []

    def gemm(*args):
        calls.append("dgrad")
        return REFERENCE.grouped_gemm(*args)

    def wgrad(*args):
        calls.append("wgrad")
        return REFERENCE.grouped_gemm_wgrad(*args)

    use_steps(dataclasses.replace(REFERENCE, grouped_gemm=gemm, grouped_gemm_wgrad=wgrad))
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(experts, 32, ffn, "srelu")
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    sizes = torch.full((experts,), 64 // experts)
    y = torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))(x, sizes, torch.rand(64))
    calls.clear()
    y.backward(torch.randn_like(y))
    fc1 = calls[-2:]  # fc2's GEMMs come first; its dgrad is fused with the activation backward
    assert fc1 == (["dgrad", "wgrad"] if wgrad_last else ["wgrad", "dgrad"]), calls


def test_fc1_gemm_order_refuses_a_dequantized_copy():
    """The order rule counts packed copies (2 elements a byte); a bf16 deq() copy of dC,
    which no plan makes today, would double its side and flip the order silently."""
    from nvfp4_inductor.program import fc1_wgrad_last

    packed = [torch.zeros(64, 16, dtype=torch.uint8) for _ in range(4)]
    assert fc1_wgrad_last(*packed) is False  # equal sides: the dgrad stays last
    with pytest.raises(RuntimeError, match="dC row is torch.bfloat16"):
        fc1_wgrad_last(torch.zeros(64, 32, dtype=torch.bfloat16), *packed[1:])


def test_no_recompiles_when_routing_changes():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mlp, (x, _, p) = _grouped_mlp_model("swiglu", probs=True)
    step = torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        sizes = torch.bincount(torch.randint(0, 4, (64,), generator=gen), minlength=4)
        y = step(x.requires_grad_(), sizes, p)
        y.backward(torch.ones_like(y))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch._dynamo.utils.counters["recompiles"] == {} or sum(torch._dynamo.utils.counters["recompiles"].values()) == 0


def test_no_grad_takes_forward_only_path():
    from torch._inductor.utils import run_and_get_code

    mlp, args = _grouped_mlp_model("srelu", probs=True)
    torch._dynamo.reset()
    with torch.no_grad():
        y, code = run_and_get_code(torch.compile(mlp, backend="nvfp4"), *args)
        eager = mlp(*args)
    source = "\n".join(code)
    assert "nvfp4.grouped_mlp_infer" in source and "nvfp4.grouped_mlp_fwd" not in source
    assert torch.equal(y, eager)


_CACHE_STEPS = """
import json, sys
import torch
import nvfp4_inductor as nv
from torch._dynamo.utils import counters

torch.manual_seed(0)
mlp = nv.GroupedMLP(4, 32, 48, "srelu")
x, sizes, p = torch.randn(64, 32, dtype=torch.bfloat16), torch.tensor([10, 0, 31, 23]), torch.rand(64)
eager_y = mlp(x, sizes, p)  # the forward draws no random bits
result = []
for options in json.loads(sys.argv[1]):
    torch._dynamo.reset()
    counters.clear()
    y = torch.compile(mlp, backend=nv.backend(**options))(x.clone().requires_grad_(), sizes, p)
    y.backward(torch.ones_like(y))
    result.append([dict(counters["aot_autograd"]), torch.equal(y, eager_y)])
print(json.dumps(result))
"""


def test_aotautograd_cache_takes_a_rewritten_graph(tmp_path):
    """A rewritten graph calls ``fused.fused_grouped_mlp`` with the site's options as
    constants and no class of ours (GroupedMLP's Recipe constructor is erased with the
    site), so AOTAutograd's cache stores it and a later compile of the same graph loads it
    instead of tracing the fused ops again; other options (recompute, trace_launches) are
    other entries. In a process of its own, with the caches the suite turns off on
    (compile_caches.py)."""
    env = with_graph_caches(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    options = [{}, {}, {"recompute": False}, {"trace_launches": False}]
    out = subprocess.run([sys.executable, "-c", _CACHE_STEPS, json.dumps(options)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (first, *_), (again, *_), (no_recompute, *_), (untraced, *_) = steps = json.loads(out.stdout.splitlines()[-1])
    assert all(equal for _, equal in steps)
    assert first.get("autograd_cache_saved") == 1 and not first.get("autograd_cache_bypass"), first
    assert again.get("autograd_cache_hit") == 1, again
    assert no_recompute.get("autograd_cache_miss") == 1, no_recompute
    assert untraced.get("autograd_cache_miss") == 1, untraced


def test_compiled_bad_group_sizes_raise_value_error():
    mlp, (x, _, p) = _grouped_mlp_model("srelu", probs=True)
    torch._dynamo.reset()
    step = torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))
    with pytest.raises(ValueError, match="group_sizes"):
        step(x, torch.tensor([10, -5, 30, 29]), p)
    with pytest.raises(ValueError, match="group_sizes"):
        step(x, torch.tensor([10, 5, 30, 1]), p)


def test_unknown_option_raises():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown nvfp4 backend option"):
        torch.compile(lambda t: t + 1, backend="nvfp4", options={"recomptue": False})(torch.ones(2))


def test_configured_backend_validates_its_options_when_built():
    """``nv.backend(...)`` checks its options before torch.compile is called; with
    ``backend="nvfp4", options={...}`` torch hands the options to the backend only at the
    first compile (torch.compile stores them unread), so they are checked there."""
    with pytest.raises(ValueError, match="option 'compiler' must be 'inductor' or 'aot_eager'; got 'tvm'"):
        nv.backend(compiler="tvm")
    with pytest.raises(ValueError, match="option 'recompute' must be a bool"):
        nv.backend(recompute="yes")
    with pytest.raises(TypeError, match="recomptue"):
        nv.backend(recomptue=False)


def test_options_reach_the_backend():
    from nvfp4_inductor.compiler.options import BackendOptions

    opts = BackendOptions.parse({"recipe": nv.Recipe(rht=False), "recompute": False})
    assert opts.recipe.rht is False and opts.recompute is False
    with pytest.raises(ValueError, match="recipe"):
        BackendOptions.parse({"recipe": "tensor-engine"})


def test_compile_mode_is_checked():
    """torch.compile hands a custom backend its mode unchecked: the backend checks it."""
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown torch.compile mode 'fast'"):
        torch.compile(lambda t: t + 1, backend=nv.backend(), mode="fast")(torch.ones(2))
    with pytest.raises(Exception, match="compiler='aot_eager' would ignore it"):
        torch.compile(lambda t: t + 2, backend=nv.backend(compiler="aot_eager"), mode="reduce-overhead")(torch.ones(2))


def test_reduce_overhead_mode_reaches_inductor():
    """``mode="reduce-overhead"`` turns on Inductor's CUDA graphs (``triton.cudagraphs``)
    through the backend: Inductor counts a CUDA-graph skip for this CPU graph, which it does
    only with the option on (none without the mode). The CPU run stays correct: forward and
    gradients equal the eager chain's, bit for bit, with the same seed."""
    from torch._dynamo.utils import counters

    mlp, (x, sizes, p) = _grouped_mlp_model("srelu", probs=True)

    def step(fn):
        torch.manual_seed(1)
        xg = x.detach().requires_grad_()
        y = fn(xg, sizes, p)
        y.backward(torch.ones_like(y))
        return y, xg.grad

    eager = step(mlp)
    for mode, skips in ((None, 0), ("reduce-overhead", 1)):
        torch._dynamo.reset()
        before = counters["inductor"]["cudagraph_skips"]
        compiled = step(torch.compile(mlp, backend=nv.backend(), mode=mode))
        assert counters["inductor"]["cudagraph_skips"] - before == skips, mode
        assert all(torch.equal(a, b) for a, b in zip(compiled, eager)), mode


@pytest.mark.parametrize("first", ["nothing", "import", "list_backends"])
def test_registered_by_name_in_a_fresh_process(first):
    setup = {"nothing": "", "import": "import nvfp4_inductor", "list_backends": "torch._dynamo.list_backends()"}[first]
    code = (
        "import torch, torch._dynamo\n"
        f"{setup}\n"
        "f = torch.compile(lambda t: t * 2, backend='nvfp4', options={'compiler': 'aot_eager'})\n"
        "assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))\n"
        "assert 'nvfp4' in torch._dynamo.list_backends()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_changing_token_count_recompiles_at_most_once():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mlp, _ = _grouped_mlp_model("srelu", probs=False)
    step = torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))
    for tokens in (64, 80, 96, 112):
        x = torch.randn(tokens, 32, dtype=torch.bfloat16, requires_grad=True)
        step(x, torch.tensor([tokens - 40, 0, 24, 16])).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_dump_code_writes_the_graphs_and_generated_code(tmp_path):
    mlp, args = _grouped_mlp_model("swiglu", probs=True)
    files = nv.dump_code(mlp, path=tmp_path)(*_with_grad(args))
    names = [f.name for f in files]
    assert any("Forward_graph" in n for n in names) and any("Backward_graph" in n for n in names), names
    text = "\n".join(f.read_text(errors="replace") for f in files if f.suffix == ".py")
    assert "nvfp4.grouped_mlp_fwd" in text and "nvfp4.grouped_mlp_bwd_fc2" in text
    # Inductor's generated code calls the fused ops with their options by name
    kernels = "\n".join(f.read_text() for f in files if ".kernel_" in f.name)
    fwd = next(line for line in kernels.splitlines() if "torch.ops.nvfp4.grouped_mlp_fwd.default(" in line)
    for option in ("activation='swiglu'", "rht=True", "sign_mask=55272", "block_2d=True", "stochastic_rounding=True",
                   "recompute=True", "target='reference'", "fused_fc1=False"):
        assert option in fwd, f"{option} not in {fwd}"


def test_explain_reports_sites_rejections_and_saved_bytes():
    model = GroupedMM("gelu")
    report = nv.explain(model)(*model.inputs(0))
    assert report.sites == [] and report.rejected and "gelu" in str(report).lower()
    mlp, args = _grouped_mlp_model("srelu", probs=True)
    report = nv.explain(mlp)(*_with_grad(args))
    assert len(report.sites) == 1 and report.sites[0].saved_bytes > 0
    assert any("group_hadamard_amax" in runs for _, runs in report.sites[0].forward_steps)
    assert not any("group_hadamard_amax" in runs for _, runs in report.sites[0].backward_steps)


def test_counters_count_sites_and_rejections():
    torch._dynamo.utils.counters.clear()
    torch._dynamo.reset()
    model = GroupedMM("gelu")
    torch.compile(model, backend=nv.backend(compiler="aot_eager"))(*model.inputs(0))
    model = GroupedMM("srelu_pow")
    torch.compile(model, backend=nv.backend(compiler="aot_eager"))(*model.inputs(0))
    counts = torch._dynamo.utils.counters
    assert counts["nvfp4"]["sites_rewritten"] == 1 and counts["nvfp4"]["sites_rejected"] == 1
    assert counts["nvfp4_rewritten_by_spelling"]["grouped_mm"] == 1


def test_explain_says_when_experts_run_outside_the_graph():
    from moe_models import MixtralEagerExperts, G, H

    model = MixtralEagerExperts()
    hidden = torch.randn(32, H, dtype=torch.bfloat16)
    report = nv.explain(model)(hidden, torch.randint(0, G, (32, 2)), torch.rand(32, 2, dtype=torch.bfloat16))
    assert report.sites == [] and report.graph_breaks
    assert "outside any graph" in str(report)


def test_rest_of_a_mixed_model_matches_stock_inductor_bitwise():
    """Two MoE layers between attention, norms and residuals, compare's defaults: with the
    blocks run by the eager NVFP4 chain on one side and by the nvfp4 backend on the other,
    and everything else compiled by Inductor on both, every output and gradient is
    bitwise equal."""
    from moe_models import TwoLayerModel

    torch.manual_seed(0)
    model = TwoLayerModel()
    report = nv.compare(model)(*_with_grad(model.inputs(0)))
    assert report.sites == 2 and report.bitwise, str(report)
    assert len(report.rows) > 10


def test_compiled_grouped_mlp_with_fp32_input_raises_value_error():
    mlp, (x, sizes, p) = _grouped_mlp_model("srelu", probs=True)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="x must have dtype bfloat16"):
        torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))(x.float(), sizes, p)


def test_explain_reports_what_an_expert_loop_specialises_on():
    model = ExpertLoop("srelu_pow")
    report = nv.explain(model)(*model.inputs(0))
    assert len(report.sites) == 1 and "specialised on the split sizes" in report.sites[0].specialisation
    mlp, args = _grouped_mlp_model("srelu", probs=False)
    assert "no recompile" in nv.explain(mlp)(*args).sites[0].specialisation


# ----------------------------------------------------------------------------- real clients' forms


@pytest.mark.parametrize("release,act", [("5.6", "relu2"), ("5.8", "silu"), ("5.17", "silu"), ("5.20", "relu2")])
def test_transformers_sentinel_masks_compiled_equal_eager(release, act):
    """transformers' expert-parallel sentinel rows (weight 0, expert id G): masked rows
    folded into the prob; 5.8+ sort them past offs[-1], where they join the last group."""
    from moe_models import HFExpertsRelease, SentinelMoeBlock

    torch.manual_seed(0)
    model = SentinelMoeBlock(HFExpertsRelease(release, act, ep=True))
    report = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(*_with_grad(model.inputs(0)))
    assert report.bitwise, str(report)


def test_masked_rows_compiled_equal_eager_with_zero_prob_gradient():
    from moe_models import MaskedGroupedMM

    torch.manual_seed(0)
    model = MaskedGroupedMM("fc1", "where", act="swiglu_chunk")
    x, offs, probs, mask = _with_grad(model.inputs(0))
    report = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(x, offs, probs, mask)
    assert report.bitwise, str(report)
    torch._dynamo.reset()
    probs.grad = None
    torch.compile(model, backend=nv.backend(compiler="aot_eager"))(x, offs, probs, mask).sum().backward()
    assert torch.equal(probs.grad[mask], torch.zeros_like(probs.grad[mask])) and probs.grad[~mask].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32_master_weights"])
def test_torchtitan_030_compiled_equal_eager(dtype):
    from moe_models import TitanMoE030

    torch.manual_seed(0)
    model = TitanMoE030(dtype)
    report = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(*_with_grad(model.inputs(0)))
    assert report.bitwise, str(report)


def test_explain_and_compare_with_data_dependent_row_counts():
    """An expert-parallel layer's local half in one graph: the row count is an unbacked
    symbol (nonzero, .tolist(), repeat_interleave). No guard on it anywhere in the backend;
    explain estimates the saved bytes and says so."""
    from moe_models import DataDependentRowsMoE

    torch.manual_seed(0)
    model = DataDependentRowsMoE()
    x, ids, probs = model.inputs(0)
    args = (x.requires_grad_(), ids, probs.requires_grad_())
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        report = nv.explain(model)(*args)
        compared = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(*args)
    assert len(report.sites) == 1 and report.sites[0].estimated and report.sites[0].saved_bytes > 0
    assert "estimated" in str(report)
    assert compared.bitwise, str(compared)


def test_stacked_sites_where_one_feeds_the_next_are_all_rewritten():
    """Layers stacked with nothing between them: the second site's input is the first's
    output, which the first rewrite replaces (the matched node is erased)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(nv.GroupedMLP(4, 32, 48, "swiglu") for _ in range(3))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = layers

        def forward(self, x, sizes, probs):
            for layer in self.layers:
                x = layer(x, sizes, probs)
            return x

    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    args = (x, torch.tensor([10, 0, 31, 23]), torch.rand(64, requires_grad=True))
    assert len(nv.explain(Stack())(*args).sites) == 3
    report = nv.compare(Stack(), backend=nv.backend(compiler="aot_eager"))(*args)
    assert report.bitwise, str(report)


@torch.library.custom_op("nvfp4_tests::first_of", mutates_args=())
def _first_of(a: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    """An opaque op with an operand it ignores, as a kernel launch takes a stand-in."""
    return a.clone()


@_first_of.register_fake
def _(a, unused):
    return torch.empty_like(a)


class _PlaceholderInBackward(torch.autograd.Function):
    """A backward that passes a zero-size stand-in made from a saved tensor, as our traced
    op bodies do for a kernel's unused operands."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return _first_of(grad * w, x.new_empty(0, x.shape[1])), (grad * x).sum(0)


@pytest.mark.parametrize("ours", [True, False])
def test_zero_size_stand_ins_are_made_in_the_backward_not_saved(ours):
    """Inductor's decompositions, joint-graph passes and min-cut partitioner under the
    backend's config (``inductor_patches``): the forward saves no zero-size tensor, the backward makes its
    stand-in itself. Without our joint pre-pass (the control) the partitioner saves it --
    it costs its min-cut nothing -- which on a GPU was a dozen extra allocations and saved
    tensors a step. A pre-pass the user configured still runs."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor import config
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.decomposition import select_decomp_table

    from nvfp4_inductor.compiler.backend import inductor_patches
    from nvfp4_inductor.compiler.options import BackendOptions

    class UserPass(CustomGraphPass):
        ran = 0

        def __call__(self, graph):
            UserPass.ran += 1

        def uuid(self):
            return b"user"

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    with config.patch(joint_custom_pre_pass=UserPass()):
        patches = inductor_patches(None, BackendOptions.parse({})) if ours else {}
        with config.patch(patches):
            fn = aot_function(_PlaceholderInBackward.apply, fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                              partition_fn=partition_fn, decompositions=select_decomp_table())
            fn(x, w).sum().backward()
    saved = [n.meta["val"] for n in graphs["fw"].graph.find_nodes(op="output")[0].args[0][1:]]
    made = [n for n in graphs["bw"].graph.nodes if n.op == "call_function" and n.meta["val"].numel() == 0]
    assert [tuple(t.shape) for t in saved if t.numel() == 0] == ([] if ours else [(0, 8)])
    assert len(made) == (1 if ours else 0)
    assert UserPass.ran == 1
    assert torch.equal(x.grad, w.detach().expand(4, 8)) and torch.equal(w.grad, x.detach().sum(0))


@pytest.mark.parametrize("user_uuid", [b"user", None])
def test_a_post_grad_pass_the_user_configured_still_runs(user_uuid):
    """Our post-grad pass (each checkpointed site's recompute moved before its backward) takes Inductor's
    one ``post_grad_custom_post_pass`` slot; the user's pass there runs after it (before, it
    was dropped), and Inductor's caches key on both (or bypass, where the user's pass has no uuid)."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from nvfp4_inductor.compiler.backend import inductor_patches
    from nvfp4_inductor.compiler.options import BackendOptions

    class UserPass(CustomGraphPass):
        graphs = []

        def __call__(self, graph):
            UserPass.graphs.append(graph)

        def uuid(self):
            return user_uuid

    graph = torch.fx.Graph()
    graph.output(())
    with config.patch(post_grad_custom_post_pass=UserPass()):
        ours = inductor_patches(None, BackendOptions.parse({}))["post_grad_custom_post_pass"]
    ours(graph)
    assert UserPass.graphs == [graph]
    assert (ours.uuid() is None) == (user_uuid is None)
    assert user_uuid is None or b"user" in ours.uuid()


def test_cpp_wrapper_gives_way_to_the_python_wrapper_where_launches_are_traced(use_steps):
    """Inductor's C++ wrapper gives a traced launch one program's Triton global scratch
    (on the H200: an illegal memory access in our TMA GEMMs; docs/decisions.md, "Host time"). A user who set it gets
    the Python wrapper for the graphs whose sites are traced as launches, with a warning
    saying why; graphs without such sites, and trace_launches=False, keep the user's
    setting. The rewritten graph is Dynamo's, with a site on a target that inlines."""
    import copy
    import warnings

    from torch._inductor import config

    from nvfp4_inductor import lowerings
    from nvfp4_inductor.compiler.backend import CPP_WRAPPER_REFUSED, inductor_patches, rewrite_graph, traces_launches
    from nvfp4_inductor.compiler.options import BackendOptions

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    mlp = nv.GroupedMLP(2, 32, 16, "srelu")
    x, sizes = torch.randn(32, 32, dtype=torch.bfloat16), torch.tensor([20, 12])
    torch._dynamo.reset()
    torch.compile(mlp, backend=keep)(x, sizes)
    plain, inlined = graphs[0], copy.deepcopy(graphs[0])
    rewrite_graph(plain, BackendOptions())  # the reference target on the CPU: one opaque call
    use_steps(lowerings.get_target("reference").steps(), inline=True)
    rewrite_graph(inlined, BackendOptions())
    assert not traces_launches(plain, BackendOptions())
    assert traces_launches(inlined, BackendOptions())
    assert not traces_launches(inlined, BackendOptions(trace_launches=False))

    with config.patch(cpp_wrapper=True):
        with pytest.warns(UserWarning, match="cpp_wrapper is set") as caught:
            patches = inductor_patches(None, BackendOptions(), traced=True)
        assert patches["cpp_wrapper"] is False and str(caught[0].message) == CPP_WRAPPER_REFUSED
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert "cpp_wrapper" not in inductor_patches(None, BackendOptions(), traced=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "cpp_wrapper" not in inductor_patches(None, BackendOptions(), traced=True)


def test_compiled_autograd_changes_no_bit():
    """``torch._dynamo.config.compiled_autograd`` (a torchtitan option): Dynamo captures the
    backward, the fused backward ops and their seed draw included, and the backend compiles
    that graph too; every gradient equals the plain compiled backward's, bit for bit, SR on."""
    from torch._dynamo.utils import counters

    from moe_models import TitanMoE030

    grads = []
    for captured in (False, True):
        torch.manual_seed(0)
        model = TitanMoE030(torch.bfloat16)
        x = model.inputs(0)[0].requires_grad_()
        torch._dynamo.reset()
        counters.clear()
        backend = nv.backend(compiler="aot_eager")
        y = torch.compile(model, backend=backend)(x)
        torch.manual_seed(1)  # the backward's stochastic-rounding seeds
        with torch._dynamo.config.patch(compiled_autograd=captured):
            torch.compile(lambda: y.float().square().mean().backward(), backend=backend)()
        assert counters["nvfp4"]["sites_rewritten"] == 1
        assert counters["compiled_autograd"]["captures"] == int(captured)
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    for i, (plain, captured) in enumerate(zip(*grads, strict=True)):
        assert_bytes_equal(captured, plain, f"compiled autograd, gradient {i}")


def _graph_with(device: str, launch: bool) -> torch.fx.Graph:
    """A post-grad graph: one placeholder on `device` (a fake tensor, as Inductor's), and a
    traced launch of a Triton kernel or a plain op."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(4, device=device)
    graph.call_function(triton_kernel_wrapper_mutation if launch else torch.ops.aten.relu.default, (x,))
    graph.output(())
    return graph


@pytest.mark.parametrize("device, launch, waits", [("cuda", True, True), ("cpu", True, False), ("cuda", False, False)])
def test_a_gpu_graph_with_our_launches_waits_for_the_compile_workers(monkeypatch, device, launch, waits):
    """Before Inductor generates the code of a graph that launches our kernels on a GPU, the
    post-grad pass waits for Inductor's compile workers (else our kernels compile in this
    process one after another); graphs on the CPU or without launches never wait."""
    from nvfp4_inductor.compiler import backend
    from nvfp4_inductor.compiler.options import BackendOptions

    waited = []
    monkeypatch.setattr(backend, "wait_for_compile_workers", lambda: waited.append(1))
    backend.inductor_patches(None, BackendOptions.parse({}))["post_grad_custom_post_pass"](_graph_with(device, launch))
    assert waited == ([1] if waits else [])


def test_a_pool_that_does_not_start_leaves_the_compile_in_this_process(monkeypatch, caplog):
    from torch._inductor.async_compile import AsyncCompile

    from nvfp4_inductor.compiler import backend

    def times_out(timeout=120):
        raise TimeoutError("no worker answered")

    monkeypatch.setattr(AsyncCompile, "wait_pool_ready", staticmethod(times_out))
    with caplog.at_level("INFO", logger="nvfp4_inductor"):
        backend.wait_for_compile_workers()
    assert "compile workers did not start (no worker answered)" in caplog.text


def test_the_compile_workers_start_with_static_launch_of_our_kernels(monkeypatch):
    """Each worker decides, from the environment it starts with, whether a user-written kernel
    is launched by Inductor's static launcher (no C launcher built with gcc in this process);
    this process gets the same setting through the compile's config patches, and its own
    environment is left as it was."""
    from torch._inductor import async_compile, config

    from nvfp4_inductor.compiler import backend
    from nvfp4_inductor.compiler.options import BackendOptions

    seen = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: seen.append(os.environ.get(backend.STATIC_LAUNCH_ENV)))
    monkeypatch.delenv(backend.STATIC_LAUNCH_ENV, raising=False)
    backend.start_compile_workers()
    assert seen == ["1"] and backend.STATIC_LAUNCH_ENV not in os.environ
    monkeypatch.setenv(backend.STATIC_LAUNCH_ENV, "0")
    backend.start_compile_workers()
    assert seen == ["1", "1"] and os.environ[backend.STATIC_LAUNCH_ENV] == "0"
    patches = backend.inductor_patches(None, BackendOptions.parse({}))
    assert patches["static_launch_user_defined_triton_kernels"] is True
    with config.patch(patches):  # a setting of this torch's Inductor
        assert config.static_launch_user_defined_triton_kernels


@pytest.mark.parametrize("device, compiler, starts", [("cuda", "inductor", True), ("cpu", "inductor", False),
                                                      ("cuda", "aot_eager", False)])
def test_the_compile_workers_start_when_a_gpu_graph_reaches_inductor(monkeypatch, device, compiler, starts):
    """As the stock "inductor" backend does when Dynamo first calls it; never for graphs on the
    CPU or compiled without Inductor."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nvfp4_inductor.compiler import backend
    from nvfp4_inductor.compiler.options import BackendOptions

    started = []
    monkeypatch.setattr(backend, "start_compile_workers", lambda: started.append(1))
    monkeypatch.setattr(backend, "rewrite_graph", lambda gm, options: None)
    monkeypatch.setattr(backend, "warn_rejections", lambda record: None)
    monkeypatch.setattr(backend, "compile_rewritten", lambda gm, inputs, options, mode=None: "compiled")
    with FakeTensorMode():
        inputs = [torch.empty(4, device=device)]
    assert backend.compile_graph(None, inputs, BackendOptions.parse({"compiler": compiler})) == "compiled"
    assert started == ([1] if starts else [])
