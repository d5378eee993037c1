"""What is alive at the memory peak of one NVFP4 grouped-MLP training step? CPU only.

Runs the fused fwd + bwd op bodies (compiler/fused.py) on the Triton lowering at a
benchmarks/grouped_mlp.py shape with every kernel launch stubbed (host_overhead.py), on
uninitialised CPU tensors: the allocations are the GPU run's, the values are not. A
TorchDispatchMode counts each new storage until its last tensor dies; the script prints
the peak of live bytes (inputs excluded, Y kept alive through the backward as autograd
does) and what was alive at it, by allocation site. The GPU peak for S1 srelu was
1.11 GiB (2026-11-29); this model gave 1132 MiB for the same code. It keeps what an op body allocates
alive as the eager body does, longer than Inductor's compiled step, so it can name a peak
the GPU does not have (S4 srelu 1744 MiB here, 1643 on an H100, where the casts'
packed copies were already freed; a change it credited with -131 MiB gave -30). What a
compiled step holds at its GPU peak: ``grouped_mlp.py --peak-alive``.

    python benchmarks/memory_model.py [--shape S1] [--activation srelu] [--no-recompute]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import stub_launches, triton_here  # noqa: E402  (sets TRITON_INTERPRET for CPU tensors)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from grouped_mlp import SHAPES  # noqa: E402
from nvfp4_inductor import lowerings, ops  # noqa: E402
from nvfp4_inductor.program import SiteOptions, fc1_wgrad_last  # noqa: E402
from nvfp4_inductor.recipe import Recipe  # noqa: E402
from nvfp4_inductor.compiler import fused  # noqa: E402
from nvfp4_inductor.saved import SavedForBackward  # noqa: E402

MiB = 2**20


def allocation_site() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "nvfp4_inductor" in frame.filename and "_registry" not in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


class LiveBytes(TorchDispatchMode):
    """Live storage bytes created under the mode; `peak` and the live set at the peak."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.at_peak = {}, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                self._track(t)
        return out

    def _track(self, t):
        key = t.untyped_storage().data_ptr()
        if key not in self.live:
            self.live[key] = [t.untyped_storage().nbytes(), 0, allocation_site()]
            self.now += self.live[key][0]
            if self.now > self.peak:
                self.peak, self.at_peak = self.now, [(n, site) for n, _, site in self.live.values()]
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="S1", choices=sorted(SHAPES))
    parser.add_argument("--activation", default="srelu", choices=["srelu", "tanh_srelu", "swiglu"])
    parser.add_argument("--no-recompute", dest="recompute", action="store_false")
    args = parser.parse_args()
    stub_launches()
    target = triton_here()
    g, t, h, f, _ = SHAPES[args.shape]
    f1 = 2 * f if args.activation == "swiglu" else f
    clamp = 1.0 if args.activation == "tanh_srelu" else None
    sizes = torch.full((g,), t // g)
    x, dy = torch.empty(t, h, dtype=torch.bfloat16), torch.empty(t, h, dtype=torch.bfloat16)
    w1, w2 = torch.empty(g, f1, h, dtype=torch.bfloat16), torch.empty(g, h, f, dtype=torch.bfloat16)
    probs = torch.rand(t)
    plan = lowerings.Plan(target, True, lowerings.get_target(target).probe(x.device).fused_amax, True, "")
    options = fused.schema_kwargs(SiteOptions(args.activation, clamp, Recipe(), plan, recompute=args.recompute))
    with LiveBytes() as mode:  # the op bodies: a mode sees a custom op as one call
        y, *saved = fused.grouped_mlp_fwd._init_fn(x, w1, w2, sizes, probs, **options)
        forward_peak, after_forward = mode.peak, mode.now
        # the backward's three ops (fused.grouped_mlp_bwd), each saved tensor dropped after
        # its last reader as the compiled backward does
        s = SavedForBackward.unflatten(saved)
        c, offsets, x_col = s.c, s.offsets, (s.x_col_data, s.x_col_scale, s.x_col_amax)
        w1_col, w2_col = (s.w1_col_data, s.w1_col_scale, s.w1_amax), (s.w2_col_data, s.w2_col_scale, s.w2_amax)
        d_col = (s.d_col_amax, s.d_col_data, s.d_col_scale)
        del saved, s
        dw2, dprobs, *dcq = fused.grouped_mlp_bwd_fc2._init_fn(dy, c, probs, sizes, offsets, *w2_col, *d_col,
                                                               **options)
        del c, w2_col, d_col
        # fc1's two GEMMs in the order the backward runs them
        dgrad_args, wgrad_args = [*dcq[:3], *w1_col, sizes, target], [*dcq[3:], *x_col, offsets, target]
        wgrad_last = fc1_wgrad_last(dcq[0], dcq[3], x_col[0], w1_col[0])
        del dcq, x_col, w1_col
        if wgrad_last:
            dx = ops.grouped_gemm_op._init_fn(*dgrad_args)
            del dgrad_args
            dw1 = ops.grouped_gemm_wgrad_op._init_fn(*wgrad_args)
        else:
            dw1 = ops.grouped_gemm_wgrad_op._init_fn(*wgrad_args)
            del wgrad_args
            dx = ops.grouped_gemm_op._init_fn(*dgrad_args)
    print(f"{args.shape} {args.activation} recompute={args.recompute}: forward peak {forward_peak / MiB:.0f} MiB, "
          f"saved + Y after forward {after_forward / MiB:.0f} MiB, step peak {mode.peak / MiB:.0f} MiB")
    by_site = collections.Counter()
    for nbytes, site in mode.at_peak:
        by_site[site] += nbytes
    for site, nbytes in by_site.most_common():
        if nbytes >= MiB:
            print(f"  {nbytes / MiB:7.0f} MiB  {site}")
    del y, dx, dw1, dw2, dprobs


if __name__ == "__main__":
    main()
