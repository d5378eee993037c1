"""Question: should a cast whose copy a GEMM reads at once write that copy as its bf16 deq()
values (``group_cast(..., row_deq=True / col_deq=True)``) instead of packed codes + scales
that a ``dequantize_bf16`` launch then expands? (NOTES, eleventh session, "Casts that write the bf16
deq() copies directly", step 1.)

The deq() copy is 2 bytes per element against the packed copy's 0.5625, but the packed
route writes 0.5625, reads it back and writes the 2 bytes: 1.125 bytes per element and a
launch more. The cast is bound by its instructions, not by HBM (run W1), so the extra
stores may hide behind them -- or not. Cases, at benchmarks/grouped_mlp.py's shapes and
routing, as a training step makes them: x row + column (RNE; the column copy is saved, so
only the row copy as deq()), D row (forward, RNE), dY and dC row and column (SR, one launch
each), D column (backward, RNE, RHT), and a weight stack (2D, shared codes; the row copy as
deq(), the column copy saved). For each: the packed route (cast + dequantize_bf16 of the
copies a GEMM reads) and the deq() route, us (do_bench medians), their ratio, and whether
the deq() copies equal the dequantized packed copies bit for bit.

    python benchmarks/deq_cast.py [--device cuda|cpu]

``--device cpu``: a dry run under the Triton interpreter at the tiny shape (no timing).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cast_tiles import token_input  # noqa: E402
from grouped_mlp import SHAPES  # noqa: E402

from nvfp4_inductor.constants import RHT_DEFAULT_SIGN_MASK  # noqa: E402
from nvfp4_inductor.inspection import format_table  # noqa: E402
from nvfp4_inductor.kernels.dequantize import dequantize_bf16  # noqa: E402
from nvfp4_inductor.kernels.group_amax import group_amax  # noqa: E402
from nvfp4_inductor.kernels.group_cast import group_cast  # noqa: E402

# (name, shape, width, copies (row, col), stochastic rounding, deq() copies (row, col))
_STEP = [("x", "hidden", (True, True), False, (True, False)), ("D row", "ffn", (True, False), False, (True, False)),
         ("dY row", "hidden", (True, False), True, (True, False)), ("dY col", "hidden", (False, True), True, (False, True)),
         ("D col", "ffn", (False, True), False, (False, True)), ("dC row", "ffn", (True, False), True, (True, False)),
         ("dC col", "ffn", (False, True), True, (False, True))]
CASES = {"cuda": [(f"{shape} {name}", shape, *rest) for shape in ("S1", "S4") for name, *rest in _STEP],
         "cpu": [(f"tiny {name}", "tiny", *rest) for name, *rest in _STEP]}
STACKS = {"cuda": ["S1", "S4"], "cpu": ["tiny"]}
HEADERS = ["case", "packed + dequantize us", "deq() cast us", "deq / packed", "bits"]


def main(argv=None) -> list[list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    device = parser.parse_args(argv).device

    def us(fn) -> float:
        if device == "cpu":
            fn()
            return float("nan")
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3

    rows = []

    def row(name, packed_fn, deq_fn):
        packed, deq = packed_fn(), deq_fn()
        same = all(torch.equal(d.view(torch.int16), p.view(torch.int16)) for d, p in zip(deq, packed))
        t_packed, t_deq = us(packed_fn), us(deq_fn)
        rows.append([name, f"{t_packed:.1f}", f"{t_deq:.1f}", f"{t_deq / t_packed:.3f}", "equal" if same else "DIFFER"])
        print(" | ".join(rows[-1]), flush=True)

    seed = torch.full((1,), 7, dtype=torch.int64, device=device)
    for name, shape, width, (rowwise, columnwise), sr, (row_deq, col_deq) in CASES[device]:
        x, sizes, cap, pre, post = token_input(shape, width, device)

        def cast(deq, x=x, sizes=sizes, pre=pre, post=post, cap=cap, rowwise=rowwise, columnwise=columnwise, sr=sr,
                 row_deq=row_deq, col_deq=col_deq):
            return group_cast(x, sizes, pre, post, seed, rowwise, columnwise, True, RHT_DEFAULT_SIGN_MASK, False, sr,
                              cap, False, deq and row_deq, deq and col_deq)

        def packed_route(cast=cast, row_deq=row_deq, col_deq=col_deq):
            out = cast(False)
            return ([dequantize_bf16(out[0], out[1])] if row_deq else []) + (
                [dequantize_bf16(out[2], out[3])] if col_deq else [])

        def deq_route(cast=cast, row_deq=row_deq, col_deq=col_deq):
            out = cast(True)
            return ([out[0]] if row_deq else []) + ([out[2]] if col_deq else [])

        row(name, packed_route, deq_route)
        del x
    for shape in STACKS[device]:
        g, _, k, n, _ = SHAPES[shape]  # W1 (G, F, H) of srelu
        w = torch.randn(g * n, k, device=device).to(torch.bfloat16)
        amax, _ = group_amax(w, None, True, False, 0, n, True)

        def cast_w(row_deq, w=w, amax=amax, n=n):
            return group_cast(w, None, amax, amax, None, True, True, False, 0, True, False, n, True, row_deq, False)

        def packed_w(cast_w=cast_w):
            out = cast_w(False)
            return [dequantize_bf16(out[0], out[1])]

        row(f"{shape} W1 stack", packed_w, lambda cast_w=cast_w: [cast_w(True)[0]])
    print(format_table(HEADERS, rows))
    return rows


if __name__ == "__main__":
    main()
