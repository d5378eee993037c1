"""Question: how should each NVFP4 cast launch -- one kernel for both copies or one per
copy (``kernels/config.cast_launches``), and at which tiles (``config.cast_config``)?

Cases, at the shapes and routing of benchmarks/grouped_mlp.py: S1 x (16384 tokens x 4096,
8 experts), S4 x (65536 x 2048, 128 uneven), S4 h (65536 x 768, the fc2 input); RNE and SR
(the gradients' casts). For each:
  both      ``group_cast`` writing the row-wise and the column-wise (RHT) copy, heuristic tiles
  row, col  ``group_cast`` writing one copy, at the heuristic's tiles and at each of TILES
  split     the fastest row-only + the fastest column-only time, and its ratio to "both"
Weight stacks (S1 W1 8 x 2048 x 4096, S4 W1 128 x 768 x 2048; 2D blocks, RNE): both copies
(the codes encoded once, ``group_cast``'s SHARED_CODES) against the row-wise copy alone.
Every launch's bits are checked against the heuristic's: no tile or split may change one.
Times are triton.testing.do_bench medians (us). Run W1 of benchmarks/NOTES.md chose the
current heuristics from these cases (with a routing of its own); the SR row-only
candidates of 16 elements per thread (16x512, 16x1024) come from sm_90a SASS counts
(benchmarks/cast_sass.py).

    python benchmarks/cast_tiles.py [--device cuda|cpu] [--cases "S4 x" "S4 W1" ...] [--roundings SR]

``--device cpu`` is a dry run under the Triton interpreter at a tiny shape (every kind of
launch and its bit check, one candidate tile each, no timing):
tests/test_benchmark_grouped_mlp_smoke.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grouped_mlp import SHAPES, routing  # noqa: E402

from nvfp4_inductor import numerics  # noqa: E402
from nvfp4_inductor.constants import RHT_DEFAULT_SIGN_MASK  # noqa: E402
from nvfp4_inductor.inspection import format_table  # noqa: E402
from nvfp4_inductor.kernels import api, config  # noqa: E402
from nvfp4_inductor.kernels.config import CastConfig  # noqa: E402
from nvfp4_inductor.kernels.group_amax import group_amax  # noqa: E402
from nvfp4_inductor.kernels.group_cast import group_cast  # noqa: E402

# (name, grouped_mlp shape, which of its widths is K): activations; weight stacks (G, F, H)
CASES = {"cuda": [("S1 x", "S1", "hidden"), ("S4 x", "S4", "hidden"), ("S4 h", "S4", "ffn")],
         "cpu": [("tiny x", "tiny", "hidden")]}
STACKS = {"cuda": [("S1 W1", "S1"), ("S4 W1", "S4")], "cpu": [("tiny W1", "tiny")]}
TILES = {  # single-copy candidates beside the heuristic's
    False: [CastConfig(32, 128, 1, k_blocks=4), CastConfig(16, 256, 1, k_blocks=2), CastConfig(16, 512, 1, k_blocks=2),
            CastConfig(64, 128, 2, k_blocks=4)],
    True: [CastConfig(32, 128, 1), CastConfig(32, 128, 1, k_blocks=4), CastConfig(16, 512, 1),
           CastConfig(16, 512, 1, k_blocks=2), CastConfig(16, 1024, 1)],
}
HEADERS = ["case", "rounding", "launch", "tiles", "us", "bits"]


def tiles_name(cfg) -> str:
    if cfg is None:
        return "heuristic"
    regs = f" regs {cfg.max_registers}" if cfg.max_registers else ""
    return f"{cfg.block_m}x{cfg.block_k} w{cfg.num_warps} k{cfg.k_blocks}{regs}"


def main(argv=None) -> list[list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--cases", nargs="+", help="case names (default: all of the device's)")
    parser.add_argument("--roundings", nargs="+", default=["RNE", "SR"], choices=["RNE", "SR"],
                        help="the activation cases' roundings")
    args = parser.parse_args(argv)
    device = args.device
    known = [c[0] for c in CASES[device]] + [s[0] for s in STACKS[device]]
    if args.cases and set(args.cases) - set(known):
        parser.error(f"--cases: unknown {sorted(set(args.cases) - set(known))}; known: {known}")
    chosen = set(args.cases or known)

    def us(fn) -> float:
        if device == "cpu":  # the interpreter: run once, no timing
            fn()
            return float("nan")
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3

    seed = torch.full((1,), 7, dtype=torch.int64, device=device)
    rows = []

    def row(*cells):
        rows.append([str(c) if not isinstance(c, float) else f"{c:.1f}" for c in cells])
        print(" | ".join(rows[-1]), flush=True)

    for name, shape, width in (c for c in CASES[device] if c[0] in chosen):
        groups, tokens, hidden, ffn, uneven = SHAPES[shape]
        k = hidden if width == "hidden" else ffn
        torch.manual_seed(0)
        x = (torch.randn(tokens, k, device=device) * torch.randn(tokens, 1, device=device).exp()).to(torch.bfloat16)
        sizes = routing(groups, tokens, uneven, device)
        cap = numerics.columnwise_capacity(tokens, groups)
        pre, post = api.group_hadamard_amax(x, sizes)
        for sr in (rounding == "SR" for rounding in args.roundings):
            def cast(rowwise, columnwise):
                return group_cast(x, sizes, pre, post, seed, rowwise, columnwise, True, RHT_DEFAULT_SIGN_MASK,
                                  False, sr, cap, False)

            rounding = "SR" if sr else "RNE"
            both = cast(True, True)
            t_both = us(lambda: cast(True, True))
            row(name, rounding, "both", "heuristic", t_both, "reference")
            best = {}
            for kind, copies, fields in (("row", (True, False), (0, 1)), ("col", (False, True), (2, 3))):
                for cfg in [None, *(TILES[sr] if device == "cuda" else TILES[sr][:1])]:
                    with config.override(cast=cfg):
                        out = cast(*copies)
                        t = us(lambda: cast(*copies))
                    same = all(torch.equal(out[i], both[i]) for i in fields)
                    best[kind] = min(best.get(kind, float("inf")), t) if t == t else t
                    row(name, rounding, kind, tiles_name(cfg), t, "equal" if same else "DIFFER")
            split = best["row"] + best["col"]
            row(name, rounding, f"split / both {split / t_both:.3f}" if t_both == t_both else "split",
                "fastest row + col", split, "-")
        del x
    for name, shape in (s for s in STACKS[device] if s[0] in chosen):
        g, _, k, n, _ = SHAPES[shape]  # W1 (G, F, H) of srelu: N = F rows per expert, K = H
        w = torch.randn(g * n, k, device=device).to(torch.bfloat16)
        amax, _ = group_amax(w, None, True, False, 0, n, True)

        def cast_w(columnwise):
            return group_cast(w, None, amax, amax, None, True, columnwise, False, 0, True, False, n, True)

        both, alone = cast_w(True), cast_w(False)
        same = torch.equal(both[0], alone[0]) and torch.equal(both[1], alone[1])
        row(name, "RNE 2D", "both", "heuristic", us(lambda: cast_w(True)), "reference")
        row(name, "RNE 2D", "row", "heuristic", us(lambda: cast_w(False)), "equal" if same else "DIFFER")
    print(format_table(HEADERS, rows))
    return rows


if __name__ == "__main__":
    main()
