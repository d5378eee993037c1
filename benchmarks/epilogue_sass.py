"""Question: does a fused epilogue GEMM (fc1 + activation; fc2 dgrad + activation backward)
spill registers at a tile config? A proxy that needs no GPU: a spilling epilogue stalls on
local memory between tiles of a persistent GEMM (the fc1 kernel's former amax
epilogue, 200 bytes of spills in this count, cost 0.19 ms at S4: docs/decisions.md,
"GEMM operands").

Each kernel is compiled for sm_90a on this machine, as benchmarks/cast_sass.py compiles the
casts (Triton's front end and the ptxas it ships; nothing runs), at every config of
benchmarks/epilogue_tiles.py (or those named), for S4's shapes. Rows: kernel, activation,
config, SASS instructions (all, and those of the largest loop: the persistent tile loop),
registers per thread, spill bytes.
The act kernel does not split its epilogue, so it is compiled once per tile.

    python benchmarks/epilogue_sass.py [--activations srelu swiglu] [--configs NAME ...]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cast_sass  # noqa: E402  (first: makes a stand-in SM90 driver Triton's active one)
import torch  # noqa: E402
from epilogue_tiles import CONFIGS  # noqa: E402
from grouped_mlp import SHAPES  # noqa: E402

from nvfp4_inductor.inspection import format_table  # noqa: E402
from nvfp4_inductor.activations import get_activation  # noqa: E402
from nvfp4_inductor.kernels.activation import _act_code  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_act import _grouped_gemm_act_kernel  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_dact import _grouped_gemm_dact_kernel  # noqa: E402

HEADERS = ["kernel", "act", "config", "SASS", "largest loop", "registers", "spill bytes"]


def compile_epilogue(kind: str, activation: str, cfg, shape: str = "S4") -> bytes:
    """The cubin of the act or dact kernel ("dact no D": without D's regeneration) at `cfg`."""
    groups, _, hidden, ffn, _ = SHAPES[shape]
    bf, f32 = torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(groups)
    sizes = torch.empty(groups, dtype=torch.int64)
    common = dict(ACT=_act_code(activation), GATED=get_activation(activation).gated, HAS_PROBS=True, GPU=True, BLOCK_G=groups, BM=cfg.block_m,
                  BN=cfg.block_n, BK=cfg.block_k, NUM_PROGRAMS=132, NUM_STAGES=cfg.num_stages, EVEN_K=True,
                  TMA=cfg.tma, BAND=cfg.band_m, grid=(1,), num_warps=cfg.num_warps)
    if kind == "act":
        kernel = _grouped_gemm_act_kernel.warmup(bf, f32, bf, f32, sizes, f32, bf, bf, ffn, hidden, groups, 1.0,
                                                 **common)
    else:
        kernel = _grouped_gemm_dact_kernel.warmup(bf, f32, bf, f32, sizes, bf, f32, bf, f32, bf, ffn, hidden,
                                                  groups, 1.0, 0, ffn,  # col_start, FS: the whole copy
                                                  REGEN=kind == "dact", SPLIT=cfg.epilogue_split, **common)
    return kernel.asm["cubin"]


def main(argv=None) -> list[list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--activations", nargs="+", default=["srelu", "swiglu"], choices=["srelu", "tanh_srelu", "swiglu"])
    ap.add_argument("--kernels", nargs="+", default=["act", "dact", "dact no D"], choices=["act", "dact", "dact no D"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG")
    args = ap.parse_args(argv)
    rows = []
    for activation in args.activations:
        for kind in args.kernels:
            for name in args.configs:
                cfg = CONFIGS[name]
                if kind == "act" and cfg.epilogue_split != 1:
                    continue  # the act kernel's epilogue is not split: the unsplit row has its figures
                res = cast_sass.resources(compile_epilogue(kind, activation, cfg))
                rows.append([kind, activation, name, str(res["sass"]), str(res["loop"]), str(res["registers"]),
                             str(res["spills"])])
                print(" | ".join(rows[-1]), flush=True)
    print(format_table(HEADERS, rows))
    return rows


if __name__ == "__main__":
    main()
