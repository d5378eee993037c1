"""How much host (Python) time does one NVFP4 grouped-MLP training step cost outside the
kernels themselves? Runs on any machine, no GPU needed.

The compiled path's fused ops (compiler/fused.py grouped_mlp_fwd + grouped_mlp_bwd) run on
the Triton lowering with every kernel launch replaced by a counter, on small CPU tensors:
what is left is the wrappers' work (checks, allocations, configs, op dispatch). Shapes
with little GPU work per step (S3 in benchmarks/grouped_mlp.py: ~3.7 ms of kernels) are
bound by it when it approaches the GPU time. Triton's own launch cost is not included.

    python benchmarks/host_overhead.py [--activation swiglu] [--groups 32] [--steps 50]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import pkgutil
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors take the Triton kernels' host code
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import nvfp4_inductor.kernels as kernels  # noqa: E402
from nvfp4_inductor import lowerings  # noqa: E402
from nvfp4_inductor.compiler import fused  # noqa: E402
from nvfp4_inductor.program import SiteOptions  # noqa: E402
from nvfp4_inductor.recipe import Recipe  # noqa: E402
from nvfp4_inductor.saved import SavedForBackward  # noqa: E402


def stub_launches() -> collections.Counter:
    """Replace ``launch`` in every kernels module by a counter of kernel names."""
    counts = collections.Counter()

    def count(kernel, grid, **kwargs):
        counts[kernel.__name__] += 1

    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        if hasattr(module, "launch"):
            module.launch = count
    return counts


def triton_here(inline: bool = False) -> str:
    """Register, as the most preferred target, one that runs the Triton steps on every
    device (CPU tensors through the kernels' host code) with the Triton target's
    capabilities, and return its name for the fused ops' plan arguments. `inline`: its
    fused ops are traced as their launches (``Target.inline``), as the Triton target's on a GPU."""
    triton = lowerings.get_target("triton")
    caps = triton.probe(torch.device("cpu"))
    name = "triton_here_inlined" if inline else "triton_here"
    if name not in [t.name for t in lowerings.targets()]:
        lowerings.register_target(lowerings.Target(name, triton.steps, lambda device: caps, inline=lambda: inline))
    return name


def fused_step(x, w1, w2, sizes, probs, dy, activation, clamp, recompute, target, *, backward=True):
    """The fused forward op, then the backward ops, with every fused kernel planned,
    RHT, the default sign mask and stochastic rounding; returns (forward outputs, grads)."""
    plan = lowerings.Plan(target, True, lowerings.get_target(target).probe(x.device).fused_amax, True, "")
    options = SiteOptions(activation, clamp, Recipe(), plan, recompute=recompute)
    fwd = fused.grouped_mlp_fwd(x, w1, w2, sizes, probs, **fused.schema_kwargs(options))
    if not backward:
        return fwd, None
    return fwd, fused.grouped_mlp_bwd(dy, SavedForBackward.unflatten(fwd[1:]), probs, sizes, options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--activation", default="swiglu", choices=["srelu", "tanh_srelu", "swiglu"])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    counts = stub_launches()
    target = triton_here()
    g, t, h, f = args.groups, 32 * args.groups, 256, 128
    f1 = 2 * f if args.activation == "swiglu" else f
    sizes = torch.full((g,), t // g)
    x, dy = torch.randn(t, h).bfloat16(), torch.randn(t, h).bfloat16()
    w1, w2 = torch.randn(g, f1, h).bfloat16(), torch.randn(g, h, f).bfloat16()
    probs = torch.rand(t)
    clamp = 1.0 if args.activation == "tanh_srelu" else None

    def step(recompute, backward=True):
        return fused_step(x, w1, w2, sizes, probs, dy, args.activation, clamp, recompute, target, backward=backward)

    def launches(fn):  # kernel name -> launches in one call of fn
        counts.clear()
        out = fn()
        return out, ", ".join(f"{k} {v}" for k, v in counts.most_common())

    for recompute in (True, False):
        for _ in range(3):
            step(recompute)
        counts.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(recompute)
        ms = (time.perf_counter() - start) / args.steps * 1e3
        _, in_fwd = launches(lambda: step(recompute, backward=False))
        _, in_step = launches(lambda: step(recompute))
        in_bwd = in_step  # forward + backward; the forward's launches are listed above
        print(f"recompute={recompute}: {ms:.2f} ms host time per fwd+bwd step\n  forward launches:  {in_fwd}\n"
              f"  forward + backward launches: {in_bwd}")


if __name__ == "__main__":
    main()
