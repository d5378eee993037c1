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
from nvfp4_inductor import ops  # noqa: E402
from nvfp4_inductor.compiler import fused  # noqa: E402
from nvfp4_inductor.lowerings.triton import TRITON  # noqa: E402


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


def use_lowering(lowering) -> None:
    """Run the fused ops, and the eager GEMM ops their backward calls for fc1, on `lowering`."""
    fused.lowering_for_device = ops.lowering_for_device = lambda device: lowering


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--activation", default="swiglu", choices=["srelu", "tanh_srelu", "swiglu"])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    counts = stub_launches()
    use_lowering(TRITON)
    g, t, h, f = args.groups, 32 * args.groups, 256, 128
    f1 = 2 * f if args.activation == "swiglu" else f
    sizes = torch.full((g,), t // g)
    x, dy = torch.randn(t, h).bfloat16(), torch.randn(t, h).bfloat16()
    w1, w2 = torch.randn(g, f1, h).bfloat16(), torch.randn(g, h, f).bfloat16()
    probs = torch.rand(t)
    clamp = 1.0 if args.activation == "tanh_srelu" else None

    def step(recompute):
        fwd = fused.grouped_mlp_fwd(x, w1, w2, sizes, probs, args.activation, clamp, True, 0xD7E8, True, True,
                                    recompute)
        fused.grouped_mlp_bwd(dy, fwd[1], probs, sizes, *fwd[2:], args.activation, clamp, True, 0xD7E8, True,
                              recompute)

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
        fwd, in_fwd = launches(lambda: fused.grouped_mlp_fwd(x, w1, w2, sizes, probs, args.activation, clamp, True,
                                                             0xD7E8, True, True, recompute))
        _, in_bwd = launches(lambda: fused.grouped_mlp_bwd(dy, fwd[1], probs, sizes, *fwd[2:], args.activation, clamp,
                                                           True, 0xD7E8, True, recompute))
        print(f"recompute={recompute}: {ms:.2f} ms host time per fwd+bwd step\n  forward launches:  {in_fwd}\n"
              f"  backward launches: {in_bwd}")


if __name__ == "__main__":
    main()
