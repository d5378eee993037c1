"""Question: how should each NVFP4 cast launch -- one kernel for both copies or one per
copy (``kernels/config.cast_launches``), and at which tiles (``config.cast_config``)?

Cases, at the shapes and routing of benchmarks/grouped_mlp.py: S1 x (16384 tokens x 4096,
8 experts), S4 x (65536 x 2048, 128 uneven), S4 h (65536 x 768, the fc2 input); RNE and SR
(the gradients' casts). For each:
  both      ``group_cast`` writing the row-wise and the column-wise (RHT) copy, heuristic tiles
  row, col  ``group_cast`` writing one copy, at the heuristic's tiles and at each of TILES
  row deq   (RNE) the row-wise copy as deq() values, what the forward's casts write
  split     the fastest row-only + the fastest column-only time, and its ratio to "both"
Weight stacks (S1 W1 8 x 2048 x 4096, S4 W1 128 x 768 x 2048, S4 W2 128 x 2048 x 768; 2D
blocks, RNE), the launch a step's forward runs: the row-wise copy as deq() values and the
packed column-wise copy in one launch (the codes encoded once, ``group_cast``'s
SHARED_CODES), at the heuristic's tiles and at each of STACK_TILES, and the row-wise copy
alone.
Every launch's bits are checked against the heuristic's (a deq() copy against the
heuristic's deq() copy): no tile or split may change one.
Times are triton.testing.do_bench medians (us); the first timing of a process can read
slow (158 us once for a config that then took 92). The current heuristics were chosen from
these cases (docs/decisions.md, "Tile choices"); the SR row-only
candidates of 16 elements per thread (16x512, 16x1024) come from sm_90a SASS counts
(benchmarks/cast_sass.py).

    python benchmarks/cast_tiles.py [--device cuda|cpu] [--cases "S4 x" "S4 W1" ...] [--roundings SR]
        [--kinds row col "row deq"] [--tiles 16x128w1k4 32x128w2k4 ...]

``--tiles`` replaces the single-copy candidates (``BMxBKwWARPSkBLOCKS``, optionally
``uUNROLL``, the row-only casts' tokens per unrolled step, and ``rREGISTERS``): each
candidate compiles once per case and rounding, which is most of a sweep's time on the
H200, so a question about a few tiles should name only those.

``--device cpu`` is a dry run under the Triton interpreter at a tiny shape (every kind of
launch and its bit check, one candidate tile each, no timing):
tests/test_benchmark_grouped_mlp_smoke.py.
"""

from __future__ import annotations

import argparse
import os
import re
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
# weight stacks (name, shape, whether K is the hidden width: W1 (G, F, H); else W2 (G, H, F))
STACKS = {"cuda": [("S1 W1", "S1", True), ("S4 W1", "S4", True), ("S4 W2", "S4", False)],
          "cpu": [("tiny W1", "tiny", True)]}
TILES = {  # single-copy candidates beside the heuristic's
    False: [CastConfig(32, 128, 1, k_blocks=4), CastConfig(16, 256, 1, k_blocks=2), CastConfig(16, 512, 1, k_blocks=2),
            CastConfig(64, 128, 2, k_blocks=4), CastConfig(32, 128, 2, k_blocks=4), CastConfig(64, 128, 4, k_blocks=4),
            CastConfig(32, 256, 4, k_blocks=2), CastConfig(128, 128, 8, k_blocks=4)],
    True: [CastConfig(32, 128, 1), CastConfig(32, 128, 1, k_blocks=4), CastConfig(16, 512, 1),
           CastConfig(16, 512, 1, k_blocks=2), CastConfig(16, 1024, 1), CastConfig(32, 128, 2, k_blocks=4),
           CastConfig(64, 128, 4, k_blocks=4), CastConfig(16, 512, 2, k_blocks=2)],
}
STACK_TILES = [  # both-copy candidates beside the heuristic's
    CastConfig(32, 128, 2, k_blocks=4), CastConfig(64, 128, 4, k_blocks=4), CastConfig(64, 128, 8, k_blocks=4),
    CastConfig(128, 128, 8, k_blocks=4), CastConfig(64, 128, 4, k_blocks=2), CastConfig(64, 128, 4, k_blocks=8),
    CastConfig(64, 256, 8, k_blocks=2), CastConfig(64, 64, 2, k_blocks=8), CastConfig(128, 64, 4, k_blocks=8),
]
HEADERS = ["case", "rounding", "launch", "tiles", "us", "bits"]


def tiles_name(cfg) -> str:
    if cfg is None:
        return "heuristic"
    regs = f" regs {cfg.max_registers}" if cfg.max_registers else ""
    unroll = f" u{cfg.token_unroll}" if cfg.token_unroll != 16 else ""
    return f"{cfg.block_m}x{cfg.block_k} w{cfg.num_warps} k{cfg.k_blocks}{unroll}{regs}"


def parse_tiles(text: str) -> CastConfig:
    """'16x128w1k4' (optionally 'u4', the row-only token unroll, then 'r168', a register
    cap) -> CastConfig(16, 128, 1, k_blocks=4)."""
    match = re.fullmatch(r"(\d+)x(\d+)w(\d+)k(\d+)(?:u(\d+))?(?:r(\d+))?", text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"--tiles: {text!r} is not BMxBKwWARPSkBLOCKS[uUNROLL][rREGISTERS], e.g. 16x128w1k4 or 16x512w2k2u4")
    bm, bk, warps, blocks, unroll, regs = match.groups()
    return CastConfig(int(bm), int(bk), int(warps), int(regs) if regs else None, int(blocks),
                      int(unroll) if unroll else 16)


def main(argv=None) -> list[list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--cases", nargs="+", help="case names (default: all of the device's)")
    parser.add_argument("--roundings", nargs="+", default=["RNE", "SR"], choices=["RNE", "SR"],
                        help="the activation cases' roundings")
    parser.add_argument("--kinds", nargs="+", default=["row", "col", "row deq"], choices=["row", "col", "row deq"],
                        help="the activation cases' single-copy launches to sweep")
    parser.add_argument("--tiles", nargs="+", type=parse_tiles,
                        help="single-copy candidates instead of TILES, e.g. 16x128w1k4 32x128w2k4")
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

    def candidates(tiles: list) -> list:  # the CPU dry run tries one
        return tiles if device == "cuda" else tiles[:1]

    def at_tiles(cfg, fn, reference, fields) -> tuple[float, str]:
        """`fn`'s time at tiles `cfg` (None: the heuristic's) and whether its outputs
        `fields` equal `reference`'s."""
        with config.override(cast=cfg):
            out = fn()
            t = us(fn)
        return t, "equal" if all(torch.equal(out[i], reference[i]) for i in fields) else "DIFFER"

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
            def cast(rowwise, columnwise, row_deq=False):
                return group_cast(x, sizes, pre, post, seed, rowwise, columnwise, True, RHT_DEFAULT_SIGN_MASK,
                                  False, sr, cap, False, row_deq)

            rounding = "SR" if sr else "RNE"
            both = cast(True, True)
            t_both = us(lambda: cast(True, True))
            row(name, rounding, "both", "heuristic", t_both, "reference")
            best = {}
            kinds = [("row", (True, False, False)), ("col", (False, True, False))]
            if not sr:  # the forward's RNE row-wise casts write deq() values
                kinds.append(("row deq", (True, False, True)))
            for kind, copies in (k for k in kinds if k[0] in args.kinds):
                reference = both if kind != "row deq" else cast(*copies)  # deq(): the heuristic's bits
                fields = (2, 3) if kind == "col" else (0, 1)
                for cfg in [None, *candidates(args.tiles or TILES[sr])]:
                    t, bits = at_tiles(cfg, lambda: cast(*copies), reference, fields)
                    best[kind] = min(best.get(kind, float("inf")), t) if t == t else t
                    row(name, rounding, kind, tiles_name(cfg), t, bits)
            if "row" in best and "col" in best:
                split = best["row"] + best["col"]
                row(name, rounding, f"split / both {split / t_both:.3f}" if t_both == t_both else "split",
                    "fastest row + col", split, "-")
        del x
    for name, shape, k_is_hidden in (s for s in STACKS[device] if s[0] in chosen):
        g, _, hidden, ffn, _ = SHAPES[shape]
        n, k = (ffn, hidden) if k_is_hidden else (hidden, ffn)  # N rows per expert, K columns
        w = torch.randn(g * n, k, device=device).to(torch.bfloat16)
        amax, _ = group_amax(w, None, True, False, 0, n, True)

        def cast_w(columnwise):
            return group_cast(w, None, amax, amax, None, True, columnwise, False, 0, True, False, n, True, True)

        both = cast_w(True)
        row(name, "RNE 2D", "both", "heuristic", us(lambda: cast_w(True)), "reference")
        for cfg in candidates(STACK_TILES):
            row(name, "RNE 2D", "both", tiles_name(cfg), *at_tiles(cfg, lambda: cast_w(True), both, range(4)))
        alone = cast_w(False)
        row(name, "RNE 2D", "row", "heuristic", us(lambda: cast_w(False)),
            "equal" if torch.equal(both[0], alone[0]) else "DIFFER")
        del w
    print(format_table(HEADERS, rows))
    return rows


if __name__ == "__main__":
    main()
