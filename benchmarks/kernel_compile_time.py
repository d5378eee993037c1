"""Question: where does a cold compile of our Triton kernels go: which kernel variants of one
compiled training step take longest to compile, in which of Triton's stages, and which
constexpr specialisation of the slowest ``_group_cast_kernel`` variants drives it?

Inductor compiles the traced launches of a step in its worker processes in parallel, so a
graph waits for its slowest kernel; and while AOTAutograd traces, torch's launch analysis
(compiler/launch_analysis.py) runs Triton's front end (Python -> TTIR) once per distinct
launch. This script records every launch of one compiled training step (forward and
backward) of one grouped-MLP layer at a shape of ``grouped_mlp.SHAPES`` on the triton
target WITHOUT running a kernel: AOTAutograd traces the fused forward op and the backward
ops (as the backend's compile does, ``fused.grouped_mlp_fwd`` / ``grouped_mlp_bwd`` with
the backend's default recipe, recompute on and the plan ``choose_plan`` gives) on fake CUDA
tensors, and each ``triton_kernel_wrapper_functional`` node of the two graphs is a launch.
Launches that Triton would compile to one binary (same kernel, constexprs, launch options
and argument specialisation: dtypes, None pointers, integers' divisibility by 16 and
value 1, as Triton's own binder computes them) are one variant.

Each variant is then compiled with ``triton.compile`` for a GPU target with a fresh Triton
cache (nothing is a cache hit) and every stage timed on its own:

  analysis s   torch's launch analysis of one launch of the variant (its front end plus
               its walk of the TTIR), what tracing pays per distinct launch
  front s      ``ASTSource.make_ir``: Python AST -> TTIR (in Triton's compile)
  ttir .. cubin  Triton's stages: TTIR passes, TTGIR (layouts, coalescing, pipelining),
               LLVM IR, PTX, ptxas
  total s      the whole ``triton.compile`` (stages plus cache writes)
  TTIR/PTX lines, regs, stack   the IR's size; registers and stack bytes a thread (spills)
               from ``cuobjdump -res-usage`` of the cubin

On a machine without CUDA the step is recorded as an H100 would record it: Triton's driver
is a stand-in naming sm_90 (``--arch``), and torch.cuda answers compute capability 9.0 and
``--sms`` multiprocessors (132: an H100 SXM; 114: PCIe) -- the SM count decides the
persistent GEMMs' NUM_PROGRAMS (a runtime value for Triton's specialisation: the binary is
the same for 132 and 114, both not multiples of 16) and nothing else in kernels/config.py;
the tile heuristics otherwise read only the tensors' sizes and the device type ("cuda"
for the fake tensors), so the variants are the H100's. On CUDA the device's own target,
capability and SM count are used (the tensors are still fake: nothing is launched).

``--investigate N`` (default 2) then takes the N slowest ``_group_cast_kernel`` variants and
compiles each again with one constexpr (or num_warps) changed to another value its
launcher could pick (kernels/config.py ``cast_config``, group_cast.py's launcher): BM, BK
(EVEN_K follows), K_BLOCKS, TOKEN_UNROLL (row-only 1D casts), num_warps, SR, RHT
(column-wise copies), ROW_DEQ (row-wise copies), SHARED_CODES (2D RNE row + column casts),
and prints each stage's change against the variant. Compile times only: whether an
alternative is as fast at run time needs a GPU.

    python benchmarks/kernel_compile_time.py [--shape S3] [--activation swiglu] [--sms 132]
        [--arch 90] [--only KERNEL ...] [--until cubin] [--investigate 2] [--json OUT]

``--until ttir`` stops every compile after that stage (the smoke test,
tests/test_benchmark_grouped_mlp_smoke.py, compiles the tiny shape's amax kernels to TTIR).
Run it without TRITON_INTERPRET: the interpreter cannot trace launches. Triton's own
``MLIR_ENABLE_TIMING=1`` additionally prints every MLIR pass's time (which TTGIR pass it is:
on the CPU, TritonGPUCoalesce took 1.5-3.0 s of the slow casts' 2-3.6 s TTGIR stage).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import grouped_mlp as gm  # noqa: E402
from nvfp4_inductor.inspection import format_table  # noqa: E402

STAGES = ["ttir", "ttgir", "llir", "ptx", "cubin"]
H100_SMS = 132
SPECIAL_OPTIONS = ("num_warps", "num_stages", "maxnreg")


# ---------------------------------------------------------------------------------------
# Recording the step's launches


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """A tensor argument as Triton specialises it: its dtype and whether its data pointer
    is 16-byte aligned (a view's storage offset can break it)."""
    dtype: torch.dtype
    aligned: bool


@dataclasses.dataclass
class Launch:
    phase: str  # "fw" or "bw"
    kernel: Any  # the JITFunction
    args: dict  # kernel argument -> TensorArg, int, float, bool or None
    options: dict  # num_warps, num_stages (maxnreg where set)


@contextlib.contextmanager
def stand_in_h100(sms: int, arch: int):
    """On a machine without CUDA: Triton's driver names a CUDA target of compute capability
    `arch` (nothing runs; the front end asks for the target), and torch.cuda answers as that
    GPU with `sms` multiprocessors; the kernels count as available on "cuda" tensors (what
    the plan's probe and the launchers' input checks ask). Patching torch.cuda.is_available
    instead would make AOTAutograd save the CUDA RNG state, which a CPU-only torch cannot."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    import nvfp4_inductor.kernels as kernels
    from nvfp4_inductor.kernels import api

    class StandIn:
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    on_cuda = lambda device: torch.device(device).type == "cuda"  # noqa: E731
    driver.set_active(StandIn())
    with mock.patch("torch.cuda.get_device_properties", return_value=mock.Mock(multi_processor_count=sms)), \
            mock.patch("torch.cuda.get_device_capability", return_value=(arch // 10, arch % 10)), \
            mock.patch.object(api, "available", on_cuda), mock.patch.object(kernels, "available", on_cuda):
        yield


class _Traced(Exception):
    pass


def _trace(fn, *args) -> torch.fx.GraphModule:
    """AOTAutograd's graph of fn(*args); nothing compiles or runs it."""
    from torch._functorch.aot_autograd import aot_function

    graphs = []

    def compiler(gm_, example_inputs):
        graphs.append(gm_)
        raise _Traced

    try:
        aot_function(fn, fw_compiler=compiler)(*args)
    except _Traced:
        pass
    return graphs[0]


def _launches_of(graph: torch.fx.GraphModule, phase: str) -> list[Launch]:
    """The traced launches of `graph`: torch keeps a launch's kernel (with its num_warps and
    num_stages as a one-config Autotuner) and constant arguments in its kernel side table."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.autotuner import Autotuner

    out = []
    for node in graph.graph.nodes:
        if node.target is not torch.ops.higher_order.triton_kernel_wrapper_functional:
            continue
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        args = dict(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
        args.update(node.kwargs["kwargs"])
        options = {}
        if isinstance(kernel, Autotuner):
            (config,) = kernel.configs
            args.update(config.kwargs)
            options = {name: getattr(config, name) for name in SPECIAL_OPTIONS if getattr(config, name, None)}
            kernel = kernel.fn
        options.update({name: args.pop(name) for name in SPECIAL_OPTIONS if name in args})
        for name, value in args.items():
            if isinstance(value, torch.fx.Node):
                value = value.meta["val"]
            if isinstance(value, torch.Tensor):
                value = TensorArg(value.dtype, value.storage_offset() * value.element_size() % 16 == 0)
            elif isinstance(value, torch.SymInt):
                raise ValueError(f"{kernel.__name__}: argument {name} is symbolic ({value}); record a static shape")
            args[name] = value
        out.append(Launch(phase, kernel, {name: args[name] for name in kernel.arg_names}, options))
    return out


def record_launches(shape: str, activation: str) -> tuple[list[Launch], str]:
    """Every launch of one training step (forward, then backward) of one grouped-MLP layer
    of `shape` on the triton target, on fake CUDA tensors; and the plan's description."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nvfp4_inductor.compiler import fused
    from nvfp4_inductor.compiler.launch_analysis import launches_analysed_once
    from nvfp4_inductor.compiler.options import BackendOptions
    from nvfp4_inductor.lowerings.policy import SiteSpec, choose_plan
    from nvfp4_inductor.program import SiteOptions
    from nvfp4_inductor.saved import SavedForBackward
    from nvfp4_inductor.target_ops import launches_traced

    experts, tokens, hidden, ffn, _ = gm.SHAPES[shape]
    f1 = 2 * ffn if activation == "swiglu" else ffn
    backend = BackendOptions()  # the backend's defaults: its recipe, recompute on
    plan = choose_plan(SiteSpec.on("cuda", activation, dtype=torch.bfloat16, hidden=hidden, ffn=ffn), backend.recipe)
    if plan.target != "triton":
        raise RuntimeError(f"the plan on this device is not the triton target's: {plan.reason}")
    opts = SiteOptions(activation, None, backend.recipe, plan, recompute=plan.recomputes_d(backend.recompute))

    def forward(x, w1, w2, sizes, probs):
        return fused.grouped_mlp_fwd(x, w1, w2, sizes, probs, **fused.schema_kwargs(opts))

    def backward(dy, probs, sizes, *saved):
        return fused.grouped_mlp_bwd(dy, SavedForBackward.unflatten(saved), probs, sizes, opts)

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    with FakeTensorMode(), launches_traced(True), launches_analysed_once():
        x, dy = torch.empty(tokens, hidden, **bf16), torch.empty(tokens, hidden, **bf16)
        w1, w2 = torch.empty(experts, f1, hidden, **bf16), torch.empty(experts, hidden, ffn, **bf16)
        sizes = torch.empty(experts, device="cuda", dtype=torch.int64)
        probs = torch.empty(tokens, device="cuda")
        fw = _trace(forward, x, w1, w2, sizes, probs)
        saved = forward(x, w1, w2, sizes, probs)[1:]  # the fake impl: what the backward receives
        bw = _trace(backward, dy, probs, sizes, *saved)
    return _launches_of(fw, "fw") + _launches_of(bw, "bw"), plan.reason


# ---------------------------------------------------------------------------------------
# Triton's specialisation of a launch, and a timed compile


def stand_in_args(launch: Launch) -> dict:
    """Real (small, CPU) tensors in place of the recorded ones, for Triton's binder and
    torch's analysis, which read dtypes and pointer alignment only."""
    out = {}
    for name, value in launch.args.items():
        if isinstance(value, TensorArg):
            tensor = torch.empty(64, dtype=value.dtype)
            value = tensor if value.aligned else tensor[1:]
        out[name] = value
    return out


def specialise(kernel, args: dict, options: dict):
    """(ASTSource, options) that Triton's own launch path builds for `kernel` on `args`:
    ``JITFunction.run(warmup=True)`` with its compile replaced by a recorder, so the
    signature, constexprs and attributes (divisibility, value-1 integers, None) are
    Triton's, whatever its version."""
    from triton.runtime.driver import driver

    captured = []
    device = driver.active.get_current_device()
    cache = kernel.device_caches[device]  # creates the binder (and sets kernel.compile)
    real = kernel.compile

    def record(src, target=None, options=None, **_):
        captured.append((src, options))
        return None

    kernel.compile = record
    try:
        kernel.run(grid=(1, 1, 1), warmup=True, **args, **options)
    finally:
        kernel.compile = real
        for key in [k for k, v in cache[0].items() if v is None]:  # no stale entry left behind
            del cache[0][key]
    if not captured:
        raise RuntimeError(f"{kernel.__name__}: Triton found a compiled binary in memory; nothing was recorded")
    return captured[0]


def _stage_patch(until: str, times: dict, sizes: dict):
    """Wrap the backend's stages: each timed (`times`), each output's size recorded
    (`sizes`: lines of text IR, bytes of a binary), and none after `until`."""
    from triton.compiler import compiler as triton_compiler

    real_make_backend = triton_compiler.make_backend
    last = STAGES.index(until)

    class Stop(Exception):
        pass

    def timed(ext, fn):
        def run(src, metadata):
            start = time.perf_counter()
            out = fn(src, metadata)
            times[ext] = time.perf_counter() - start
            sizes[ext] = len(out) if isinstance(out, bytes) else str(out).count("\n")
            if ext == "cubin":
                sizes["cubin_bytes"] = out
            if STAGES.index(ext) >= last and ext != STAGES[-1]:
                raise Stop
            return out

        return run

    def make_backend(target):
        backend = real_make_backend(target)
        add = backend.add_stages

        def add_stages(stages, options, *rest):
            add(stages, options, *rest)
            for ext in list(stages):
                if ext in STAGES:
                    stages[ext] = timed(ext, stages[ext])

        backend.add_stages = add_stages
        return backend

    return mock.patch.object(triton_compiler, "make_backend", make_backend), Stop


def resource_usage(cubin: bytes) -> tuple[Optional[int], Optional[int]]:
    """(registers, stack bytes) a thread, from the cuobjdump Triton ships; (None, None)
    where it is missing."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(match[1]), int(match[2])) if match else (None, None)


def timed_compile(src, options: dict, target, until: str) -> dict:
    """Compile `src` for `target` with every stage timed (Triton's cache is fresh and
    TRITON_ALWAYS_COMPILE is set by ``main``, so nothing is a hit)."""
    import triton

    times, sizes = {}, {}
    patch, stop = _stage_patch(until, times, sizes)
    real_make_ir = src.make_ir

    def make_ir(*args, **kwargs):
        start = time.perf_counter()
        module = real_make_ir(*args, **kwargs)
        times["front"] = time.perf_counter() - start
        return module

    src.make_ir = make_ir
    start = time.perf_counter()
    with patch:
        try:
            triton.compile(src, target=target, options=options)
        except stop:
            pass
    total = time.perf_counter() - start
    regs, stack = resource_usage(sizes.pop("cubin_bytes")) if "cubin_bytes" in sizes else (None, None)
    return dict(times=times, total=total, ttir_lines=sizes.get("ttir"), ptx_lines=sizes.get("ptx"),
                llir_lines=sizes.get("llir"), regs=regs, stack=stack)


def torch_analysis_s(launch: Launch, args: dict) -> Optional[float]:
    """Seconds of torch's own analysis of one launch (what AOTAutograd's tracing pays per
    distinct launch: compiler/launch_analysis.py), or None where this torch has none."""
    from torch._higher_order_ops import triton_kernel_wrap

    from nvfp4_inductor.compiler.launch_analysis import _ANALYSIS_NAMES

    name = next((n for n in _ANALYSIS_NAMES if hasattr(triton_kernel_wrap, n)), None)
    if name is None:
        return None
    import triton

    kernel = launch.kernel
    if launch.options:  # as traced: a one-config Autotuner carrying the launch options
        kernel = triton.autotune([triton.Config({}, **launch.options)], key=[])(launch.kernel)
    start = time.perf_counter()
    getattr(triton_kernel_wrap, name)(kernel, args, {})
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------
# Variants


@dataclasses.dataclass
class Variant:
    launch: Launch  # its first launch
    src: Any
    options: dict
    phases: list  # "fw" / "bw" of each launch of it
    result: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.launch.kernel.__name__


def variants_of(launches: list[Launch]) -> list[Variant]:
    """Launches grouped by the binary Triton compiles for them (its cache key's inputs:
    the source with its signature, constexprs and attributes; the options)."""
    out: dict = {}
    for launch in launches:
        src, options = specialise(launch.kernel, stand_in_args(launch), launch.options)
        key = (src.hash(), json.dumps(options, sort_keys=True, default=str))
        if key in out:
            out[key].phases.append(launch.phase)
        else:
            out[key] = Variant(launch, src, options, [launch.phase])
    return list(out.values())


def _short(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, TensorArg):
        return str(value.dtype).replace("torch.", "").replace("float8_e4m3fn", "e4m3")
    return str(value)


def specialisation(v: Variant) -> dict[str, str]:
    """Per runtime argument, what Triton made of it beyond its type: a constant (None
    pointers, integers equal to 1) or its divisibility by 16."""
    constants = {path[0]: value for path, value in v.src.constants.items()}
    attrs = {path[0]: value for path, value in v.src.attrs.items()}
    out = {}
    for i, param in enumerate(v.launch.kernel.params):
        if param.is_constexpr:
            continue
        out[param.name] = f"={constants[i]}" if i in constants else ("%16" if i in attrs else "%16!=0")
    return out


def distinguishing(variants: list[Variant]) -> dict[int, str]:
    """Per variant, its constexprs and launch options that differ among the variants of its
    kernel; where those are alike, how Triton specialised their runtime arguments (a None
    pointer, an integer equal to 1 or not a multiple of 16)."""
    out = {}
    by_kernel: dict = {}
    for v in variants:
        by_kernel.setdefault(v.name, []).append(v)
    for group in by_kernel.values():
        kernel = group[0].launch.kernel
        fields = [(p.name, lambda v, n=p.name: _short(v.launch.args[n])) for p in kernel.params if p.is_constexpr]
        fields += [(n, lambda v, n=n: _short(v.launch.options.get(n))) for n in SPECIAL_OPTIONS if n != "num_warps"]
        specs = {id(v): specialisation(v) for v in group}
        runtime = [(p.name, lambda v, n=p.name: specs[id(v)][n]) for p in kernel.params if not p.is_constexpr]
        labels = {id(v): " ".join(f"{n}={get(v)}" for n, get in fields if len({get(w) for w in group}) > 1)
                  for v in group}
        for v in group:
            alike = [w for w in group if labels[id(w)] == labels[id(v)]]  # told apart by their arguments only
            parts = [f"{n}{get(v)}" for n, get in runtime if len({get(w) for w in alike}) > 1 and get(v) != "%16"]
            out[id(v)] = " ".join([labels[id(v)]] * bool(labels[id(v)]) + parts)
    return out


def _phases(v: Variant) -> str:
    return "+".join(p for p in ("fw", "bw") if p in v.phases)


def _s(x) -> str:
    return "" if x is None else f"{x:.2f}"


HEADERS = ["kernel", "variant", "warps", "launches", "analysis s", "front s", *[f"{s} s" for s in STAGES],
           "total s", "TTIR lines", "PTX lines", "regs", "stack"]


def row_of(v: Variant, label: str) -> list[str]:
    r = v.result
    return [v.name, label, str(v.options.get("num_warps", "")), f"{len(v.phases)} {_phases(v)}",
            _s(r.get("analysis")), _s(r["times"].get("front")), *[_s(r["times"].get(s)) for s in STAGES],
            _s(r["total"]), str(r["ttir_lines"] or ""), str(r["ptx_lines"] or ""), str(r["regs"] or ""),
            "" if r["stack"] is None else str(r["stack"])]


# ---------------------------------------------------------------------------------------
# The investigation: one constexpr of a slow _group_cast_kernel variant changed


def cast_alternatives(args: dict, options: dict) -> list[tuple[str, dict, dict]]:
    """(label, args, options) of the variant with one choice changed to another value the
    launcher could pick (group_cast.py ``group_cast``, config.py ``cast_config``)."""
    from nvfp4_inductor.recipe import Recipe

    k = args["K"]
    out = []

    def alt(label, **changes):
        new_options = dict(options)
        if "num_warps" in changes:
            new_options["num_warps"] = changes.pop("num_warps")
        new = dict(args, **changes)
        if "BK" in changes:
            new["EVEN_K"] = k % new["BK"] == 0
        out.append((label, new, new_options))

    for bm in (16, 32, 64):  # 16 x a power of 2
        if bm != args["BM"]:
            alt(f"BM={bm}", BM=bm)
    for bk in (64, 128, 256, 512):  # a power of 2 >= 16
        if bk != args["BK"]:
            alt(f"BK={bk}", BK=bk)
    for kb in (1, 2, 4, 8):
        if kb != args["K_BLOCKS"]:
            alt(f"K_BLOCKS={kb}", K_BLOCKS=kb)
    for warps in (1, 2, 4, 8):
        if warps != options.get("num_warps"):
            alt(f"num_warps={warps}", num_warps=warps)
    if args["ROWWISE"] and not args["COLUMNWISE"] and not args["BLOCK_2D"]:  # the only casts it shapes
        for unroll in (1, 2, 4, 8, 16):
            if unroll != args["TOKEN_UNROLL"]:
                alt(f"TOKEN_UNROLL={unroll}", TOKEN_UNROLL=unroll)
    seed = TensorArg(torch.int64, True)
    if not args["SHARED_CODES"]:  # shared codes need round-to-nearest
        alt(f"SR={int(not args['SR'])}", SR=not args["SR"], seed_ptr=None if args["SR"] else seed)
    if args["COLUMNWISE"] and not args["SHARED_CODES"]:  # the RHT touches the column-wise copy only
        alt(f"RHT={int(not args['RHT'])}", RHT=not args["RHT"], SIGN_MASK=0 if args["RHT"] else Recipe().sign_mask)
    if args["ROWWISE"]:
        deq = not args["ROW_DEQ"]
        alt(f"ROW_DEQ={int(deq)}", ROW_DEQ=deq, row_data_ptr=TensorArg(torch.bfloat16 if deq else torch.uint8, True))
    if args["SHARED_CODES"]:  # 2D, RNE, no RHT, row + column: the codes may also be encoded twice
        alt("SHARED_CODES=0", SHARED_CODES=False)
    return out


def investigate(variant: Variant, target, until: str) -> list[list[str]]:
    base = variant.result
    rows = []
    for label, args, options in cast_alternatives(variant.launch.args, variant.options):
        launch = Launch(variant.launch.phase, variant.launch.kernel, args, options)
        src, opts = specialise(launch.kernel, stand_in_args(launch), options)
        r = timed_compile(src, opts, target, until)
        deltas = [r["times"].get(s, 0) - base["times"].get(s, 0) for s in ["front", *STAGES]]
        rows.append([label, *[f"{d:+.2f}" for d in deltas], _s(r["total"]), f"{r['total'] - base['total']:+.2f}",
                     str(r["ptx_lines"] or ""), str(r["regs"] or ""), "" if r["stack"] is None else str(r["stack"])])
        print(f"  {label}: total {r['total']:.2f} s", flush=True)
    return rows


INVESTIGATION_HEADERS = ["changed", "d front", *[f"d {s}" for s in STAGES], "total s", "d total", "PTX lines",
                         "regs", "stack"]


# ---------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> list[list[str]]:
    """The table's rows (slowest variant first)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="S3", choices=sorted(gm.SHAPES))
    parser.add_argument("--activation", default="swiglu", choices=["srelu", "tanh_srelu", "swiglu"])
    parser.add_argument("--sms", type=int, default=H100_SMS,
                        help="without CUDA: the stand-in GPU's multiprocessors (on CUDA the device's)")
    parser.add_argument("--arch", type=int, default=90,
                        help="without CUDA: the stand-in GPU's compute capability, e.g. 90 (on CUDA the device's)")
    parser.add_argument("--only", nargs="*", default=[], help="compile only kernels whose name contains one of these")
    parser.add_argument("--until", default="cubin", choices=STAGES, help="the last stage compiled")
    parser.add_argument("--investigate", type=int, default=2,
                        help="the slowest _group_cast_kernel variants to recompile with one choice changed")
    parser.add_argument("--json", default="", help="write the rows and the investigation to this file")
    args = parser.parse_args(argv)

    from nvfp4_inductor.kernels import _registry

    if _registry.INTERPRET:
        raise SystemExit("kernel_compile_time.py: unset TRITON_INTERPRET (the interpreter cannot trace launches)")
    cache = tempfile.mkdtemp(prefix="kernel_compile_time_")
    os.environ["TRITON_CACHE_DIR"] = cache  # Triton reads both when it compiles
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"

    on_cuda = torch.cuda.is_available()
    with contextlib.nullcontext() if on_cuda else stand_in_h100(args.sms, args.arch):
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
        device = torch.cuda.get_device_name() if on_cuda else f"stand-in sm_{args.arch}, {args.sms} SMs (no GPU)"
        import triton

        print(f"device: {device}; compile target {target}; torch {torch.__version__}, Triton {triton.__version__}",
              flush=True)
        start = time.perf_counter()
        launches, reason = record_launches(args.shape, args.activation)
        print(f"recorded {len(launches)} launches of {args.shape} {args.activation} (fw + bw) in "
              f"{time.perf_counter() - start:.1f} s; plan: {reason}", flush=True)
        variants = [v for v in variants_of(launches) if not args.only or any(o in v.name for o in args.only)]
        labels = distinguishing(variants)
        print(f"{len(variants)} variants to compile (Triton cache {cache})", flush=True)
        _warm_up(target)
        for v in variants:
            v.result = timed_compile(v.src, v.options, target, args.until)
            v.result["analysis"] = torch_analysis_s(v.launch, stand_in_args(v.launch))
            print(f"  {v.name} [{labels[id(v)]}] warps {v.options.get('num_warps')}: {v.result['total']:.2f} s",
                  flush=True)
        variants.sort(key=lambda v: -v.result["total"])

        investigations = []
        casts = [v for v in variants if v.name == "_group_cast_kernel"][:args.investigate]
        for v in casts:
            print(f"investigating {v.name} [{labels[id(v)]}] ({_phases(v)}, {v.result['total']:.2f} s)", flush=True)
            investigations.append((v, investigate(v, target, args.until)))

    rows = [row_of(v, labels[id(v)]) for v in variants]
    total = sum(v.result["total"] for v in variants)
    slowest = variants[0] if variants else None
    front = sum(v.result["times"].get("front", 0) for v in variants)
    analysis = [v.result["analysis"] for v in variants if v.result["analysis"] is not None]
    summary = (f"{len(variants)} variants of {len(launches)} launches: compile sum {total:.1f} s, max "
               f"{slowest.result['total'] if slowest else 0:.1f} s ({slowest.name if slowest else '-'}); front ends "
               f"{front:.1f} s; torch's analysis, one launch a variant: {sum(analysis):.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, target=str(target), triton=triton.__version__, torch=torch.__version__,
                           shape=args.shape, activation=args.activation, headers=HEADERS, rows=rows, summary=summary,
                           variants=[dict(kernel=v.name, label=labels[id(v)], phases=v.phases, options=v.options,
                                          args={n: _short(a) for n, a in v.launch.args.items()},
                                          result=v.result) for v in variants],
                           investigation=[dict(kernel=v.name, label=labels[id(v)], headers=INVESTIGATION_HEADERS,
                                               rows=r) for v, r in investigations]), f, indent=1, default=str)
    for v, r in investigations:
        print(f"\n{v.name} [{labels[id(v)]}] warps {v.options.get('num_warps')} ({_phases(v)}): "
              f"{v.result['total']:.2f} s; one choice changed (s against it)\n"
              + format_table(INVESTIGATION_HEADERS, r))
    print(f"\n{args.shape} {args.activation}, one layer, fw + bw on {device}, Triton {triton.__version__}: "
          "each distinct variant's cold compile by stage (s)\n" + format_table(HEADERS, rows) + "\n" + summary)
    return rows


def _warm_up(target) -> None:
    """One tiny kernel compiled first, so that the process's one-time costs (loading
    Triton's MLIR dialects and LLVM, the first ptxas start) are not charged to a variant."""
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    @triton.jit
    def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)

    src = ASTSource(_copy, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {(3,): 128}, {})
    with contextlib.redirect_stdout(io.StringIO()):
        triton.compile(src, target=target, options=dict(num_warps=4))


if __name__ == "__main__":
    main()
