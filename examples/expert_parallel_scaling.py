"""Expert-parallel weak scaling: tokens/s per GPU of one MoE layer trained in BF16 (stock
Inductor) and in NVFP4 (the nvfp4 backend), with the all-to-all time shown apart from the
expert compute.

    for n in 1 2 4 8; do
      torchrun --nproc-per-node $n examples/expert_parallel_scaling.py --device cuda --out ep$n.json
    done
    python examples/expert_parallel_scaling.py --merge ep1.json ep2.json ep4.json ep8.json  # markdown

    torchrun --nproc-per-node 2 examples/expert_parallel_scaling.py       # CPU, gloo, tiny shapes

Without torchrun the script runs as world size 1 (the all-to-alls then only copy locally).

The layer (``MoELayer``, the dispatch of examples/distributed_moe.py's ExpertParallelMoE):
a bf16 router (replicated, top-1 or top-2 of a softmax, top-2 probabilities renormalised),
the token-expert rows sorted by expert, ``histc`` counts exchanged with an all-to-all, rows
and probabilities dispatched to the rank that owns their expert (``--experts`` / world size
experts per rank), the local grouped MLP (squared ReLU, the router probability applied
before fc2), the results sent back (combine all-to-all) and summed over the top-k. The whole
layer is compiled as one graph (``fullgraph=True``, functional collectives, split sizes from
``.tolist()`` under ``capture_scalar_outputs``); a step is its forward and backward (x needs
a gradient, as under an earlier layer). Implementations:

    bf16    the local experts as two torch._grouped_mm (benchmarks/grouped_mlp.py's bf16_mlp),
            the layer compiled with stock torch.compile (``--compiler``)
    nvfp4   the local experts as ``nv.GroupedMLP``, the layer compiled with
            ``nv.backend(compiler=--compiler)`` (the run fails if no site was rewritten)

Weak scaling: ``--tokens`` is per rank and fixed, so the global batch grows with the world
size and each rank's expert work stays about the same (tokens x top-k rows when routing is
balanced). The GPU default, 8192 tokens per rank of H = F = 4096 with 8 experts and top-1,
is benchmarks/grouped_mlp.py's S2 (8 experts, 65536 tokens, 4096, 4096) at 8 GPUs: one
expert and S2's per-expert share per rank.

Columns (each rank's median over ``--steps`` timed steps after ``--warmup``; the table shows
the largest over the ranks, since the slowest rank sets the pace of a synchronous step):

    GPUs           world size (one rank per GPU; "ranks" where the ranks are CPU processes)
    rows/rank      token-expert rows a rank's experts received, the largest over the ranks
    step ms        the compiled layer's forward + backward; every rank waits at a barrier
                   before each step, then wall clock (perf_counter) around the step with the
                   device synchronised at both ends
    tokens/s/GPU   tokens per rank / step time ("tokens/s/rank" on the CPU)
    a2a ms         the step's seven all-to-alls timed alone, in the same process, with the
                   same split sizes, dtypes and bytes: counts (int64), rows (bf16) and
                   probabilities (fp32) dispatched, results combined (bf16) in the forward;
                   the gradients of the combine, the rows and the probabilities in the
                   backward (``dist.all_to_all_single``, back to back, same timing as a step).
                   The compiled step cannot overlap them with compute: each one's output is
                   the next op's input. What the step's collectives pay beyond this (the
                   compiled graph's own launches, the ``.tolist()`` host sync) stays in "rest"
    a2a %          a2a ms / step ms
    experts ms     the local grouped MLP's forward + backward timed alone, compiled the same
                   way, on random rows with this rank's received group sizes
    rest ms        step - a2a - experts: router, sorting and gathers, the host sync on the
                   split sizes, launch overhead (medians of separate runs: can be slightly
                   negative when it is small)
    peak MiB       one more step's peak device memory above what was allocated before it
                   (activations, saved tensors, gradients, transient copies; the weights and
                   inputs excluded), the largest over the ranks; CUDA only ("-" elsewhere)

On CUDA the timings are wall clock around synchronised steps (not triton's do_bench: its
repetition count is chosen per process, and ranks running different counts of a
collective would hang). On the CPU (gloo) the same perf_counter medians; the numbers there
only show that the script runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

import nvfp4_inductor as nv
from nvfp4_inductor.inspection import format_table

BF16 = torch.bfloat16
IMPLEMENTATIONS = ("bf16", "nvfp4")
DEFAULTS = {  # tokens per rank, hidden, ffn, experts, steps, warmup
    "cuda": dict(tokens=8192, hidden=4096, ffn=4096, experts=8, steps=20, warmup=3),
    "cpu": dict(tokens=64, hidden=64, ffn=64, experts=4, steps=5, warmup=1),
}
HEADERS = ["GPUs", "implementation", "tokens/rank", "rows/rank", "step ms", "tokens/s/GPU", "a2a ms", "a2a %",
           "experts ms", "rest ms", "peak MiB"]


def headers(devices) -> list[str]:
    """HEADERS for runs on `devices` ("cuda" / "cpu"): one rank per GPU on CUDA; anywhere
    else a rank is a process, and the columns say ranks."""
    if all(device == "cuda" for device in devices):
        return HEADERS
    return [{"GPUs": "ranks", "tokens/s/GPU": "tokens/s/rank"}.get(h, h) for h in HEADERS]


class BF16GroupedMLP(nn.Module):
    """The local experts in BF16: fc1, squared ReLU x router probability, fc2, each a
    torch._grouped_mm (benchmarks/grouped_mlp.py's bf16_mlp("srelu")); GroupedMLP's layout."""

    def __init__(self, fc1_weight, fc2_weight):
        super().__init__()
        self.fc1_weight, self.fc2_weight = nn.Parameter(fc1_weight.clone()), nn.Parameter(fc2_weight.clone())

    def forward(self, x, group_sizes, probs):
        offs = torch.cumsum(group_sizes, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, self.fc1_weight.transpose(-2, -1), offs=offs)
        d = (torch.relu(h.float()) ** 2 * probs[:, None]).to(BF16)
        return torch._grouped_mm(d, self.fc2_weight.transpose(-2, -1), offs=offs)


class MoELayer(nn.Module):
    """Router, dispatch all-to-all, the rank's `experts` (E / world of them), combine all-to-all."""

    def __init__(self, gate: nn.Linear, experts: nn.Module, num_experts: int, top_k: int):
        super().__init__()
        self.gate, self.experts, self.top_k = gate, experts, top_k
        self.world = dist.get_world_size()
        # the group by name: Dynamo then holds no ProcessGroup object, which would outlive
        # destroy_process_group and be freed only as the interpreter exits
        self.group_name = dist.group.WORLD.group_name
        self.total, self.local = num_experts, num_experts // self.world

    def route(self, x):
        """Probabilities of the token-expert rows sorted by expert, their order, the counts."""
        probs, ids = torch.softmax(self.gate(x).float(), dim=-1).topk(self.top_k, dim=-1)
        if self.top_k > 1:
            probs = probs / probs.sum(-1, keepdim=True)
        ids = ids.reshape(-1)  # row i is token i // top_k
        order = torch.argsort(ids, stable=True)
        counts = torch.histc(ids.float(), bins=self.total, min=0, max=self.total - 1).to(torch.int64)
        return probs.reshape(-1)[order], order, counts

    def forward(self, x):
        group, world, local, k = self.group_name, self.world, self.local, self.top_k
        probs, order, counts = self.route(x)
        received = funcol.all_to_all_single(counts, None, None, group)  # per source rank, per local expert
        send = counts.view(world, local).sum(1).tolist()
        recv = received.view(world, local).sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(x[order // k], recv, send, group)
        p = funcol.all_to_all_single_autograd(probs, recv, send, group)
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(world), received,
                                                output_size=rows.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)
        y = self.experts(rows[by_expert], received.view(world, local).sum(0), p[by_expert])
        y = funcol.all_to_all_single_autograd(y[torch.argsort(by_expert)], send, recv, group)
        y = y[torch.argsort(order)]
        return y if k == 1 else y.view(-1, k, y.shape[-1]).sum(1)


# ----------------------------------------------------------------------------- timing


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, steps: int, warmup: int) -> float:
    """This rank's median wall time of fn, the ranks lined up at a barrier before each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync(device)
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_peak_mib(step, device):
    """One step's peak device memory in MiB above what was allocated before it; None off CUDA."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def slowest(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_ranks(ok: bool, device) -> bool:
    t = torch.tensor([int(ok)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def all_to_all_ms(layer: MoELayer, x, device, steps, warmup):
    """The step's seven all-to-alls alone (see the docstring); the rows this rank received, and
    their count per local expert."""
    world, local, hidden = layer.world, layer.local, x.shape[1]
    with torch.no_grad():
        _, _, counts = layer.route(x)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    send = counts.view(world, local).sum(1).tolist()
    recv = received.view(world, local).sum(1).tolist()
    n_send, n_recv = sum(send), sum(recv)

    def buf(n, dtype, cols=()):
        return torch.randn(n, *cols, device=device).to(dtype)

    pairs = [  # (input, output, output splits, input splits)
        (counts, torch.empty_like(counts), None, None),
        (buf(n_send, BF16, (hidden,)), buf(n_recv, BF16, (hidden,)), recv, send),  # rows
        (buf(n_send, torch.float32), buf(n_recv, torch.float32), recv, send),  # probabilities
        (buf(n_recv, BF16, (hidden,)), buf(n_send, BF16, (hidden,)), send, recv),  # combine
        (buf(n_send, BF16, (hidden,)), buf(n_recv, BF16, (hidden,)), recv, send),  # d(combine)
        (buf(n_recv, BF16, (hidden,)), buf(n_send, BF16, (hidden,)), send, recv),  # d(rows)
        (buf(n_recv, torch.float32), buf(n_send, torch.float32), send, recv),  # d(probabilities)
    ]

    def run():
        for inp, out, out_splits, in_splits in pairs:
            dist.all_to_all_single(out, inp, out_splits, in_splits)

    return median_ms(run, device, steps, warmup), n_recv, received.view(world, local).sum(0)


def experts_ms(experts, backend, rows: int, sizes, hidden, device, steps, warmup) -> float:
    """The local grouped MLP's forward + backward alone, compiled as in the layer."""
    x = torch.randn(rows, hidden, device=device).to(BF16).requires_grad_()
    probs = torch.rand(rows, device=device).requires_grad_()
    dy = torch.randn(rows, hidden, device=device).to(BF16)
    compiled = torch.compile(experts, backend=backend, fullgraph=True)

    def step():
        experts.zero_grad(set_to_none=True)
        torch.autograd.grad(compiled(x, sizes, probs), (x, probs, *experts.parameters()), dy)

    return median_ms(step, device, steps, warmup)


# ----------------------------------------------------------------------------- one run


def build(impl: str, args, device, rank):
    """The gate (same on every rank) and this rank's experts (seeded by rank), same weights
    for both implementations."""
    torch.manual_seed(0)
    gate = nn.Linear(args.hidden, args.experts, bias=False, dtype=BF16, device=device)
    torch.manual_seed(1 + rank)
    local = args.experts // dist.get_world_size()
    experts = nv.GroupedMLP(local, args.hidden, args.ffn, recipe=nv.Recipe(), device=device)
    if impl == "bf16":
        return gate, BF16GroupedMLP(experts.fc1_weight.detach(), experts.fc2_weight.detach()), args.compiler
    return gate, experts, nv.backend(compiler=args.compiler)


def run_implementation(impl: str, args, device) -> dict:
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    gate, experts, backend = build(impl, args, device, rank)
    layer = MoELayer(gate, experts, args.experts, args.top_k)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, BF16).requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, generator=gen).to(device, BF16)
    sites = counters["nvfp4"]["sites_rewritten"]
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    out = {}

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        y = compiled(x)
        y.backward(dy)
        out["y"] = y

    start = time.perf_counter()
    step()
    sync(device)
    first_s = time.perf_counter() - start
    if impl == "nvfp4" and counters["nvfp4"]["sites_rewritten"] == sites:
        raise RuntimeError("the nvfp4 backend rewrote no site in the layer: the nvfp4 row would not be NVFP4")
    step_ms = median_ms(step, device, args.steps, args.warmup)
    peak = step_peak_mib(step, device)
    finite = all_ranks(bool(torch.isfinite(out["y"]).all() and torch.isfinite(x.grad).all()), device)
    a2a, rows, sizes = all_to_all_ms(layer, x.detach(), device, args.steps, args.warmup)
    alone = experts_ms(experts, backend, rows, sizes, args.hidden, device, args.steps, args.warmup)
    step_ms, a2a, alone = (slowest(v, device) for v in (step_ms, a2a, alone))
    return {"implementation": impl, "world": world, "tokens_per_rank": args.tokens,
            "rows_per_rank_max": int(slowest(rows, device)), "step_ms": step_ms,
            "tokens_per_s_per_gpu": args.tokens / step_ms * 1e3, "a2a_ms": a2a, "experts_ms": alone,
            "rest_ms": step_ms - a2a - alone, "peak_mib": None if peak is None else slowest(peak, device),
            "first_step_s": slowest(first_s, device), "finite": finite}


def table_rows(results: list[dict]) -> list[list[str]]:
    return [[r["world"], r["implementation"], r["tokens_per_rank"], r["rows_per_rank_max"], f"{r['step_ms']:.3f}",
             f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['a2a_ms']:.3f}", f"{100 * r['a2a_ms'] / r['step_ms']:.0f}",
             f"{r['experts_ms']:.3f}", f"{r['rest_ms']:.3f}",
             "-" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"] for r in results]


def merge(paths) -> str:
    """One markdown table from the --out JSONs of several world sizes."""
    runs = sorted((json.load(open(p)) for p in paths), key=lambda run: run["world"])
    lines = []
    for run in runs:
        lines.append(f"* {run['world']} x {run['device_name']}, {run['date']}, torch {run['torch']}, "
                     f"compiler={run['compiler']}: `{run['command']}`")
    rows = [row for run in runs for row in table_rows(run["rows"])]
    lines += ["", "| " + " | ".join(headers(run["device"] for run in runs)) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- arguments


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--compiler", default=None, choices=("inductor", "aot_eager"),
                        help="stock torch.compile backend for bf16, and what compiles nvfp4's rewritten graphs "
                             "(default: inductor on cuda, aot_eager on cpu)")
    parser.add_argument("--tokens", type=int,
                        help="tokens per rank, fixed (weak scaling); default 8192 on cuda, 64 on cpu")
    parser.add_argument("--hidden", type=int, help="H; default 4096 on cuda, 64 on cpu")
    parser.add_argument("--ffn", type=int, help="F; default 4096 on cuda, 64 on cpu")
    parser.add_argument("--experts", type=int,
                        help="experts in all (split over the ranks); default 8 on cuda, 4 on cpu")
    parser.add_argument("--top-k", type=int, default=1, choices=(1, 2))
    parser.add_argument("--steps", type=int, help="timed steps per measurement; default 20 on cuda, 5 on cpu")
    parser.add_argument("--warmup", type=int, help="untimed steps before them; default 3 on cuda, 1 on cpu")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--out", help="write the results as JSON here (rank 0)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="print one markdown table from --out files, no run")
    args = parser.parse_args(argv)
    if args.merge:
        return args
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.compiler = args.compiler or ("inductor" if args.device == "cuda" else "aot_eager")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name in ("tokens", "hidden", "ffn", "experts", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1; got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0; got {args.warmup}")
    for name in ("hidden", "ffn"):
        if getattr(args, name) % 16:
            parser.error(f"--{name} must be a multiple of 16 (NVFP4 blocks of 16); got {getattr(args, name)}")
    if args.experts % world:
        parser.error(f"--experts ({args.experts}) must be divisible by the world size ({world}): "
                     f"each rank holds experts / world of them")
    if args.top_k > args.experts:
        parser.error(f"--top-k ({args.top_k}) must not exceed --experts ({args.experts})")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible")
        if world > torch.cuda.device_count():
            parser.error(f"world size {world} > {torch.cuda.device_count()} visible CUDA devices (one rank per GPU)")
    return args


def single_process_env() -> bool:
    """Without torchrun: world size 1 on a free local port (True then)."""
    if "RANK" in os.environ:
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        print(merge(args.merge))
        return 0
    launcher = ["python"] if single_process_env() else ["torchrun", f"--nproc-per-node={os.environ['WORLD_SIZE']}"]
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    torch._dynamo.config.capture_scalar_outputs = True  # the split sizes' .tolist() stays in the graph
    rank, world = dist.get_rank(), dist.get_world_size()
    results = [run_implementation(impl, args, device) for impl in args.implementations]
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"world size {world} ({dist.get_backend()}), {name}, compiler={args.compiler}, H={args.hidden} "
              f"F={args.ffn} experts={args.experts} ({args.experts // world} per rank) top-{args.top_k}, "
              f"median of {args.steps} steps, slowest rank")
        print(format_table(headers([device.type]), table_rows(results)))
        if not all(r["finite"] for r in results):
            print("non-finite outputs or input gradients: " + ", ".join(
                r["implementation"] for r in results if not r["finite"]))
        if args.out:
            run = {"world": world, "device": args.device, "device_name": name, "backend": dist.get_backend(),
                   "compiler": args.compiler, "torch": torch.__version__,
                   "date": datetime.date.today().isoformat(),
                   "command": " ".join([*launcher, *map(shlex.quote, sys.argv)]),
                   "args": {k: v for k, v in vars(args).items() if k not in ("out", "merge")}, "rows": results}
            with open(args.out, "w") as f:
                json.dump(run, f, indent=1)
    ok = all(r["finite"] for r in results)
    # Every rank leaves together, as tests/distributed_scenarios.py does: CI once saw rank 0 (the
    # store's host) abort in teardown ("terminate called without an active exception") after
    # rank 1, done earlier (it writes no table), had already destroyed its group and exited.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
