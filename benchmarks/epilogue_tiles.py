"""Which tile config should the fused epilogue GEMMs (fc1 + activation; fc2 dgrad +
activation backward) use, per activation?

At each shape of benchmarks/grouped_mlp.py (S1, S3 by default) and activation, times on
ready bf16 deq() operands (random, non-zero; do_bench medians), one process:
  plain   the unfused bf16-operand GEMM (``_grouped_gemm_bf16_op``) of the same shape,
          at the default config (what the fused kernel's GEMM part costs at best)
  act     ``_grouped_gemm_act_op``  (C, D)
  dact    ``_grouped_gemm_dact_op`` (dC, dprob, regenerated D)
for each tile config in CONFIGS (--configs picks some). Columns: ms and the ratio to
`plain` at the default config; "no D" times dact without regenerating D, so the epilogue's
parts can be told apart. (The act kernel's former D-amax epilogue timed here took 0.678 against 0.484 ms
without it at S4, so it was removed.) A config that fails to compile (shared
memory) is reported, not hidden.

    python benchmarks/epilogue_tiles.py [--shapes S1 S3] [--activations srelu swiglu]
        [--configs "128x128x64 w8 s4" "128x128x64 w8 s4 /2" ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grouped_mlp import SHAPES, routing  # noqa: E402

from nvfp4_inductor.inspection import format_table  # noqa: E402
from nvfp4_inductor.kernels.activation import _act_code, _clamp  # noqa: E402
from nvfp4_inductor.kernels import config  # noqa: E402
from nvfp4_inductor.kernels.config import Bf16GemmConfig  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_act import _grouped_gemm_act_op  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_bf16 import _grouped_gemm_bf16_op  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_dact import _grouped_gemm_dact_op  # noqa: E402

CONFIGS = {  # BM, BN, BK, warps, stages[, the dact epilogue's column slices]
    "128x256x64 w8 s3": Bf16GemmConfig(128, 256, 64, 8, 3),
    "128x128x64 w8 s4": Bf16GemmConfig(128, 128, 64, 8, 4),
    "128x128x64 w4 s4": Bf16GemmConfig(128, 128, 64, 4, 4),
    "256x128x64 w8 s3": Bf16GemmConfig(256, 128, 64, 8, 3),
    "64x256x64 w4 s4": Bf16GemmConfig(64, 256, 64, 4, 4),
    # the dact epilogue in column slices (the act kernel ignores the split): no register
    # spills in their sm_90a code where the unsplit tiles spill (benchmarks/epilogue_sass.py)
    "128x128x64 w8 s4 /2": Bf16GemmConfig(128, 128, 64, 8, 4, epilogue_split=2),
    "128x128x64 w8 s4 /4": Bf16GemmConfig(128, 128, 64, 8, 4, epilogue_split=4),
    "128x256x64 w8 s3 /4": Bf16GemmConfig(128, 256, 64, 8, 3, epilogue_split=4),
}


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["S1", "S3"])
    parser.add_argument("--activations", nargs="+", default=["srelu", "swiglu"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG",
                        help=f"tile configs, by name: {', '.join(repr(n) for n in CONFIGS)} (default: all)")
    args = parser.parse_args()
    dev = "cuda"
    rows = []
    for shape in args.shapes:
        groups, tokens, hidden, ffn, uneven = SHAPES[shape]
        sizes = routing(groups, tokens, uneven, dev)
        amax = torch.rand(groups, device=dev) + 0.5
        probs = torch.rand(tokens, device=dev)
        x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
        w2t = torch.randn(groups, ffn, hidden, device=dev, dtype=torch.bfloat16) * hidden**-0.5
        for act in args.activations:
            f1 = 2 * ffn if act == "swiglu" else ffn
            w1 = torch.randn(groups, f1, hidden, device=dev, dtype=torch.bfloat16) * hidden**-0.5
            code, clamp = _act_code(act), _clamp(act, None)
            c = _grouped_gemm_bf16_op(x, amax, w1, amax, sizes)
            plain_act = ms(lambda: _grouped_gemm_bf16_op(x, amax, w1, amax, sizes))
            plain_dact = ms(lambda: _grouped_gemm_bf16_op(dy, amax, w2t, amax, sizes))
            for name in args.configs:
                cfg, row = CONFIGS[name], [shape, act, name]
                with config.override(act=cfg, dact=cfg):
                    for kind, fn, plain in (
                        ("act", lambda: _grouped_gemm_act_op(x, amax, w1, amax, sizes, probs, code, clamp),
                         plain_act),
                        ("dact", lambda: _grouped_gemm_dact_op(dy, amax, w2t, amax, sizes, c, probs, code,
                                                               clamp, True), plain_dact),
                        ("dact no D", lambda: _grouped_gemm_dact_op(dy, amax, w2t, amax, sizes, c, probs, code,
                                                                    clamp, False), plain_dact),
                    ):
                        try:
                            t = ms(fn)
                            row += [f"{t:.3f}", f"{t / plain:.2f}"]
                        except Exception as error:  # noqa: BLE001 - a config that cannot run is reported
                            row += [f"failed: {type(error).__name__}"[:40], "-"]
                rows.append(row + [f"{plain_act:.3f}", f"{plain_dact:.3f}"])
                print(" | ".join(rows[-1]), flush=True)
    print(format_table(["shape", "act", "config", "act ms", "act/plain", "dact ms",
                        "dact/plain", "no D ms", "/plain", "plain fc1 ms", "plain fc2-dgrad ms"], rows))


if __name__ == "__main__":
    main()
