"""What torch.compile sees of our kernels when it traces their launches (target_ops.py).

Traced, a launch's written tensors are not declared: torch finds them by analysing the
kernel's IR (``identify_accessed_tensors``; ``identify_mutated_tensors`` before 2.13),
and copies every tensor it counts as written that is still read later -- a weight it
counts as written is copied before the launch and copied back after it (a mutated graph
input, which also stops CUDA graphs). The
analysis follows store addresses back through helper calls, so a kernel that builds a
store address from a helper that was also passed an input pointer gets that input
counted (``_nvfp4.load_token``). This test runs torch's analysis on every launch of a
fused training step (the Triton plan, both activations, recompute on and off, probs and
none) and checks that no kernel input is counted as written, and (torch >= 2.13, whose
analysis also reports reads) that every tensor a launch passes is one its kernel touches.

The analysis needs Triton's compiler, not its interpreter, so it runs in a child process
without TRITON_INTERPRET, with a stand-in driver that names an SM90 target (only the
front end runs: Python -> TTIR, no GPU code).
"""

import os
import pickle
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import torch

from nvfp4_inductor import lowerings, target_ops
from nvfp4_inductor.kernels import _registry
from nvfp4_inductor.target_ops import target_op


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child processes' first lines: Triton's front end asks the active driver for its
# target; this stand-in names SM90 and nothing else runs (no GPU code is generated).
SM90_DRIVER = textwrap.dedent("""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class SM90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(SM90())
""")

ANALYSE = SM90_DRIVER + textwrap.dedent("""
    import importlib, json, pickle, sys
    from torch._higher_order_ops import triton_kernel_wrap

    def accessed(kernel, kwargs):  # torch >= 2.13: (written, read) names; before: (written, None)
        if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
            rw = triton_kernel_wrap.identify_accessed_tensors(kernel, kwargs, {}).read_writes
            return sorted(dep.name for dep in rw.writes), sorted(dep.name for dep in rw.reads)
        return sorted(triton_kernel_wrap.identify_mutated_tensors(kernel, kwargs, {})), None

    out = []
    for module, name, meta in pickle.load(open(sys.argv[1], "rb")):
        kernel = getattr(importlib.import_module(module), name)
        kwargs = {k: torch.empty(v[1], dtype=v[2]) if isinstance(v, tuple) and v[:1] == ("T",) else v
                  for k, v in meta.items() if k not in ("num_warps", "num_stages", "maxnreg")}
        out.append(accessed(kernel, kwargs))
    print(json.dumps(out))
""")


def _capture_launches(replace_launches):
    """(module, kernel, {kwarg: ("T", shape, dtype) | value}, inputs) of each distinct launch
    of a fused step; inputs: the tensor kwargs that are views of the kernel op's arguments.
    `replace_launches`: the conftest fixture, which restores the launches after the test."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from host_overhead import fused_step, triton_here

    op_args: list[set] = []
    seen = {}

    def record(kernel, grid, **kwargs):
        args = set().union(*op_args) if op_args else set()
        meta = {k: ("T", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        inputs = sorted(k for k, v in kwargs.items()
                        if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in args)
        module = getattr(kernel, "fn", kernel).__module__
        key = (module, kernel.__name__, tuple(inputs),
               tuple((k, v) for k, v in meta.items() if not isinstance(v, tuple)))
        seen.setdefault(key, (module, kernel.__name__, meta, inputs))

    body_call = _registry.KernelOp.__call__

    def tracked(self, *args, **kwargs):  # a kernel op's arguments are its launches' inputs
        op_args.append({a.untyped_storage().data_ptr() for a in list(args) + list(kwargs.values())
                        if isinstance(a, torch.Tensor) and a.numel()})
        try:
            return body_call(self, *args, **kwargs)
        finally:
            op_args.pop()

    replace_launches(lambda launch: record)
    _registry.KernelOp.__call__ = tracked
    registered = "triton_here" in [t.name for t in lowerings.targets()]
    try:
        target = triton_here()  # registers, for every device, a target running the Triton steps
        g, t, h, f = 4, 128, 64, 32
        sizes = torch.tensor([40, 0, 50, 38])
        for activation in ("srelu", "swiglu"):
            f1 = 2 * f if activation == "swiglu" else f
            x, dy = torch.randn(t, h).bfloat16(), torch.randn(t, h).bfloat16()
            w1, w2 = torch.randn(g, f1, h).bfloat16(), torch.randn(g, h, f).bfloat16()
            for recompute in (True, False):
                for probs in (torch.rand(t), None):
                    fused_step(x, w1, w2, sizes, probs, dy, activation, None, recompute, target)
    finally:
        if not registered:  # later tests choose their targets from the registry
            lowerings.unregister_target("triton_here")
        _registry.KernelOp.__call__ = body_call
    return list(seen.values())


@pytest.mark.skipif(not _registry.INTERPRET, reason="captures launches through the interpreter")
def test_no_kernel_input_counts_as_written_when_traced(tmp_path, replace_launches):
    launches = _capture_launches(replace_launches)
    assert {name for _, name, _, _ in launches} >= {
        "_group_cast_kernel", "_group_amax_kernel", "_dequantize_kernel", "_grouped_gemm_bf16_kernel",
        "_grouped_gemm_wgrad_bf16_kernel", "_grouped_gemm_act_kernel", "_grouped_gemm_dact_kernel"}
    path = tmp_path / "launches.pkl"
    path.write_bytes(pickle.dumps([(m, n, meta) for m, n, meta, _ in launches]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, "-c", ANALYSE, str(path)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    accesses = __import__("json").loads(run.stdout.strip().splitlines()[-1])
    writes = [w for w, _ in accesses]
    wrong = [f"{name}: {sorted(set(w) & set(inputs))} (inputs {inputs})"
             for (_, name, _, inputs), w in zip(launches, writes) if set(w) & set(inputs)]
    assert not wrong, "inputs counted as written:\n" + "\n".join(wrong)
    # every tensor a launch passes is one its kernel reads or writes: a pointer the kernel
    # does not use is None (kernels/_registry.launch), not a placeholder tensor that the
    # launcher reads a data pointer from and Inductor's generated call names as an operand
    if all(reads is not None for _, reads in accesses):  # torch >= 2.13 reports reads
        unused = []
        for (_, name, meta, _), (w, r) in zip(launches, accesses):
            untouched = {k for k, v in meta.items() if isinstance(v, tuple) and v[:1] == ("T",)} - set(w) - set(r)
            if untouched:
                unused.append(f"{name}: {sorted(untouched)}")
        assert not unused, "tensors passed that the kernel never touches:\n" + "\n".join(unused)
    assert all(writes), "a launch with no written tensor: the analysis found nothing"
    # the column-wise copy is stored through a pointer the kernel casts (uint8 -> uint64):
    # the analysis must still see that store, or Inductor could read the copy before it is written
    columnwise = [w for (_, name, meta, _), w in zip(launches, writes)
                  if name == "_group_cast_kernel" and meta["COLUMNWISE"]]
    assert columnwise and all("col_data_ptr" in w for w in columnwise), columnwise


@target_op("nvfp4_test::twice")
def _twice(x: torch.Tensor, target: Optional[str] = None) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x, target=None):
    return torch.empty_like(x)


def _forward_graph(target):
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: _twice(x, target) + 1, backend=aot_autograd(fw_compiler=keep))(torch.ones(4))
    return [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]


def test_target_op_becomes_its_body_only_where_its_target_inlines(use_steps):
    """Traced by AOTAutograd, a ``target_op`` is its body where ``Target.inline()`` says so
    (the Triton kernels on a GPU; here a test target) and one opaque op elsewhere (the
    reference, whose torch arithmetic Inductor would re-generate). Its own value is kept."""
    from nvfp4_inductor.lowerings.reference import STEPS

    assert not target_ops.inlines(None, "cpu")  # the CPU's default target: the reference
    inlined = use_steps(STEPS, inline=True).name
    assert target_ops.inlines(inlined, "cpu") and not target_ops.inlines("reference", "cpu")
    assert "nvfp4_test.twice.default" not in _forward_graph(inlined)
    assert "aten.mul.Tensor" in _forward_graph(inlined)
    assert "nvfp4_test.twice.default" in _forward_graph("reference")
    with target_ops.launches_traced(False):  # the backend's trace_launches=False
        assert "nvfp4_test.twice.default" in _forward_graph(inlined)


def test_trace_launches_option_is_checked_and_reaches_the_compile():
    from nvfp4_inductor.compiler.options import BackendOptions

    with pytest.raises(ValueError, match="option 'trace_launches' must be a bool"):
        BackendOptions.parse({"trace_launches": "no"})
    assert BackendOptions.parse({}).trace_launches and not BackendOptions.parse({"trace_launches": False}).trace_launches


# ---------------------------------------------------------------------------------------
# The traced path as AOTAutograd traces it on a GPU, on this CPU (no kernel runs)
#
# On the CI the kernels run in Triton's interpreter, whose launches cannot be traced, so
# the path a GPU compile takes (target_ops.py: a fused op on the Triton target
# becomes its body, each kernel launch a ``triton_kernel_wrapper_functional`` node) never
# runs here. A child process without TRITON_INTERPRET traces it instead: FakeTensors on
# device "cuda" (a CPU-only torch lets fake tensors claim a CUDA device), the SM90 stand-in
# driver of ANALYSE (torch's functionalization of each launch runs Triton's front end to
# find the written tensors), and AOTAutograd's own tracing (``aot_function``, whose
# FunctionalTensorMode fires the rule), with static and with symbolic token counts.
#
# Not one joint forward+backward trace: autograd cannot record a node on a CUDA tensor in
# a CPU-only torch, fake or not (c10's InputMetadata asks the CUDA device guard for a
# stream: "PyTorch is not linked with support for cuda devices", which aborts the
# process). So the forward op and the backward ops are traced as two AOTAutograd graphs,
# the backward's inputs being the forward's outputs -- the ops and arguments the joint
# graph holds (fused.py: the forward op returns exactly what the backward saves, and its
# autograd formula calls ``grouped_mlp_bwd``).

TRACE = SM90_DRIVER + textwrap.dedent("""
    import json, sys
    from unittest import mock

    from torch._functorch.aot_autograd import aot_function
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, free_symbols
    from torch._dynamo.source import ConstantSource

    import dataclasses

    from nvfp4_inductor.compiler import fused
    from nvfp4_inductor.constants import RHT_DEFAULT_SIGN_MASK
    from nvfp4_inductor.kernels import _registry, api, config
    from nvfp4_inductor.kernels.config import Bf16GemmConfig
    from nvfp4_inductor.lowerings import Plan
    from nvfp4_inductor.target_ops import launches_traced
    from nvfp4_inductor.program import SiteOptions
    from nvfp4_inductor.recipe import Recipe
    from nvfp4_inductor.saved import SavedForBackward

    assert not _registry.INTERPRET, "the child must run Triton's compiler front end, not its interpreter"
    mode_name, out_path = sys.argv[1], sys.argv[2]
    symbolic = mode_name in ("symbolic", "unbacked")
    G, T, H, F = 4, 128, 64, 32
    FW_INPUTS = ["x", "w1", "w2", "group_sizes", "probs"]
    BW_INPUTS = ["dy", "probs", "group_sizes", *SavedForBackward._fields]

    class Traced(Exception):
        pass

    def root(node):
        # the tensor a view (reshape, dtype view, detach, ...) was taken of
        while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
            node = node.args[0]
        return node

    def summarize(gm, input_names):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = dict(zip(placeholders, input_names))
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        out = dict(targets=sorted({str(n.target) for n in calls}), kernels=[], cloned_inputs=[], copied_inputs=[],
                   seeds=[], symbolic_constexprs=[], shared_codes=0, aliased_outputs=[],
                   token_dim=str(placeholders[0].meta["val"].shape[0]))
        for n in calls:
            if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
                kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
                kernel = getattr(kernel, "fn", kernel)  # (an autotuner's JIT function)
                out["kernels"].append(kernel.__name__)
                kwargs = n.kwargs["kwargs"]
                out["shared_codes"] += kwargs.get("SHARED_CODES") is True
                # what Inductor copies before the launch: a graph input here is a copy
                # of the input per step (and, written back, a mutated input)
                for name in n.kwargs["tensors_to_clone"]:
                    if root(kwargs[name]) in names:
                        out["cloned_inputs"].append([kernel.__name__, name, names[root(kwargs[name])]])
                # one tensor as two written arguments: Inductor copies it for one of them
                written = [root(kwargs[name]) for name in n.kwargs["tensors_to_clone"]]
                if len(set(written)) < len(written):
                    out["aliased_outputs"].append([kernel.__name__, sorted(n.kwargs["tensors_to_clone"])])
                constexprs = {p.name for p in kernel.params if p.is_constexpr}
                for name, value in kwargs.items():
                    value = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
                    if name in constexprs and isinstance(value, torch.SymInt) and free_symbols(value):
                        out["symbolic_constexprs"].append([kernel.__name__, name, str(value)])
            elif "clone" in str(n.target) or "copy" in str(n.target):
                if n.args and isinstance(n.args[0], torch.fx.Node) and root(n.args[0]) in names:
                    out["copied_inputs"].append([str(n.target), names[root(n.args[0])]])
            elif n.target is torch.ops.nvfp4.draw_sr_seeds.default:
                after = root(n.args[0])
                out["seeds"].append([names.get(after, after.name), n.args[1]])
        return out

    # Device queries the op bodies make on "cuda", answered as an H200 (SM90) would:
    props = mock.Mock(multi_processor_count=132)
    # 32-column GEMM tiles and slices: fc1's dgrad copies W1 (64 rows an expert) in two slices
    # of 32 rows (sizes.copy_slices), so those launches are checked too. (The override is
    # kept in a name: collected, it would unpin.)
    pinned = config.override(fprop=Bf16GemmConfig(128, 32, 64, 8, 3, min_slice_rows=32))
    pinned.__enter__()
    patches = [
        # kernels/gemm_common.num_programs: persistent GEMMs launch one program per SM
        mock.patch("torch.cuda.get_device_properties", return_value=props),
        # kernels/api._check_input: the kernels run on CUDA tensors where torch has CUDA.
        # (Patching torch.cuda.is_available instead would make AOTAutograd save and
        # restore the CUDA RNG state, which a CPU-only torch cannot.)
        mock.patch.object(api, "available", lambda device: torch.device(device).type == "cuda"),
    ]
    for p in patches:
        p.start()

    results, guards, token_symbolic = {}, [], []
    for activation in ("srelu", "swiglu"):
        for recompute in (True, False):
            shape_env = ShapeEnv() if symbolic else None
            fake = FakeTensorMode(shape_env=shape_env)
            graphs = {}

            def trace(name, fn, *args):
                # AOTAutograd's trace of fn(*args) into graphs[name]; nothing runs it (the
                # compiler stops there: a graph that mutated an input would fail to copy
                # the update back to a CUDA tensor here, hiding the check below)
                def compiler(gm, example_inputs):
                    graphs[name] = gm
                    raise Traced

                try:
                    aot_function(fn, fw_compiler=compiler, dynamic=symbolic)(*args)
                except Traced:
                    pass

            options = SiteOptions(activation, None, Recipe(sign_mask=RHT_DEFAULT_SIGN_MASK),
                                  Plan("triton", True, False, True, ""), recompute=recompute)

            def forward(x, w1, w2, sizes, probs):
                return fused.grouped_mlp_fwd(x, w1, w2, sizes, probs, **fused.schema_kwargs(options))

            def backward(dy, probs, sizes, *saved):
                return fused.grouped_mlp_bwd(dy, SavedForBackward.unflatten(saved), probs, sizes, options)

            with fake:
                tokens = T
                if mode_name == "symbolic":  # T as Dynamo makes a dynamic dimension: a backed symbol, hint T, range [2, inf)
                    source = ConstantSource("T")
                    symbol = shape_env.create_symbol(T, source=source, dynamic_dim=DimDynamic.DYNAMIC)
                    tokens = shape_env.create_symintnode(symbol, hint=T, source=source)
                elif mode_name == "unbacked":  # T counted on the device (expert parallelism's received rows)
                    tokens = shape_env.create_unbacked_symint()
                    symbol = tokens.node.expr
                    shape_env.pending_fresh_unbacked_symbols.clear()  # made here, not by a traced op
                bf16 = dict(device="cuda", dtype=torch.bfloat16)
                f1 = 2 * F if activation == "swiglu" else F
                x, dy = torch.empty(tokens, H, **bf16), torch.empty(tokens, H, **bf16)
                w1, w2 = torch.empty(G, f1, H, **bf16), torch.empty(G, H, F, **bf16)
                sizes = torch.empty(G, device="cuda", dtype=torch.int64)
                probs = torch.empty(tokens, device="cuda", dtype=torch.float32)
                trace("fw", forward, x, w1, w2, sizes, probs)
                # the backward's inputs: the forward op's outputs (its fake impl, called outside
                # AOTAutograd's trace), as the joint graph would save them
                trace("bw", backward, dy, probs, sizes, *forward(x, w1, w2, sizes, probs)[1:])
                if activation == "srelu" and recompute:  # control: kept whole, the op is seen
                    with launches_traced(False):
                        trace("untraced", forward, x, w1, w2, sizes, probs)
                    # the backend option reuse_weight_casts: the weights' casts one opaque op, keyed
                    # on the graph inputs the weights come from (here the weights themselves)
                    trace("reuse", lambda x, w1, w2, sizes, probs: fused.grouped_mlp_fwd(
                        x, w1, w2, sizes, probs, w1, None, w2, **fused.schema_kwargs(dataclasses.replace(
                            options, reuse_weight_casts=True, weight_derivation="fc1 = W; fc2 = W"))),
                        x, w1, w2, sizes, probs)
            key = f"{activation} recompute={recompute}"
            results[key] = {"fw": summarize(graphs["fw"], FW_INPUTS), "bw": summarize(graphs["bw"], BW_INPUTS)}
            for control in ("untraced", "reuse"):
                if control in graphs:
                    results[control] = summarize(graphs[control], FW_INPUTS)
            if symbolic:
                guards += [[key, str(g.expr), str(g.sloc)] for g in shape_env.guards]
                token_symbolic.append(bool(free_symbols(shape_env.replace(symbol))))
    json.dump(dict(graphs=results, guards=guards, token_symbolic=token_symbolic), open(out_path, "w"))
    pinned.__exit__(None, None, None)
""")

# Every kind of node a traced fused step may hold: torch ops, SymInt arithmetic on sizes
# (the builtins), kernel launches, and the one opaque op, the stochastic-rounding seeds.
_ALLOWED = ("aten.", "<built-in function ", "triton_kernel_wrapper_functional", "nvfp4.draw_sr_seeds.default")


def test_fused_step_traces_into_kernel_launches_on_a_gpu_target(tmp_path):
    """Traces a training step of the fused ops (Triton plan with every fused kernel, RHT,
    stochastic rounding, probs; both activations, recompute on and off) the way AOTAutograd
    does on a GPU, static and with a symbolic token count, and checks the graphs: (1) no
    fused or GEMM op left, only torch ops, launches and the seed op; (2) the cast, amax,
    dequantize and GEMM kernels launched; (3) the seeds drawn once in the backward, after dY;
    (4) no graph input copied for a launch, no tensor written as two arguments of one, no
    dtype view, the weights' casts encode once; (5) symbolic T
    stays symbolic (no guard pins it, no kernel constexpr takes it), with the same launches
    as the static trace; (6) a data-dependent T is traced the same way, without a guard."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    children = {mode: subprocess.Popen([sys.executable, "-c", TRACE, mode, str(tmp_path / f"{mode}.json")],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for mode in ("static", "symbolic", "unbacked")}  # in parallel: ~25 s each, most of it Triton's front end
    results = {}
    for mode, child in children.items():
        _, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, f"{mode} trace failed:\n{stderr[-4000:]}"
        results[mode] = __import__("json").loads((tmp_path / f"{mode}.json").read_text())

    # control: the same forward with launches_traced(False) holds the fused op, so the
    # checks below would see an op that the rule in target_ops.py failed to inline
    for mode, result in results.items():
        assert "nvfp4.grouped_mlp_fwd.default" in result["graphs"].pop("untraced")["targets"], mode
        # with reuse_weight_casts the weight stacks' casts are the eager op (run at every step,
        # it consults a reuse_weight_casts() block), their packed copies dequantized for the GEMMs
        reuse = result["graphs"].pop("reuse")
        assert "nvfp4.quantize_weights_from.default" in reuse["targets"] and reuse["shared_codes"] == 0, (mode, reuse)
        assert "_dequantize_kernel" in reuse["kernels"], (mode, reuse["kernels"])

    for mode, result in results.items():
        assert len(result["graphs"]) == 4, (mode, list(result["graphs"]))
        for config, graphs in result["graphs"].items():
            for name, graph in graphs.items():
                where = f"{mode}, {config}, {name}"
                # (1) every fused op and GEMM op traced as its body
                assert not [t for t in graph["targets"] if not t.startswith(_ALLOWED)], where
                # (4) no graph input cloned or copied for a kernel
                assert not graph["cloned_inputs"], f"{where}: inputs cloned for a launch: {graph['cloned_inputs']}"
                assert not graph["copied_inputs"], f"{where}: inputs copied: {graph['copied_inputs']}"
                assert not graph["aliased_outputs"], f"{where}: a tensor written as two arguments: {graph['aliased_outputs']}"
                # no dtype views: the kernels write and read E4M3 scales through byte pointers;
                # each view is a Python call of Inductor's wrapper (with its asserts) a step
                assert "aten.view.dtype" not in graph["targets"], where
            # (2) the launches of each step: casts, amaxes, dequantizations and GEMMs
            quantize = {"_group_amax_kernel", "_group_cast_kernel", "_dequantize_kernel"}
            fw, bw = set(graphs["fw"]["kernels"]), set(graphs["bw"]["kernels"])
            # (the forward's casts write its GEMMs' operands as deq() values: no dequantize there)
            assert fw >= quantize - {"_dequantize_kernel"} | {"_grouped_gemm_act_kernel", "_grouped_gemm_bf16_kernel"}, (
                mode, config, fw)
            assert "_dequantize_kernel" not in fw, (mode, config, fw)
            assert bw >= quantize | {"_grouped_gemm_dact_kernel", "_grouped_gemm_wgrad_bf16_kernel",
                                     "_grouped_gemm_bf16_kernel"}, (mode, config, bw)
            # the weight stacks' casts encode each element once for both copies (group_cast's
            # SHARED_CODES): their one amax is still one tensor once traced
            assert (graphs["fw"]["shared_codes"], graphs["bw"]["shared_codes"]) == (2, 0), (mode, config)
            # (3) dY's and dC's seeds: one opaque op in the backward, ordered after dY
            assert graphs["fw"]["seeds"] == [] and graphs["bw"]["seeds"] == [["dy", 2]], (mode, config)
        # our launches per step, as the opaque ops make them (test_kernels_epilogue pins those,
        # with W1 copied whole: two launches fewer): the traced graphs hold no more; the
        # host time of a compiled step grows with them. W1 in two slices: each slice a
        # dequantize and a GEMM launch, dC's copy made by the first slice's dequantize
        # (a data-dependent T copies W1 whole in fc1's dgrad, sizes.copy_slices: two fewer)
        recompute = result["graphs"]["swiglu recompute=True"]
        assert (len(recompute["fw"]["kernels"]), len(recompute["bw"]["kernels"])) == (
            (11, 17) if mode == "unbacked" else (11, 19)), mode

    # (5) symbolic T: still a symbol after tracing, in every graph; no guard equates it to
    # a value; no constexpr (a compile-time constant of the kernel) depends on it; and the
    # same launches, in the same order, as with static shapes. (The one guard T gets is
    # _seed_tensor's range check, SR blocks < 2**32, a real limit. The tile heuristics read
    # the traced example's size, sizes.size_hint, and guard nothing: before,
    # amax_config's split put a range guard at ~65.4k tokens, a recompile for a dynamic T
    # crossing it.)
    symbolic = results["symbolic"]
    assert all(symbolic["token_symbolic"]), symbolic["guards"]
    assert not [g for g in symbolic["guards"] if g[1].startswith("Eq(")], symbolic["guards"]
    assert not [g for g in symbolic["guards"] if "kernels/config.py" in g[2]], symbolic["guards"]
    for config, graphs in symbolic["graphs"].items():
        for name, graph in graphs.items():
            assert not graph["token_dim"].isdigit(), (config, name, graph["token_dim"])
            assert not graph["symbolic_constexprs"], (config, name, graph["symbolic_constexprs"])
            assert graph["kernels"] == results["static"]["graphs"][config][name]["kernels"], (config, name)

    # (6) a data-dependent T (an unbacked symbol: the rows a rank receives under expert
    # parallelism) is traced too: no guard at all (the empty-input exits and the SR range
    # check do not guard on it, sizes.is_zero, api._seed_tensor; the tiles take Inductor's
    # stand-in size, sizes.tile_hint), no constexpr takes it, and the static trace's
    # launches except fc1's dgrad slices (sizes.copy_slices: W1 copied whole)
    unbacked = results["unbacked"]
    assert all(unbacked["token_symbolic"]) and not unbacked["guards"], unbacked["guards"]
    for config, graphs in unbacked["graphs"].items():
        for name, graph in graphs.items():
            assert not graph["symbolic_constexprs"], (config, name, graph["symbolic_constexprs"])
            static = results["static"]["graphs"][config][name]["kernels"]
            assert set(graph["kernels"]) == set(static) and len(graph["kernels"]) <= len(static), (config, name)
