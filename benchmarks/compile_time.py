"""Question: how long is the first compiled training step of a stack of L grouped-MLP
layers, BF16 against NVFP4 with traced launches (the default) and without
(``trace_launches=False``), on a cold cache and on the second run, and what does each layer
add?

With traced launches torch analyses every traced kernel launch of every layer while
compiling (its mutation analysis generates the kernel's IR each time), so the first step
grows with the number of layers; without them the fused ops are opaque calls and our
kernels compile once, whatever the depth. Each row (implementation, layers) runs in its own
process, twice, with a fresh Inductor and Triton cache directory of its own: the first
process compiles everything ("first s", as a user's first run on a machine), the second
finds what the first wrote to disk ("cached s", every later run). Columns: both first steps,
the per-layer slope of the cached first step against the one-layer row, the launch analyses
torch ran in the first process and those answered from the table (compiler/launch_analysis.py;
the second process loads AOTAutograd's cache and traces nothing), the warm step and its host
time (from the second process). The timed first step includes the
``torch.compile`` call: looking the backend up is part of what a user waits for (the
"inductor" backend imports Inductor's compiler there, ours at its first compile).
``--profile DIR`` runs both processes' first steps under cProfile, writes the stats to DIR
(``<row>_cold.prof``, ``<row>_cached.prof``, for pstats or snakeviz) and prints the cached
step's 30 slowest functions by own time.

``--phases`` prints, per row, where the cold first step went: the compile phases torch times
itself (``dynamo_timed``: Dynamo, AOTAutograd, Inductor's lowering, code generation, the wait
on its compile workers; summed over graphs, nested phases inside their parents), and a
timeline of the Triton cache: when each kernel's binary and each launcher library was
written (which kernels finish last, and whether the launchers are built one after
another); and the backend's progress lines (its logger at INFO: when the early compiles
started, how long a graph waited for them). Both in seconds from the step's start (the
``torch.compile`` call), the one clock of the row's "first s".

``--model qwen3_moe --layers 4`` times a whole transformers model instead (the CausalLM of
benchmarks/model_step.py's model case, 4 decoder layers on --batch x --seq token ids, its own
loss; BF16 under stock Inductor against the backend, each row in its own processes as above).

    python benchmarks/compile_time.py [--layers 1 4 8] [--shape S3] [--activation swiglu]
        [--only NAME ...] [--profile DIR] [--phases] [--device cuda|cpu] [--compiler inductor|aot_eager]
        [--model mixtral|olmoe|qwen3_moe [--batch 2] [--seq 2048]]

``--device cpu --shape tiny --compiler aot_eager --layers 1 2`` is the CPU smoke run
(tests/test_benchmark_grouped_mlp_smoke.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import grouped_mlp as gm  # noqa: E402
import nvfp4_inductor as nv  # noqa: E402
from nvfp4_inductor.inspection import format_table  # noqa: E402
from torch._dynamo.utils import compilation_time_metrics, counters  # noqa: E402

HEADERS = ["implementation", "layers", "first s", "cached s", "s per layer", "analyses (reused)", "warm ms", "host ms"]


def stack(run, layers):
    """L layers of `run` (x, w1, w2, sizes, probs) -> y, each with its own weights, y -> x."""

    def forward(x, weights, sizes, probs):
        for w1, w2 in weights:
            x = run(x, w1, w2, sizes, probs)
        return x

    return forward


def implementations(activation, compiler):
    return {
        "bf16 compiled": (gm.bf16_mlp(activation), compiler),
        "nvfp4, traced launches": (gm.nvfp4_mlp(activation), nv.backend(compiler=compiler)),
        "nvfp4, trace_launches=False": (gm.nvfp4_mlp(activation), nv.backend(compiler=compiler,
                                                                              trace_launches=False)),
    }


def mlp_workload(run, layers, shape, activation, device):
    """(function to compile, its inputs, what the step differentiates, the output's gradient)
    for a stack of `layers` grouped-MLP layers at `shape`."""
    experts, tokens, hidden, ffn, uneven = gm.SHAPES[shape]
    f1 = 2 * ffn if activation == "swiglu" else ffn
    (x, w1, w2, sizes, probs), grad = gm.make_inputs(experts, tokens, hidden, ffn, f1, uneven, device)
    weights = [(w1, w2)] + [(torch.nn.Parameter(w1.detach().clone()), torch.nn.Parameter(w2.detach().clone()))
                            for _ in range(layers - 1)]
    return stack(run, layers), (x, weights, sizes, probs), [x, *[w for pair in weights for w in pair], probs], grad


def model_workload(family, layers, args):
    """The same for benchmarks/model_step.py's model case: a transformers CausalLM of `layers`
    decoder layers on --batch x --seq token ids, its own loss (CPU: model_step's tiny sizes)."""
    import model_step

    opts = argparse.Namespace(device=args.device, batch=args.batch, seq=args.seq, checkpoint=False)
    case = model_step.make_case("model", model_step.config_for(family, layers, tiny=args.device == "cpu"), opts)
    return case.module, case.inputs, case.wrt, None


def transformers_version() -> str:
    """transformers' version, for the log of a --model run."""
    import transformers

    return transformers.__version__


def measure(workload, backend, device, profile_to=None):
    fn, inputs, wrt, grad = workload
    counters["nvfp4"]["launch_analyses"] = counters["nvfp4"]["launch_analyses_reused"] = 0
    profiler = cProfile.Profile() if profile_to else None
    started = time.time()  # (the clock of file times and log lines)
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    fn = torch.compile(fn, backend=backend, dynamic=False)

    def step():
        torch.autograd.grad(fn(*inputs), wrt, grad)

    step()
    gm.sync(device)
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile_to)
    first = time.perf_counter() - start
    analyses = f'{counters["nvfp4"]["launch_analyses"]} ({counters["nvfp4"]["launch_analyses_reused"]})'
    phases = {name: sum(times) for name, times in compilation_time_metrics.items()}
    return first, analyses, gm.bench_ms(step, device, warmup=3, rep=20), gm.host_ms(step, device), phases, started


def log_line_at(line: str, started: float) -> str:
    """A torch log line ("I1206 17:34:13.040000 ...", local time of day) with its seconds
    from `started` (a time.time()) in front; a line without that stamp as it is."""
    stamp = re.match(r"[IWEF]\d{4} (\d\d):(\d\d):(\d\d(?:\.\d+)?) ", line)
    if not stamp:
        return line
    hours, minutes, seconds = stamp.groups()
    day = time.localtime(started)
    since = int(hours) * 3600 + int(minutes) * 60 + float(seconds) - (
        day.tm_hour * 3600 + day.tm_min * 60 + day.tm_sec + started % 1)
    since = (since + 43200) % 86400 - 43200  # (a step across midnight)
    return f"{since:6.1f}  {line}"


def triton_cache_timeline(triton_dir: str, started: float) -> list[list[str]]:
    """(seconds from `started`, kind, name) of every kernel binary and launcher library in a
    Triton cache directory, by the time its file was written."""
    rows = []
    for entry in os.scandir(triton_dir) if os.path.isdir(triton_dir) else ():
        for f in os.scandir(entry.path):
            if f.name.endswith(".so"):
                rows.append((f.stat().st_mtime - started, "launcher", f.name))
            elif f.name.endswith((".cubin", ".hsaco")):
                rows.append((f.stat().st_mtime - started, "kernel", f.name.rsplit(".", 1)[0]))
    return [[f"{t:.1f}", kind, name] for t, kind, name in sorted(rows)]


def profile_path(directory: str, name: str, layers: int, run: str) -> str:
    if not directory:
        return ""
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}_{layers}_{run}.prof")


def run_row(index: int, layers: int, args, cache_dir: str, profile_to: str = "", logs: bool = False) -> dict:
    """One row's measurement in a new process whose Inductor and Triton caches live in
    `cache_dir` (reused by the row's second process); `profile_to`: a file for the
    cProfile stats of its first step; `logs`: the backend's progress lines (its logger at
    INFO), kept under "logs"."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
    if logs:
        env["TORCH_LOGS"] = "nvfp4_inductor"
    command = [sys.executable, os.path.abspath(__file__), "--row", str(index), str(layers), "--shape", args.shape,
               "--activation", args.activation, "--device", args.device, "--compiler", args.compiler,
               "--batch", str(args.batch), "--seq", str(args.seq)]
    if args.model:
        command += ["--model", args.model]
    if profile_to:
        command += ["--profile-to", profile_to]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"row {index} ({layers} layers) failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["logs"] = [line for line in done.stderr.splitlines() if "nvfp4:" in line] if logs else []
    return row


def print_phases(name: str, layers: int, phases: dict, timeline: list[list[str]], logs: list[str]) -> None:
    top = sorted(phases.items(), key=lambda item: -item[1])[:25]
    print(f"[{name}] layers {layers}: cold first step, torch's compile phases (s, summed over graphs)\n"
          + format_table(["phase", "s"], [[phase, f"{s:.2f}"] for phase, s in top]), flush=True)
    print(f"[{name}] layers {layers}: cold first step, Triton cache written (s from the step's start)\n"
          + (format_table(["s", "what", "name"], timeline) if timeline else "(nothing: no Triton kernel compiled)"),
          flush=True)
    if logs:
        print(f"[{name}] layers {layers}: cold first step, the backend's progress lines (s from the step's start)\n"
              + "\n".join(logs), flush=True)


def main(argv=None) -> list[list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--shape", default=None, choices=sorted(gm.SHAPES))
    ap.add_argument("--activation", default="swiglu", choices=["srelu", "swiglu"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--model", choices=["mixtral", "olmoe", "qwen3_moe"],
                    help="time this transformers family's CausalLM of --layers decoder layers on --batch x --seq "
                         "tokens (benchmarks/model_step.py's model case; needs transformers) instead of "
                         "grouped-MLP layers")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="implementations to run (default: all)")
    ap.add_argument("--profile", metavar="DIR", help="cProfile every first step into DIR (.prof files)")
    ap.add_argument("--phases", action="store_true",
                    help="print each row's cold compile phases and its Triton cache timeline")
    ap.add_argument("--profile-to", help=argparse.SUPPRESS)  # a child's profile file
    ap.add_argument("--row", type=int, nargs=2, metavar=("INDEX", "LAYERS"), help=argparse.SUPPRESS)  # a child
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.layers):
        ap.error(f"--layers must be >= 1, got {args.layers}")
    args.shape = args.shape or ("S3" if args.device == "cuda" else "tiny")
    impls = list(implementations(args.activation, args.compiler).items())
    unknown = set(args.only or ()) - {name for name, _ in impls}
    if unknown:
        ap.error(f"--only: unknown implementation(s) {sorted(unknown)}; choose from {[name for name, _ in impls]}")
    if args.row:
        (_, (run, backend)), layers = impls[args.row[0]], args.row[1]
        workload = (model_workload(args.model, layers, args) if args.model
                    else mlp_workload(run, layers, args.shape, args.activation, args.device))
        first, analyses, warm, host, phases, started = measure(workload, backend, args.device, args.profile_to)
        print(json.dumps(dict(first=first, analyses=analyses, warm=warm, host=host, phases=phases, started=started)))
        return []
    print(gm.machine_line(args.device) + (f"; transformers {transformers_version()}" if args.model else ""), flush=True)
    rows = []
    for index, (name, _) in enumerate(impls):
        if args.only and name not in args.only:
            continue
        one = None
        for layers in sorted(args.layers):
            with tempfile.TemporaryDirectory() as cache_dir:
                cold = run_row(index, layers, args, cache_dir, profile_path(args.profile, name, layers, "cold"),
                               logs=args.phases)
                if args.phases:
                    print_phases(name, layers, cold["phases"],
                                 triton_cache_timeline(os.path.join(cache_dir, "triton"), cold["started"]),
                                 [log_line_at(line, cold["started"]) for line in cold["logs"]])
                profile_to = profile_path(args.profile, name, layers, "cached")
                cached = run_row(index, layers, args, cache_dir, profile_to)
            if profile_to:
                text = io.StringIO()
                pstats.Stats(profile_to, stream=text).sort_stats("tottime").print_stats(30)
                print(f"[{name}] layers {layers}: cached first step, cProfile ({profile_to})\n"
                      + text.getvalue().split("\n", 2)[-1], flush=True)  # below pstats' file header
            one = (layers, cached["first"]) if one is None else one
            slope = (cached["first"] - one[1]) / (layers - one[0]) if layers > one[0] else None
            rows.append([name, str(layers), f"{cold['first']:.1f}", f"{cached['first']:.1f}",
                         "-" if slope is None else f"{slope:.2f}", cold["analyses"], f"{cached['warm']:.2f}",
                         f"{cached['host']:.2f}"])
            print(f"[{name}] layers {layers}: first {cold['first']:.1f} s, cached {cached['first']:.1f} s, "
                  f"warm {cached['warm']:.2f} ms, host {cached['host']:.2f} ms", flush=True)
    what = f"{args.model} CausalLM, {args.batch} x {args.seq} tokens" if args.model else f"{args.shape} {args.activation}"
    print(f"\n{what}, {args.device}, {args.compiler}")
    print(format_table(HEADERS, rows))
    return rows


if __name__ == "__main__":
    main()
