"""What torch.compile sees of our kernels when it traces their launches (lowerings/inline.py).

Traced, a launch's written tensors are not declared: torch finds them by analysing the
kernel's IR (``identify_accessed_tensors``), and copies every tensor it counts as written
that is still read later -- a weight it counts as written is copied before the launch
and copied back after it (a mutated graph input, which also stops CUDA graphs). The
analysis follows store addresses back through helper calls, so a kernel that builds a
store address from a helper that was also passed an input pointer gets that input
counted (``_nvfp4.load_token``). This test runs torch's analysis on every launch of a
fused training step (the Triton plan, both activations, recompute on and off, probs and
none) and checks that no kernel input is counted as written.

The analysis needs Triton's compiler, not its interpreter, so it runs in a child process
without TRITON_INTERPRET, with a stand-in driver that names an SM90 target (only the
front end runs: Python -> TTIR, no GPU code).
"""

import importlib
import os
import pickle
import pkgutil
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import torch

from nvfp4_inductor import lowerings
from nvfp4_inductor.kernels import _registry
from nvfp4_inductor.lowerings.inline import target_op


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ANALYSE = textwrap.dedent("""
    import importlib, json, pickle, sys
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class SM90:  # the front end asks the active driver for its target; nothing else runs
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(SM90())
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    out = []
    for module, name, meta in pickle.load(open(sys.argv[1], "rb")):
        kernel = getattr(importlib.import_module(module), name)
        kwargs = {k: torch.empty(v[1], dtype=v[2]) if isinstance(v, tuple) and v[:1] == ("T",) else v
                  for k, v in meta.items() if k not in ("num_warps", "num_stages", "maxnreg")}
        writes = identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes
        out.append(sorted(dep.name for dep in writes))
    print(json.dumps(out))
""")


def _capture_launches():
    """(module, kernel, {kwarg: ("T", shape, dtype) | value}, inputs) of each distinct launch
    of a fused step; inputs: the tensor kwargs that are views of the kernel op's arguments."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from host_overhead import fused_step, triton_here

    import nvfp4_inductor.kernels as kernels

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

    patched = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        if hasattr(module, "launch"):
            patched.append((module, module.launch))
            module.launch = record
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
        for module, launch in patched:
            module.launch = launch
    return list(seen.values())


@pytest.mark.skipif(not _registry.INTERPRET, reason="captures launches through the interpreter")
def test_no_kernel_input_counts_as_written_when_traced(tmp_path):
    launches = _capture_launches()
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
    writes = __import__("json").loads(run.stdout.strip().splitlines()[-1])
    wrong = [f"{name}: {sorted(set(w) & set(inputs))} (inputs {inputs})"
             for (_, name, _, inputs), w in zip(launches, writes) if set(w) & set(inputs)]
    assert not wrong, "inputs counted as written:\n" + "\n".join(wrong)
    assert all(writes), "a launch with no written tensor: the analysis found nothing"


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

    assert not lowerings.inline.inlines(None, "cpu")  # the CPU's default target: the reference
    inlined = use_steps(STEPS, inline=True).name
    assert lowerings.inline.inlines(inlined, "cpu") and not lowerings.inline.inlines("reference", "cpu")
    assert "nvfp4_test.twice.default" not in _forward_graph(inlined)
    assert "aten.mul.Tensor" in _forward_graph(inlined)
    assert "nvfp4_test.twice.default" in _forward_graph("reference")
    with lowerings.inline.launches_traced(False):  # the backend's trace_launches=False
        assert "nvfp4_test.twice.default" in _forward_graph(inlined)


def test_trace_launches_option_is_checked_and_reaches_the_compile():
    from nvfp4_inductor.compiler.options import BackendOptions

    with pytest.raises(ValueError, match="option 'trace_launches' must be a bool"):
        BackendOptions.parse({"trace_launches": "no"})
    assert BackendOptions.parse({}).trace_launches and not BackendOptions.parse({"trace_launches": False}).trace_launches
