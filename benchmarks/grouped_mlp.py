"""Question: how fast and how lean is NVFP4 grouped-MLP training (forward + backward)
compared with BF16, per implementation, at the shapes S1-S4 below, with and without CUDA graphs,
and how far is it from what its GEMMs and quantization bytes allow? (Shape H is small
enough to be host-bound: for host time, with --host-sample.)

Rows (one process, one GPU), per shape, activation and CUDA-graph setting: BF16
torch.compile of a torch._grouped_mm MLP (the baseline, 1.00) and our compiled NVFP4
(recompute on). ``--extra`` adds, graphs off only: stock torch.compile of the NVFP4 chain
in plain PyTorch ops (fake-quant: every operand of the six GEMMs quantize-dequantized as ours
are, benchmarks/fake_quant.py); our eager NVFP4 (op by op); our compiled NVFP4 with D saved;
our compiled NVFP4 with the weights' casts reused (``reuse``: the backend option
reuse_weight_casts, every step inside one ``nv.reuse_weight_casts()`` block, so each timed
step is a later micro-batch of an optimizer step, whose weights were cast by the first; the
note gives the memory the kept copies hold, which the peak column, measured from a base
taken after the first step, leaves out); and (``checkpoint``) BF16 and our compiled NVFP4,
each under activation checkpointing (torch.utils.checkpoint around the MLP: the step keeps
the inputs and runs the forward again in the backward), ours against that BF16 row.

Columns:
  graphs, vs, time/vs  CUDA graphs off, or on (both rows compiled with mode="reduce-overhead":
                       Inductor's CUDA graph trees, torch.compiler.cudagraph_mark_step_begin()
                       before each step); "vs" names the baseline row of the ratios (the BF16 row
                       of the same graphs setting). Weights are nn.Parameters (static under the
                       graph trees, as in training); x, probs and dY are copied into the graphs'
                       input buffers each replay, for BF16 and NVFP4 alike. NVFP4 graph
                       replays draw fresh SR seeds on the device (tests/test_gpu_cudagraphs.py).
  ms, TFLOP/s          forward + backward, median of triton.testing.do_bench on random data;
                       6 * T * H * (F1 + F) flops for every row.
  floor ms, floor/vs   (NVFP4 rows) the six BF16 grouped GEMMs of the step timed alone, plus the
                       bytes of every cast, amax pass and dequantization of one NVFP4 step
                       (`quant_bytes`) at the device-to-device copy rate measured in this run.
  peak GiB, peak/bf16  peak allocated during one step, inputs excluded; graphs off only (graph
                       replays bypass the caching allocator). Ratio to the BF16 graphs-off row.
  saved MiB, /bf16     bytes saved for backward (unique storages, saved_tensors_hooks); graphs off.
  host ms              time to enqueue one step without waiting for the GPU (5 steps back to
                       back): where it reaches "ms", the row is host-bound.
  first s, first/vs    the first step (Dynamo, Inductor, Triton compiles; graph-tree warm-up). The
                       process's first NVFP4 step also compiles our Triton kernels (~60 s on a
                       cold Triton cache), and a shape with new tile configurations compiles more.
  note                 "graphs skipped" when Inductor declined CUDA graphs for a graphs-on row
                       (its cudagraph_skips counter moved); a failing row's error.

    python benchmarks/grouped_mlp.py [--shapes S1 S2 S3 S4] [--activations srelu swiglu]
        [--graphs off on] [--extra eager save-D fake-quant reuse checkpoint] [--profile] [--launches]
        [--peak-alive] [--host-profile] [--host-sample] [--device cuda|cpu] [--compiler inductor|aot_eager]

The defaults (S1-S4 x srelu, swiglu; BF16 + NVFP4 recompute; graphs off and on; floor) should
fit ~8 minutes on a fresh H200 with Triton's cache cold (an estimate from earlier runs). Each
row is printed as it finishes (a cut-off run still reports) and the table last; SIGINT
(``timeout -s INT``) prints the rows measured so far.
``--device cpu --shapes tiny --compiler aot_eager`` is a smoke run (tests/
test_benchmark_grouped_mlp_smoke.py): perf_counter timing, no peak memory, graphs-on rows
skipped (CUDA graphs need a GPU).

--profile adds, per shape and activation, the GPU kernels of one compiled NVFP4 step
(recompute on, graphs off) sorted by time; --launches the same step's kernels in launch
order, each with its time (which cast costs what). --peak-alive adds, for the BF16 and the
NVFP4 row (graphs off), the blocks alive at one step's memory peak, largest first, each with
the line that allocated it (in Inductor's generated code: the buffer and its shape), from
the caching allocator's history of that step (``alive_at_peak``): what the peak column's
excess is made of. --host-profile adds the same step's
host-side Python functions by own time (cProfile). --host-sample attaches py-spy
(``--native``) to this process while that step runs back to back: the samples by where they
are (guard checks, Triton launches, allocations, Inductor's wrapper, AOTAutograd's and
autograd's runtimes, Dynamo's frame hook) per step, then Python and native frames
(custom-op dispatch, autograd's device thread, Triton's launcher: what cProfile cannot see
into) by own samples.
py-spy is a binary on PATH; a machine without network gets it from a wheel carried along
(one wheel serves every Python 3): ``pip download py-spy --only-binary=:all: -d
benchmarks/wheels/`` here (ignored by git), then there ``pip install --no-index --target
/tmp/py-spy benchmarks/wheels/py_spy-*.whl`` and ``PATH=/tmp/py-spy/bin:$PATH``. Without it
the option says so in one line and the run goes on.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import linecache
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import nvfp4_inductor as nv
from nvfp4_inductor.inspection import format_table
from nvfp4_inductor.numerics import columnwise_capacity

from fake_quant import fake_quant_mlp

SHAPES = {  # experts, tokens, hidden, ffn, uneven routing
    "S1": (8, 16384, 4096, 2048, False),
    "S2": (8, 65536, 4096, 4096, False),
    "S3": (32, 32768, 2048, 768, True),
    "S4": (128, 65536, 2048, 768, True),
    "tiny": (4, 256, 64, 64, True),  # the CPU smoke run
    # GPU work under the host time of a compiled step: host ms is the host's, and
    # --host-sample sees host work, not waits on a full launch queue
    "H": (8, 2048, 1024, 512, False),
}
DEFAULT_SHAPES = {"cuda": ["S1", "S2", "S3", "S4"], "cpu": ["tiny"]}
COPY_BYTES = {"cuda": 2**30, "cpu": 2**24}  # the copy whose rate the floor charges bytes at

BASELINE = "bf16 compiled (baseline)"
OURS = "nvfp4 compiled, recompute"
EXTRA = {"eager": "nvfp4 eager", "save-D": "nvfp4 compiled, save D", "fake-quant": "fake-quant, stock Inductor",
         "reuse": "nvfp4 compiled, weights reused", "checkpoint": "nvfp4 compiled, checkpointed"}
CHECKPOINTED_BASELINE = "bf16 compiled, checkpointed"  # the baseline of the checkpointed rows
HEADERS = ["shape", "act", "implementation", "graphs", "vs", "time/vs", "ms", "TFLOP/s", "floor ms", "floor/vs",
           "peak GiB", "peak/bf16", "saved MiB", "saved/bf16", "host ms", "first s", "first/vs", "note"]


def routing(experts, tokens, uneven, device):
    gen = torch.Generator(device=device).manual_seed(0)
    weights = torch.rand(experts, device=device, generator=gen) ** (3 if uneven else 0)
    ids = torch.multinomial(weights, tokens, replacement=True, generator=gen)
    return torch.bincount(ids, minlength=experts)


def activation_fn(name, h):
    if name == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return torch.relu(h) ** 2


def bf16_mlp(activation):
    def run(x, w1, w2, sizes, probs):
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        d = (activation_fn(activation, h.float()) * probs[:, None]).bfloat16()
        return torch._grouped_mm(d, w2.transpose(-2, -1), offs=offs)

    return run


def nvfp4_mlp(activation):
    def run(x, w1, w2, sizes, probs):
        return nv.grouped_mlp(x, w1, w2, sizes, probs, activation=activation)

    return run


def variants(activation, graphs: bool, compiler: str, extra) -> dict:
    """name -> step function for one activation: the baseline and ours, then the `extra` rows
    (graphs off only). Graphs on: torch.compile's mode="reduce-overhead" for both; the nvfp4
    backend hands the mode to Inductor as stock Inductor takes it (compiler/backend.py
    check_mode). dynamic=False: one static compile per shape, as a fresh process would make."""
    mode = "reduce-overhead" if graphs else None
    out = {
        BASELINE: torch.compile(bf16_mlp(activation), backend=compiler, mode=mode, dynamic=False),
        OURS: torch.compile(nvfp4_mlp(activation), backend=nv.backend(recompute=True, compiler=compiler), mode=mode,
                            dynamic=False),
    }
    if graphs:
        return out
    builders = {
        "eager": lambda: nvfp4_mlp(activation),
        "save-D": lambda: torch.compile(nvfp4_mlp(activation), backend=nv.backend(recompute=False, compiler=compiler),
                                        dynamic=False),
        "fake-quant": lambda: torch.compile(fake_quant_mlp(lambda c: activation_fn(activation, c)), backend=compiler,
                                            dynamic=False),
        "reuse": lambda: torch.compile(nvfp4_mlp(activation), backend=nv.backend(
            recompute=True, compiler=compiler, reuse_weight_casts=True), dynamic=False),
        "checkpoint": lambda: torch.compile(checkpointed(nvfp4_mlp(activation)), backend=nv.backend(
            recompute=True, compiler=compiler), dynamic=False),
    }
    for key in extra:
        if key == "checkpoint":  # its own BF16 baseline first, checkpointed the same way
            out[CHECKPOINTED_BASELINE] = torch.compile(checkpointed(bf16_mlp(activation)), backend=compiler,
                                                       dynamic=False)
        out[EXTRA[key]] = builders[key]()
    return out


def checkpointed(mlp):
    """`mlp` under activation checkpointing (torch.utils.checkpoint): the step keeps its inputs
    and runs its forward again in the backward."""
    def run(*args):
        return checkpoint(mlp, *args, use_reentrant=False)

    return run


def make_inputs(experts, tokens, hidden, ffn, f1, uneven, device):
    """(x, w1, w2, sizes, probs), dY. The weights are nn.Parameters, so Inductor's CUDA graph
    trees treat them as static (no copy per replay), as they do a model's weights."""
    sizes = routing(experts, tokens, uneven, device)
    x = torch.randn(tokens, hidden, device=device).bfloat16().requires_grad_()
    w1 = torch.nn.Parameter((torch.randn(experts, f1, hidden, device=device) * hidden**-0.5).bfloat16())
    w2 = torch.nn.Parameter((torch.randn(experts, hidden, ffn, device=device) * ffn**-0.5).bfloat16())
    probs = torch.rand(tokens, device=device).requires_grad_()
    grad = torch.randn(tokens, hidden, device=device).bfloat16()
    return (x, w1, w2, sizes, probs), grad


def sync(device) -> None:
    """Wait for the GPU (nothing to wait for on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, device, warmup=50, rep=300) -> float:
    """Median ms of fn: triton.testing.do_bench on CUDA (warm-up, L2 flushed, CUDA events);
    on the CPU, where do_bench cannot run, a perf_counter median of 5 calls after one."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def saved_bytes(fn, args) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())


def training_step(fn, args, grad, graphs=False):
    """One forward + backward of `fn` on (x, w1, w2, sizes, probs): the step every row times.
    With graphs, each step first tells Inductor's CUDA graph trees that a new iteration
    begins (cudagraph_mark_step_begin), as torch asks of loops that do not end each
    iteration with a plain backward; the trees may then overwrite the previous step's graph
    outputs, which no step reads."""

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        y = fn(*args)
        torch.autograd.grad(y, (args[0], args[1], args[2], args[4]), grad)

    return step


class Measured(NamedTuple):
    """One row's measurements; ms first."""

    ms: float
    peak: Optional[int]  # bytes; None where not measured (CPU, graphs on)
    saved: Optional[int]  # bytes; None with graphs on
    host: float
    first_s: float
    graphs_skipped: bool


def measure(fn, args, grad, device="cuda", graphs=False) -> Measured:
    """Time, memory and host time of `fn`'s training step. Peak and saved bytes with graphs
    off only: replays bypass the caching allocator, and what a step saves does not depend on
    how it is launched. A graphs-on row whose Inductor counted a CUDA-graph skip says so."""
    step = training_step(fn, args, grad, graphs)
    skips = counters["inductor"]["cudagraph_skips"]
    start = time.perf_counter()
    step()  # compile / warm up
    sync(device)
    first_s = time.perf_counter() - start
    peak = step_peak(step) if device == "cuda" and not graphs else None
    saved = None
    if not graphs:
        saved = saved_bytes(fn, args)
    ms = bench_ms(step, device)
    host = host_ms(step, device)
    return Measured(ms, peak, saved, host, first_s, counters["inductor"]["cudagraph_skips"] > skips)


def step_peak(step) -> int:
    """Bytes allocated at the peak of one more CUDA step above what was allocated before it."""
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    return torch.cuda.max_memory_allocated() - base


def device_allocs(step, steps=10) -> float:
    """cudaMalloc calls a warm CUDA step makes, averaged over `steps`: the caching allocator
    should serve a warm step from blocks it holds; each call it makes instead (and the
    cudaFree of cached blocks that may precede it) waits for the device, host time that moves
    between processes."""
    before = torch.cuda.memory_stats().get("num_device_alloc", 0)
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (torch.cuda.memory_stats().get("num_device_alloc", 0) - before) / steps


def host_ms(step, device, steps=5, rounds=5) -> float:
    """Host time to enqueue one step: the median over `rounds` of `steps` steps run back to
    back without a sync, so the CPU does not wait for the GPU as long as their launches fit
    in the launch queue (~1000 deep): true of the NVFP4 and BF16 rows (~40 launches a step).
    One round used to be the figure; it moved by ~0.5 ms between runs (a collection or
    allocator call landing in it shows in one round, not in the median). The fake-quant
    row's figure came out at ~0.8x its GPU time: read it as "the host
    waited", not as host time (unverified: its launch count was not taken). A step whose
    host time reaches its GPU time is host-bound. With graphs on, a step is the graph
    trees' replays."""
    times = []
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - start) / steps * 1e3)
        sync(device)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------
# the floor: BF16 GEMMs + NVFP4 quantization bytes at copy speed

NVFP4_BYTES = 0.5 + 1 / 16  # per element of an NVFP4 copy: E2M1 code + one E4M3 scale per 16


def quant_bytes(experts, tokens, hidden, ffn, f1) -> float:
    """Bytes read + written by every cast, amax pass and dequantization of one compiled NVFP4
    training step: recompute on, the Triton target with its fused fc1 and fc2-dgrad kernels,
    as the backend plans on the H200. Its launches:
    forward amax x, W1, W2, D (pre + post RHT, one pass: the fc1 kernel gives no amax); casts
    x, W1, W2 (row + column; x's in a row-wise and a column-wise launch, each reading x),
    D (row only), each writing its row-wise copy as the bf16 deq() values the forward GEMMs
    read (Steps.deq_operands): no dequantize launch in the forward.
    Backward amax dY, dC; casts dY, dC (row + column, SR: a row-wise and a column-wise
    launch, each reading the source, kernels/config.py's cast_launches; dY's row-wise copy
    written as deq() values, which fc2's dgrad reads right after), the regenerated D (column
    only, the forward's amax); dequantize dY + D, dC + x column-wise and W2, dC + W1 for
    the dgrads. tests/test_benchmark_grouped_mlp_smoke.py checks this sum
    against the tensors those launches read and write.

    Counted: a pass over a bf16 source reads 2 bytes per element; a cast writes each copy
    (NVFP4_BYTES per element packed, 2 as deq() values); a dequantization reads a copy and
    writes its bf16 twin (2 bytes per element). Token tensors' column-wise copies span
    P = columnwise_capacity(T, G) tokens (numerics.md 5.1). Not counted: the GEMMs and their
    fused epilogues (the BF16 GEMM time stands for them, though the epilogues also write D
    and read C), per-expert amaxes, offsets and seeds (bytes per expert), the zero fill of
    column-wise padding."""
    padded = columnwise_capacity(tokens, experts)

    def dequant(n):
        return n * (NVFP4_BYTES + 2)

    total = 0.0
    row, col = tokens * hidden, padded * hidden  # x: amax, row (deq()) and column casts, column dequantized
    total += 2 * row + 2 * 2 * row + 2 * row + NVFP4_BYTES * col + dequant(col)
    for k, row_deq in ((hidden, True), (f1, False)):  # dY, dC: amax, row + column cast in two SR launches
        row, col = tokens * k, padded * k
        total += 2 * row + 2 * 2 * row + NVFP4_BYTES * col + dequant(col)
        total += 2 * row if row_deq else NVFP4_BYTES * row + dequant(row)
    for n in (experts * f1 * hidden, experts * hidden * ffn):  # W1, W2: amax, 16x16-tile cast (row deq())
        total += 2 * n + 2 * n + 2 * n + NVFP4_BYTES * n + dequant(n)
    row, col = tokens * ffn, padded * ffn  # D: amax, row-only cast (forward, deq()), column-only cast (backward)
    total += 2 * row + 2 * row + 2 * row + 2 * row + NVFP4_BYTES * col + dequant(col)
    return total


def copy_rate(device) -> float:
    """Bytes per ms (read + written) of a large device-to-device copy in this process: the
    rate the floor charges quantization bytes at (the casts' own ceiling, benchmarks/quantize.py)."""
    src = torch.empty(COPY_BYTES[device] // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, warmup=25, rep=100)
    return 2 * src.nbytes / ms


def bf16_gemm_ms(experts, tokens, hidden, ffn, f1, sizes, device) -> float:
    """The six torch._grouped_mm of a BF16 step alone, in the layouts autograd calls them with
    (forward a @ W^T; dgrad g @ W; wgrad g^T @ a over each expert's tokens), fc1 and fc2, on
    random bf16 operands: the GEMM part of the floor."""
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    gemms = [(rand(tokens, hidden), rand(experts, f1, hidden), rand(tokens, f1)),  # x, W1, dC
             (rand(tokens, ffn), rand(experts, hidden, ffn), rand(tokens, hidden))]  # D, W2, dY

    def run():
        for a, w, g in gemms:
            torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
            torch._grouped_mm(g, w, offs=offs)
            torch._grouped_mm(g.t(), a, offs=offs)

    return bench_ms(run, device, warmup=25, rep=100)


@dataclasses.dataclass
class Floor:
    """What NVFP4 on SM90 cannot go below: it runs the same six GEMMs on bf16 operands (no
    FP4 tensor cores) and must move its quantization bytes at best at copy speed."""

    gemm_ms: float
    quant_bytes: float
    ms: float


def floor(experts, tokens, hidden, ffn, f1, sizes, device, bytes_per_ms) -> Floor:
    """The floor of one shape and activation, with this routing and the measured copy rate."""
    gemm = bf16_gemm_ms(experts, tokens, hidden, ffn, f1, sizes, device)
    nbytes = quant_bytes(experts, tokens, hidden, ffn, f1)
    return Floor(gemm, nbytes, gemm + nbytes / bytes_per_ms)


# ---------------------------------------------------------------------------------------
# where the time goes (--profile, --host-profile, --host-sample)

def host_breakdown(step, device, steps=20, top=16):
    """Where the host time of a step goes: cProfile over `steps` steps, functions by own time."""
    import cProfile
    import pstats

    step()
    sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    sync(device)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, prim, own s, cum s, callers)
    entries = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    rows = [[f"{name} ({file.rsplit('/', 2)[-2] + '/' + file.rsplit('/', 1)[-1] if '/' in file else file}:{line})"[:70],
             f"{calls / steps:.0f}", f"{own / steps * 1e3:.3f}", f"{cum / steps * 1e3:.3f}"]
            for (file, line, name), (_prim, calls, own, cum, _callers) in entries]
    total = sum(v[2] for v in stats.values()) / steps * 1e3
    return format_table(["function (own time)", "calls/step", "own ms/step", "cum ms/step"], rows) + \
        f"\nhost total {total:.3f} ms/step (under cProfile, which inflates call-heavy code)"


PROFILED_STEPS = 3  # --profile and --launches average this many warm steps


def _profiled_steps(step):
    """torch.profiler's record of PROFILED_STEPS warm steps' GPU activity."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    return prof


def kernel_breakdown(step, top=14):
    """Per-kernel GPU time of one forward+backward step, from torch.profiler."""
    prof = _profiled_steps(step)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    steps = PROFILED_STEPS
    total = sum(e.device_time_total for e in events) / steps
    rows = [[e.key[:60], str(e.count // steps), f"{e.device_time_total / steps / 1e3:.3f}",
             f"{100 * e.device_time_total / steps / total:.0f}%"] for e in events[:top]]
    return format_table(["kernel", "calls/step", "ms/step", "share"], rows) + f"\ntotal {total / 1e3:.3f} ms/step"


def launch_order(step, min_us=5.0):
    """The GPU kernels of one forward+backward step in launch order with their us (mean over
    PROFILED_STEPS steps, torch.profiler): which launch of a kind costs what (a cast of x
    against one of dY), where kernel_breakdown sums them by name. Kernels under min_us left
    out."""
    events = [e for e in _profiled_steps(step).events() if e.device_type == torch.autograd.DeviceType.CUDA]
    steps = PROFILED_STEPS
    n = len(events) // steps
    rows = [[str(i), events[i].name[:60], f"{sum(events[i + k * n].device_time for k in range(steps)) / steps:.1f}"]
            for i in range(n)]
    return format_table(["#", "kernel", "us"], [r for r in rows if float(r[2]) >= min_us])


def alive_at_peak(snapshot: dict) -> tuple[int, list[dict]]:
    """(peak bytes, the blocks alive there) of the allocations a memory-history snapshot
    recorded (``torch.cuda.memory._snapshot()`` after ``_record_memory_history``): its alloc
    and free events replayed in order, a block counted from its alloc until its free
    completes. Blocks allocated before the recording began are not seen (the step's
    inputs), as step_peak leaves them out too."""
    live, current, peak, at_peak = {}, 0, 0, {}
    for event in (e for trace in snapshot["device_traces"] for e in trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    return peak, sorted(at_peak.values(), key=lambda e: -e["size"])


def allocated_by(frames: list[dict]) -> str:
    """The line that allocated a block: the innermost frame in Inductor's generated code,
    else in this package, else the innermost Python frame."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    def line(frame):
        text = linecache.getline(frame["filename"], frame["line"]).strip()
        return f"{os.path.basename(frame['filename'])}:{frame['line']} {text}"

    for wanted in (cache_dir(), os.path.dirname(nv.__file__)):
        for frame in frames:
            if frame.get("filename", "").startswith(wanted):
                return line(frame)
    return line(frames[0]) if frames else "?"


def peak_alive(step, min_mib=8) -> str:
    """--peak-alive: one more step under the allocator's history; its peak and the blocks of
    at least `min_mib` MiB alive there."""
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = alive_at_peak(snapshot)
    rows = [[f"{b['size'] / 2**20:.0f}", allocated_by(b.get("frames", []))[:150]]
            for b in blocks if b["size"] >= min_mib * 2**20]
    return f"peak {peak / 2**20:.0f} MiB; alive there:\n" + format_table(["MiB", "allocated by"], rows)


def _let_children_trace_us() -> None:
    """Under Yama ptrace_scope 1 (a common default) a process may trace only its descendants;
    py-spy is our child attaching to us, so allow it (prctl PR_SET_PTRACER_ANY). Where prctl
    is missing there is nothing to allow, and py-spy reports any refusal itself."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _stacks(raw: str):
    """py-spy's raw (collapsed) stacks, "frame;frame;... count" per line -> (frames, count)."""
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def own_samples(raw: str) -> collections.Counter:
    """py-spy's raw stacks -> samples per leaf frame, line numbers dropped (one row per
    function) and unnamed native addresses as "?"."""
    own = collections.Counter()
    for frames, count in _stacks(raw):
        leaf = re.sub(r":\d+\)$", ")", frames[-1])
        own[re.sub(r"^0x[0-9a-f]+ ", "? ", leaf)] += count
    return own


# Where a host sample of a compiled step is, by the first of these whose pattern some frame
# of its stack matches (a guard check runs inside Dynamo's frame hook, a launch inside the
# wrapper code, the wrapper inside AOTAutograd's runtime, and the main thread's backward call
# waits on autograd's device thread, which runs the backward's wrapper).
HOST_CATEGORIES = (
    ("Dynamo guard checks", r"GuardManager|GuardAccessor|^GuardBuilder"),
    ("Triton launches (Inductor's CachingAutotuner.run and below)", r"^CachingAutotuner\.run "),
    ("allocations (empty_strided_cuda)", r"^empty_strided_cuda "),
    ("ops the wrapper calls (OpOverload)", r"^OpOverload(Packet)?\.__call__ "),
    ("Inductor's wrapper code, own lines", r"torchinductor_|^Runner\.call "),
    ("AOTAutograd runtime wrappers", r"torch/_functorch/"),
    ("autograd engine (incl. waiting on its device thread)", r"torch/autograd/|^_engine_run_backward |THPFunction_apply"),
    ("Dynamo frame hook", r"torch/_dynamo/|dynamo__custom_eval_frame"),
)


def host_categories(raw: str) -> collections.Counter:
    """py-spy's raw stacks -> samples per HOST_CATEGORIES entry ("other" for the rest)."""
    out = collections.Counter()
    for frames, count in _stacks(raw):
        out[next((name for name, pattern in HOST_CATEGORIES if any(re.search(pattern, f) for f in frames)),
                 "other")] += count
    return out


def host_sample(step, device, py_spy: str, seconds=4, rate=200, top=12) -> str:
    """Tables of `step` run back to back under py-spy --native (the binary `py_spy`),
    attached to this process after the step is compiled and warm: only steady-state steps
    are sampled, from every thread (the backward runs on autograd's device thread). First
    the samples by category (``HOST_CATEGORIES``) per step run meanwhile (py-spy slows the
    steps, so compare rows, not milliseconds), then the `top` frames by own samples."""
    _let_children_trace_us()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "stacks.txt")
        proc = subprocess.Popen([py_spy, "record", "--pid", str(os.getpid()), "--native", "--format", "raw", "--rate",
                                 str(rate), "--duration", str(seconds), "--output", out],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        steps, deadline = 0, time.monotonic() + seconds + 60
        while proc.poll() is None and time.monotonic() < deadline:
            step()
            steps += 1
        sync(device)
        if proc.poll() is None:
            proc.kill()
        log = proc.communicate()[0]
        if proc.returncode != 0 or not os.path.exists(out):
            return f"host sample: py-spy failed (exit {proc.returncode}): {log.strip()[-400:]}"
        with open(out) as f:
            raw = f.read()
    own, categories = own_samples(raw), host_categories(raw)
    total = sum(own.values()) or 1
    by_category = [[name, f"{n / max(steps, 1):.2f}", f"{100 * n / total:.1f}%"] for name, n in categories.most_common()]
    rows = [[frame[:90], str(n), f"{100 * n / total:.1f}%"] for frame, n in own.most_common(top)]
    return (format_table(["where (all threads)", "samples a step", "share"], by_category) + "\n\n" +
            format_table(["frame (own samples, all threads)", "samples", "share"], rows) +
            f"\n{total} samples at {rate} Hz over {seconds} s, {steps} steps run meanwhile")


# ---------------------------------------------------------------------------------------
# rows

def kept_note(nbytes: int) -> str:
    """The note of a row run inside a reuse_weight_casts block: the memory its kept copies hold."""
    return f"kept copies {nbytes / 2**20:.1f} MiB"


def ratio(value, base) -> str:
    return f"{value / base:.2f}" if value is not None and base else "-"


def _fmt(value, spec, scale=1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def table_row(shape, activation, name, graphs, m: Measured, base: Optional[Measured], mem_base: Optional[Measured],
              flops, fl: Floor) -> list[str]:
    """One table row; ratios against `base` (the BF16 row of the same graphs setting, the
    checkpointed one for a checkpointed row) and, for memory, `mem_base` (that BF16 row with
    graphs off). The floor is that of an uncheckpointed step: NVFP4 rows without checkpointing only."""
    ours = name.startswith("nvfp4") and not is_checkpointed(name)
    note = "graphs skipped" if graphs and m.graphs_skipped else ""
    vs = f"bf16{' ckpt' if is_checkpointed(name) else ''} {'on' if graphs else 'off'}"
    return [shape, activation, name, "on" if graphs else "off", vs,
            ratio(m.ms, base and base.ms), f"{m.ms:.2f}", f"{flops / m.ms / 1e9:.0f}",
            f"{fl.ms:.2f}" if ours else "-", ratio(fl.ms if ours else None, base and base.ms),
            _fmt(m.peak, ".2f", 2**30), ratio(m.peak, mem_base and mem_base.peak),
            _fmt(m.saved, ".0f", 2**20), ratio(m.saved, mem_base and mem_base.saved),
            f"{m.host:.2f}", f"{m.first_s:.1f}", ratio(m.first_s, base and base.first_s), note]


def is_checkpointed(name: str) -> bool:
    return name in (CHECKPOINTED_BASELINE, EXTRA["checkpoint"])


def failed_row(shape, activation, name, graphs, error) -> list[str]:
    row = [shape, activation, name, "on" if graphs else "off"] + ["-"] * (len(HEADERS) - 5)
    return row + [f"failed: {type(error).__name__}: {error}"[:100].replace("\n", " ")]


def run_case(shape, activation, opts, bytes_per_ms, clock):
    """Yields every row of one shape and activation, graphs off then on, each printed when
    done (a generator, so an interrupted case keeps its finished rows)."""
    experts, tokens, hidden, ffn, uneven = SHAPES[shape]
    f1 = 2 * ffn if activation == "swiglu" else ffn
    flops = 3 * 2 * tokens * hidden * (f1 + ffn)  # fwd + dgrad + wgrad of both GEMMs
    args, grad = make_inputs(experts, tokens, hidden, ffn, f1, uneven, opts.device)
    fl = floor(experts, tokens, hidden, ffn, f1, args[3], opts.device, bytes_per_ms)
    clock(f"{shape} {activation} floor: bf16 GEMMs {fl.gemm_ms:.2f} ms + {fl.quant_bytes / 2**20:.0f} MiB "
          f"quantization bytes at copy rate = {fl.ms:.2f} ms")
    mem_bases = {}  # baseline name -> its graphs-off measurement
    for graphs in opts.graphs:
        bases = {}  # baseline name -> its measurement with this graphs setting
        for name, fn in variants(activation, graphs, opts.compiler, opts.extra).items():
            reusing = name == EXTRA["reuse"]
            try:
                with nv.reuse_weight_casts() if reusing else contextlib.nullcontext() as reuse:
                    m = measure(fn, args, grad, opts.device, graphs)
                    kept = reuse.kept_bytes if reusing else None
            except Exception as error:  # a failing variant is reported, not hidden
                row = failed_row(shape, activation, name, graphs, error)
                clock(" | ".join(row))
                yield row
                continue
            if name in (BASELINE, CHECKPOINTED_BASELINE):
                bases[name] = m
                if not graphs:
                    mem_bases[name] = m
            baseline = CHECKPOINTED_BASELINE if is_checkpointed(name) else BASELINE
            row = table_row(shape, activation, name, graphs, m, bases.get(baseline), mem_bases.get(baseline), flops, fl)
            if kept is not None:
                row[-1] = kept_note(kept)
            clock(" | ".join(row))  # progress: a cut-off run still reports
            yield row
            if name in (BASELINE, OURS) and not graphs and opts.peak_alive:
                clock(f"{shape} {activation} {name}: " + (
                    peak_alive(training_step(fn, args, grad)) if opts.device == "cuda"
                    else "--peak-alive: the allocator's history needs CUDA; skipped"))
            if name == OURS and not graphs:
                profile_ours(fn, args, grad, opts)


def profile_ours(fn, args, grad, opts) -> None:
    """--profile, --host-profile, --host-sample on our compiled step (graphs off)."""
    step = training_step(fn, args, grad)
    if opts.profile:
        print(kernel_breakdown(step) if opts.device == "cuda" else "--profile: GPU kernels need CUDA; skipped",
              flush=True)
    if opts.launches:
        print(launch_order(step) if opts.device == "cuda" else "--launches: GPU kernels need CUDA; skipped", flush=True)
    if opts.host_profile:
        print(host_breakdown(step, opts.device), flush=True)
    if opts.py_spy:
        print(host_sample(step, opts.device, opts.py_spy), flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: S1-S4 on cuda, tiny on cpu")
    parser.add_argument("--activations", nargs="+", default=["srelu", "swiglu"], choices=["srelu", "swiglu"])
    parser.add_argument("--graphs", nargs="+", default=["off", "on"], choices=["off", "on"],
                        help="CUDA graphs (mode='reduce-overhead') off, on, or both")
    parser.add_argument("--extra", nargs="*", default=[], choices=sorted(EXTRA),
                        help="more rows, graphs off (each compile costs device time)")
    parser.add_argument("--profile", action="store_true", help="print the kernel breakdown of compiled NVFP4")
    parser.add_argument("--launches", action="store_true",
                        help="print the GPU kernels of one compiled NVFP4 step in launch order")
    parser.add_argument("--peak-alive", action="store_true",
                        help="print the blocks alive at the memory peak of a BF16 and an NVFP4 step (graphs off)")
    parser.add_argument("--host-profile", action="store_true",
                        help="print where the host time of a compiled NVFP4 step goes (cProfile)")
    parser.add_argument("--host-sample", action="store_true",
                        help="print a py-spy --native own-time table of compiled NVFP4 steps (needs py-spy)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"],
                        help="what compiles every row (aot_eager: a fast CPU smoke run)")
    opts = parser.parse_args(argv)
    opts.shapes = opts.shapes or DEFAULT_SHAPES[opts.device]
    opts.graphs = [g == "on" for g in opts.graphs]
    if True in opts.graphs and opts.device == "cpu":
        print("note: CUDA graphs need a GPU; graphs-on rows skipped on the CPU", flush=True)
        opts.graphs = [g for g in opts.graphs if not g]
    if True in opts.graphs and opts.compiler != "inductor":
        parser.error("--graphs on needs --compiler inductor (CUDA graphs are an Inductor mode)")
    return opts


def machine_line(device: str) -> str:
    """What a log's figures were measured on: the card (or CPU) and the torch / Triton versions,
    so that figures from different cards are never set side by side unknowingly."""
    if device == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        where = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
    else:
        where = f"{device} ({os.cpu_count()} cores)"
    try:
        import triton
        versions = f"torch {torch.__version__}, triton {triton.__version__}"
    except ImportError:
        versions = f"torch {torch.__version__}, no triton"
    return f"{where}; {versions}"


def find_py_spy(wanted: bool, clock) -> Optional[str]:
    """--host-sample's py-spy binary on PATH, None when not asked for or not found (said in
    one line: the run goes on without host samples)."""
    path = shutil.which("py-spy") if wanted else None
    if wanted and not path:
        clock("--host-sample: py-spy not found on PATH; no host samples "
              "(grouped_mlp.py's module docstring says how to carry it)")
    return path


def progress_clock():
    """A progress printer: each line prefixed with the seconds since this call."""
    start = time.perf_counter()

    def clock(line):
        print(f"[{time.perf_counter() - start:5.0f} s] {line}", flush=True)

    return clock


def table_of(rows, headers, clock) -> list[list[str]]:
    """Collect the rows a generator yields (each printed by it as measured) and print the table
    last; SIGINT (``timeout -s INT``) ends the collection and keeps what was measured."""
    done = []
    try:
        for row in rows:
            done.append(row)
    except KeyboardInterrupt:
        clock("interrupted; the rows measured so far:")
    print(format_table(headers, done), flush=True)
    return done


def main(argv=None) -> list[list[str]]:
    """Run the benchmark; print each row as it is measured and the table last. Returns the rows."""
    opts = parse_args(argv)
    clock = progress_clock()
    clock(machine_line(opts.device))
    opts.py_spy = find_py_spy(opts.host_sample, clock)
    bytes_per_ms = copy_rate(opts.device)
    clock(f"copy rate {bytes_per_ms / 1e6:.1f} GB/s (read + write of {COPY_BYTES[opts.device] / 2**20:.0f} MiB)")

    def rows():
        for shape in opts.shapes:
            for activation in opts.activations:
                yield from run_case(shape, activation, opts, bytes_per_ms, clock)
                torch._dynamo.reset()  # the next shape compiles afresh (and the graph trees' memory goes)

    return table_of(rows(), HEADERS, clock)


if __name__ == "__main__":
    main()
