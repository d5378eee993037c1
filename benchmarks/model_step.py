"""Question: what does a transformers MoE model, unchanged, cost per training step with the
backend, against BF16 under stock Inductor in the same process? (benchmarks/grouped_mlp.py
measures our GroupedMLP alone; this runs the models users bring, routers, attention and
all, through ``torch.compile(model, backend="nvfp4")``.)

Families, each at its published sizes (experts, H, F, top-k; transformers' default config,
OLMoE's F set to OLMoE-1B-7B's 1024):
  mixtral    8 experts, H 4096, F 14336, top-2, SwiGLU
  olmoe      64 experts, H 2048, F 1024, top-8, SwiGLU
  qwen3_moe  128 experts, H 2048, F 768, top-8, SwiGLU
Cases:
  block      the first decoder layer's sparse MoE block (router + experts) on --tokens hidden
             states; loss = mean square of its output, gradients of the block's weights and
             of its input;
  model      the whole CausalLM with --layers decoder layers on --batch x --seq random token
             ids, its own cross-entropy loss on them as labels, gradients of every weight.
Weights and activations in bf16 (no fp32 master weights, no optimizer step), the experts on
transformers' "grouped_mm" implementation (what the backend matches). Routing comes from the
randomly initialised router, the same for both rows (same seed).

Rows: "bf16 compiled" (stock Inductor, the baseline), then "nvfp4 compiled"
(backend="nvfp4"), each on a fresh build of the model, compiled with dynamic=False.
--reuse-weights adds "nvfp4, weights reused" (graphs off): the backend option
reuse_weight_casts, every step inside one ``nv.reuse_weight_casts()`` block, so each timed
step is a later micro-batch of gradient accumulation, whose expert weights the first step
cast; the note gives the memory the kept copies hold (the peak's base, taken after the
first step, includes them).
--host-sample attaches py-spy to each row's warm steps (graphs off) and prints where the
host time goes, as ``grouped_mlp.py --host-sample`` does (its docstring says how to carry
py-spy to a machine without network): the host ms column says how much, this says where.
--checkpoint runs every row under activation checkpointing: the model case with transformers'
``model.gradient_checkpointing_enable()`` (each decoder layer; ``use_cache`` off), the block
case with torch.utils.checkpoint around the block; both compiled with
``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` (else Dynamo leaves each
checkpointed layer out of the graph, for stock Inductor as for the backend: the context
variable transformers' hub-kernel decorators set).
Columns:
  graphs          CUDA graphs off, or on: both rows compiled with mode="reduce-overhead"
                  (Inductor's CUDA graph trees); no peak then (replays bypass the caching
                  allocator), and the note says "graphs skipped" where Inductor declined them.
  ms, vs bf16     forward + backward, median of triton.testing.do_bench (L2 flushed).
  host ms         time to enqueue one step without waiting for the GPU (two steps back to back,
                  median of five rounds): where it reaches "ms" the step is host-bound (or
                  waited on a full launch queue: a whole model launches hundreds of kernels).
  peak GiB        peak allocated during one step above what was allocated before it (weights
                  and inputs excluded, gradients included); CUDA only.
  first s         the first step: Dynamo, AOTAutograd, Inductor and Triton compiles, with
                  whatever Inductor's and Triton's caches on this machine already hold.
  loss            the first step's loss (the same weights and data in both rows).
  sites           grouped MLPs the backend rewrote / found (counters["nvfp4"]); "-" for BF16.
  graph breaks    Dynamo's graph breaks in the compile (the model's own code).
  note            "cudaMalloc N a step" where warm steps (graphs off, CUDA) still make the
                  caching allocator call cudaMalloc (``grouped_mlp.device_allocs``; each such
                  call, and the cudaFree before it, waits for the device); the kept copies.

    python benchmarks/model_step.py [--families mixtral olmoe qwen3_moe] [--cases block model]
        [--tokens 8192] [--layers 4] [--batch 2] [--seq 2048] [--device cuda|cpu]
        [--compiler inductor|aot_eager] [--graphs off on] [--reuse-weights] [--checkpoint] [--host-sample]
        [--tiny]

Needs transformers (the test extra). ``--device cpu --tiny --compiler aot_eager`` is the CPU
smoke run (tests/test_benchmark_grouped_mlp_smoke.py): tiny sizes, perf_counter timing, no peak.
Each row is printed as it finishes and the table last; SIGINT (``timeout -s INT``) prints the
rows measured so far.
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from typing import Callable, NamedTuple, Optional

import torch
from torch._dynamo.utils import counters

from grouped_mlp import (bench_ms, device_allocs, find_py_spy, host_ms, host_sample, kept_note, machine_line,
                         progress_clock, ratio, step_peak, table_of)

# Published sizes where transformers' default config differs (OLMoE-1B-7B's expert width).
FAMILIES = {
    "mixtral": ("MixtralConfig", {}),
    "olmoe": ("OlmoeConfig", {"intermediate_size": 1024}),
    "qwen3_moe": ("Qwen3MoeConfig", {}),
}
# --tiny: every family at CPU size (hidden 64, 4 experts of width 32, top-2, a 128-token vocab).
TINY = dict(hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
            num_experts_per_tok=2, vocab_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            max_position_embeddings=256)
IMPLEMENTATIONS = {"bf16 compiled": "inductor", "nvfp4 compiled": "nvfp4"}
REUSE = "nvfp4, weights reused"  # --reuse-weights: a third row, backend "nvfp4-reuse"
HEADERS = ["case", "family", "experts, H, F, k", "tokens", "implementation", "graphs", "ms", "vs bf16", "host ms",
           "peak GiB", "peak/bf16", "first s", "loss", "sites", "graph breaks", "note"]


def config_for(family: str, layers: int, tiny: bool):
    import transformers

    name, published = FAMILIES[family]
    config = getattr(transformers, name)(**(TINY if tiny else published))
    config.num_hidden_layers = layers
    if hasattr(config, "mlp_only_layers"):  # Qwen3-MoE: every layer sparse
        config.mlp_only_layers = []
    return config


def sizes_of(config) -> str:
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return f"{experts}, {config.hidden_size}, {ffn}, {config.num_experts_per_tok}"


def build_model(config, device):
    """The CausalLM on `device`, bf16, experts on transformers' grouped_mm implementation."""
    import transformers

    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm",
                                                             dtype=torch.bfloat16)


class BlockLoss(torch.nn.Module):
    """Mean square of an MoE block's output: a scalar loss over the block alone, the block
    under activation checkpointing where `checkpointed`."""

    def __init__(self, block, checkpointed=False):
        super().__init__()
        self.block, self.checkpointed = block, checkpointed

    def forward(self, hidden_states):
        if self.checkpointed:
            out = torch.utils.checkpoint.checkpoint(self.block, hidden_states, use_reentrant=False)
        else:
            out = self.block(hidden_states)
        out = out[0] if isinstance(out, tuple) else out  # releases that also return router logits
        return out.float().square().mean()


class ModelLoss(torch.nn.Module):
    """The CausalLM's own loss with the input ids as labels."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss


class Case(NamedTuple):
    module: torch.nn.Module  # returns the scalar loss
    inputs: tuple
    wrt: list  # what the step differentiates
    tokens: int


def make_case(case: str, config, opts) -> Case:
    model = build_model(config, opts.device)
    gen = torch.Generator(device=opts.device).manual_seed(1)
    if case == "block":
        block = model.model.layers[0].mlp
        del model
        x = torch.randn(1, opts.tokens, config.hidden_size, device=opts.device, generator=gen,
                        dtype=torch.bfloat16).requires_grad_()
        return Case(BlockLoss(block, opts.checkpoint), (x,), list(block.parameters()) + [x], opts.tokens)
    if opts.checkpoint:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False  # else a warning is logged at every step: a graph break
    ids = torch.randint(config.vocab_size, (opts.batch, opts.seq), device=opts.device, generator=gen)
    return Case(ModelLoss(model), (ids,), list(model.parameters()), opts.batch * opts.seq)


class Measured(NamedTuple):
    ms: float
    host: float
    peak: Optional[int]
    first_s: float
    loss: float
    sites: str
    graph_breaks: int
    note: str  # "graphs skipped"; cudaMalloc calls of a warm step; the kept copies' memory


def training_step(compiled, c: Case, graphs: bool) -> Callable[[], None]:
    """With graphs, each step first tells Inductor's CUDA graph trees that an iteration
    begins (no step reads the previous one's outputs)."""

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        torch.autograd.grad(compiled(*c.inputs), c.wrt)

    return step


def measure(c: Case, backend: str, graphs: bool, opts) -> Measured:
    """One row: `c` compiled by `backend` ("inductor", "nvfp4" or "nvfp4-reuse", whose
    steps all run inside one reuse_weight_casts block), its first step, then its peak, timed
    steps and host time."""
    if backend != "nvfp4-reuse":
        return _measure(c, backend, graphs, opts)
    import nvfp4_inductor as nv

    with nv.reuse_weight_casts() as reuse:
        m = _measure(c, backend, graphs, opts)
        return m._replace(note="; ".join(filter(None, [m.note, kept_note(reuse.kept_bytes)])))


def _measure(c: Case, backend: str, graphs: bool, opts) -> Measured:
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=opts.checkpoint):
        return _measure_compiled(c, backend, graphs, opts)


def _measure_compiled(c: Case, backend: str, graphs: bool, opts) -> Measured:
    counters.clear()
    mode = "reduce-overhead" if graphs else None
    compiled = torch.compile(c.module, backend=_backend(backend, opts.compiler), mode=mode, dynamic=False)
    step = training_step(compiled, c, graphs)
    start = time.perf_counter()
    loss = compiled(*c.inputs)
    torch.autograd.grad(loss, c.wrt)
    loss = loss.item()  # waits for the whole step (the backward is queued before it); read now, as
    # a later replay may overwrite a graph's output
    first_s = time.perf_counter() - start
    peak = step_peak(step) if opts.device == "cuda" and not graphs else None  # replays bypass the allocator
    found = counters["nvfp4"]["sites_rewritten"] + counters["nvfp4"]["sites_rejected"]
    sites = f"{counters['nvfp4']['sites_rewritten']}/{found}" if backend != "inductor" else "-"
    graph_breaks = sum(counters["graph_break"].values())
    notes = ["graphs skipped"] if counters["inductor"]["cudagraph_skips"] else []
    allocs = device_allocs(step) if opts.device == "cuda" and not graphs else 0
    notes += [f"cudaMalloc {allocs:.1f} a step"] if allocs else []
    note = "; ".join(notes)
    measured = Measured(bench_ms(step, opts.device, warmup=100, rep=500), host_ms(step, opts.device, steps=2), peak,
                        first_s, loss, sites, graph_breaks, note)
    if opts.py_spy and not graphs:
        print(f"[{backend}] host samples of a warm step:\n{host_sample(step, opts.device, opts.py_spy)}", flush=True)
    return measured


def _backend(name: str, compiler: str):
    if name.startswith("nvfp4"):
        import nvfp4_inductor as nv

        return nv.backend(compiler=compiler, reuse_weight_casts=name == "nvfp4-reuse")
    return compiler


def run(case: str, family: str, graphs: bool, opts, clock):
    """Yields the rows of one case, family and graphs setting, each printed when done."""
    config = config_for(family, 1 if case == "block" else opts.layers, opts.tiny)
    base = None
    implementations = dict(IMPLEMENTATIONS, **{REUSE: "nvfp4-reuse"} if opts.reuse_weights and not graphs else {})
    for name, backend in implementations.items():
        lead = [case, family, sizes_of(config), "-", name, "on" if graphs else "off"]
        try:
            c = make_case(case, config, opts)
            lead[3] = str(c.tokens)
            m = measure(c, backend, graphs, opts)
        except Exception as error:  # a failing row is reported, not hidden
            row = lead + ["-"] * (len(HEADERS) - len(lead) - 1) + [f"failed: {type(error).__name__}: {error}"[:100]]
        else:
            base = m if backend == "inductor" else base
            row = lead + [f"{m.ms:.2f}", ratio(m.ms, base and base.ms), f"{m.host:.2f}",
                          "-" if m.peak is None else f"{m.peak / 2**30:.2f}", ratio(m.peak, base and base.peak),
                          f"{m.first_s:.1f}", f"{m.loss:.4f}", m.sites, str(m.graph_breaks), m.note]
        finally:
            c = None  # the next row builds its own model: free this one's memory first
            torch._dynamo.reset()  # (Dynamo's caches hold the compiled module)
            gc.collect()
            if opts.device == "cuda":
                torch.cuda.empty_cache()
        clock(" | ".join(row))
        yield row


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--cases", nargs="+", default=["block", "model"], choices=["block", "model"])
    parser.add_argument("--tokens", type=int, default=8192, help="hidden states through the block case")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model case")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"],
                        help="what compiles every row (aot_eager: a fast CPU smoke run)")
    parser.add_argument("--graphs", nargs="+", default=["off"], choices=["off", "on"],
                        help="CUDA graphs (mode='reduce-overhead', both rows) off, on, or both")
    parser.add_argument("--reuse-weights", action="store_true",
                        help="a third row: nvfp4 with the weights' casts reused (a later micro-batch), graphs off")
    parser.add_argument("--checkpoint", action="store_true",
                        help="every row under activation checkpointing (the model: each decoder layer)")
    parser.add_argument("--host-sample", action="store_true",
                        help="py-spy samples of each row's warm steps (graphs off): where the host time goes")
    parser.add_argument("--tiny", action="store_true", help="CPU sizes for every family (smoke run)")
    opts = parser.parse_args(argv)
    opts.graphs = [g == "on" for g in opts.graphs]
    if True in opts.graphs and (opts.device != "cuda" or opts.compiler != "inductor"):
        parser.error("--graphs on needs --device cuda and --compiler inductor (CUDA graphs are an Inductor mode)")
    return opts


def main(argv=None) -> list[list[str]]:
    """Run the benchmark; print each row as it is measured and the table last. Returns the rows."""
    opts = parse_args(argv)
    clock = progress_clock()
    clock(machine_line(opts.device))
    opts.py_spy = find_py_spy(opts.host_sample, clock)
    # Dynamo warns once per transformers helper it traces through (lru_cache wrappers): not ours to fix
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")

    def rows():
        for case in opts.cases:
            for family in opts.families:
                for graphs in opts.graphs:
                    yield from run(case, family, graphs, opts, clock)

    return table_of(rows(), HEADERS, clock)


if __name__ == "__main__":
    main()
