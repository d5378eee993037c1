"""What tests/test_early_compile.py checks, run in a child process without the Triton
interpreter: benchmarks/kernel_compile_time.py's stand-in H100 (Triton's driver names
sm_90, torch.cuda answers as an H100) becomes Triton's active driver, which the test
process must not get.

    python tests/early_compile_scenarios.py ACTIVATION OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import Future
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
from torch._inductor.runtime.hints import DeviceProperties  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import grouped_mlp as gm  # noqa: E402
import kernel_compile_time as kct  # noqa: E402
from nvfp4_inductor.compiler import early_compile, fused  # noqa: E402
from nvfp4_inductor.compiler.options import BackendOptions  # noqa: E402
from nvfp4_inductor.lowerings.policy import SiteSpec, choose_plan  # noqa: E402
from nvfp4_inductor.target_ops import launches_traced  # noqa: E402

H100 = DeviceProperties(type="cuda", index=0, multi_processor_count=132, cc=90, major=9,
                        regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                        max_threads_per_block=1024, warp_size=32)


def site_graph(shape: str, activation: str, layers: int) -> torch.fx.GraphModule:
    """A rewritten graph of `layers` sites of one shape, as the backend hands it to
    ``early_compile.start``: placeholders with fake CUDA example values, each site a
    ``fused_grouped_mlp`` call with the backend's default options."""
    experts, tokens, hidden, ffn, _ = gm.SHAPES[shape]
    f1 = 2 * ffn if activation == "swiglu" else ffn
    backend = BackendOptions()
    plan = choose_plan(SiteSpec.on("cuda", activation, dtype=torch.bfloat16, hidden=hidden, ffn=ffn), backend.recipe)
    options = dict(activation=activation, tanh_clamp_scale=None,
                   **fused.site_options(backend.recipe, plan.recomputes_d(backend.recompute), plan))
    bf16 = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graph = torch.fx.Graph()
    with FakeTensorMode():
        x = torch.empty(tokens, hidden, **bf16)
        sizes = torch.empty(experts, device="cuda", dtype=torch.int64)
        probs = torch.empty(tokens, device="cuda", requires_grad=True)
        nodes = {}
        for name, value in dict(x=x, sizes=sizes, probs=probs).items():
            nodes[name] = graph.placeholder(name)
            nodes[name].meta["val"] = value
        out = nodes["x"]
        for layer in range(layers):
            w1, w2 = graph.placeholder(f"w1_{layer}"), graph.placeholder(f"w2_{layer}")
            w1.meta["val"] = torch.empty(experts, f1, hidden, **bf16)
            w2.meta["val"] = torch.empty(experts, hidden, ffn, **bf16)
            out = graph.call_function(fused.fused_grouped_mlp, (out, w1, w2, nodes["sizes"], nodes["probs"]), options)
            out.meta["val"] = x
    graph.output(out)
    return torch.fx.GraphModule({}, graph)


def cubins() -> set[str]:
    """The binaries in Triton's cache."""
    root = os.environ["TRITON_CACHE_DIR"]
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".cubin")}


def launch_spec(phase: str, kernel, args: dict, options: dict) -> list:
    """A launch as Triton specialises it: phase, kernel, launch options, and each
    argument's dtype and alignment (a tensor) or value."""
    spec = {name: [str(v.dtype), v.aligned] if isinstance(v, kct.TensorArg) else repr(v) for name, v in args.items()}
    return [phase, kernel.__name__, sorted(options.items()), sorted(spec.items())]


def main(activation: str, out: str) -> None:
    result = {}
    with kct.stand_in_h100(132, 90), mock.patch.object(DeviceProperties, "create", return_value=H100), \
            launches_traced(True):
        # what AOTAutograd's traces of the fused ops launch, against what the bodies name untraced
        traced, _ = kct.record_launches("tiny", activation)
        phase = {"fw": early_compile.FORWARD, "bw": early_compile.BACKWARD}
        result["traced"] = sorted(launch_spec(phase[t.phase], t.kernel, t.args, t.options) for t in traced)
        result["variants"] = len(kct.variants_of(traced))  # the binaries Triton's own binder tells apart
        gm_ = site_graph("tiny", activation, layers=2)
        node = next(iter(gm_.graph.find_nodes(op="call_function", target=fused.fused_grouped_mlp)))
        recorded = []
        for launch in early_compile.site_launches(node, grad=True):
            kernel, options = launch.kernel, {}
            if hasattr(kernel, "configs"):  # the one-config Autotuner holding the launch options
                (config,) = kernel.configs
                options = {k: getattr(config, k) for k in kct.SPECIAL_OPTIONS if getattr(config, k, None)}
                kernel = kernel.fn
            args = {name: kct.TensorArg(v.dtype, v.storage_offset() * v.element_size() % 16 == 0)
                    if isinstance(v, torch.Tensor) else v
                    for name, v in launch.kwargs.items() if name not in kct.SPECIAL_OPTIONS}
            recorded.append(launch_spec(launch.phase, kernel, {n: args[n] for n in kernel.arg_names}, options))
        result["recorded"] = sorted(recorded)

        # start(): each distinct source submitted once, the marker left, nothing submitted again
        submitted = []

        def submit(name, source):
            submitted.append((name, source))
            done = Future()
            done.set_result(None)
            return done

        from torch._inductor.async_compile import AsyncCompile

        workers_up = Future()
        workers_up.set_result(0)
        from torch._inductor.runtime import compile_tasks

        events = []  # the workers' ptxas is set before Inductor's code generation first asks for its version
        set_ptxas, source_of = compile_tasks._set_triton_ptxas_path, early_compile.inductor_source
        with mock.patch.object(early_compile, "_submit", submit), mock.patch.object(AsyncCompile, "process_pool"), \
                mock.patch.object(AsyncCompile, "use_process_pool", return_value=True), \
                mock.patch.object(early_compile, "_pool_up", return_value=workers_up), \
                mock.patch.object(compile_tasks, "_set_triton_ptxas_path",
                                  lambda: events.append("ptxas") or set_ptxas()), \
                mock.patch.object(early_compile, "inductor_source",
                                  lambda *a: events.append("source") or source_of(*a)):
            result["started"] = early_compile.start(gm_, torch.device("cuda"), grad=True)
            for thread in threading.enumerate():
                if thread.name == "nvfp4-early-compile":
                    thread.join()
            with early_compile.compiling(early_compile.FORWARD):
                early_compile.wait()
            result["pending_after_forward"] = {p: len(jobs) for p, jobs in early_compile._pending.items()}
            early_compile.wait()
            early_compile._submitted.clear()  # a new process: only the marker in Triton's cache is left
            result["started_again"] = early_compile.start(gm_, torch.device("cuda"), grad=True)
        result["first_events"] = events[:2]
        result["submitted"] = [name for name, _ in submitted]
        forward = {early_compile.inductor_source(launch, torch.device("cuda"))[1]
                   for launch in early_compile.site_launches(node, grad=True) if launch.phase == early_compile.FORWARD}
        result["submitted_forward"] = [source in forward for _, source in submitted]
        result["distinct_sources"] = len({source for _, source in submitted})
        name, source = submitted[0]
        result["first_source"] = source
        result["kernel_src"] = next(t.kernel.src for t in traced if t.kernel.__name__ == name)

        # compiled in this process while the workers start (they never do here): the three
        # smallest sources, on two threads; then Inductor's own load of each finds its binary
        from torch._inductor.async_compile import _load_triton_kernel_from_source
        from torch._inductor.runtime import triton_helpers

        smallest = sorted(set(submitted), key=lambda job: len(job[1]))[:3]
        jobs = [early_compile._Job(name, source) for name, source in smallest]
        with mock.patch.object(triton_helpers, "set_driver_to_gpu", lambda: None):  # the stand-in is Triton's driver
            threading.Thread(target=early_compile._compile_all, args=(jobs, "0" * 64, Future(), 2), daemon=True).start()
            for job in jobs:
                job.here.exception(timeout=300)
            binaries = cubins()
            for name, source in smallest:
                _load_triton_kernel_from_source(name, source).precompile(warm_cache_only=True)
        result["here"] = dict(done=[job.here.exception() is None for job in jobs], binaries=len(binaries),
                              binaries_after_inductor=len(cubins()), in_workers=[job.workers.done() for job in jobs])
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
