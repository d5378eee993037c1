"""Question: how many SM90 instructions does each variant of the cast kernel execute per
element it casts, and does it spill? A proxy for its speed that needs no GPU: the cast is
bound by instructions, not bytes (the first casts ran under 25% of the copy rate: docs/decisions.md, "Casts"), and every kernel
here is unrolled straight-line code except the loop over column blocks.

Each variant of ``_group_cast_kernel`` is compiled for sm_90a on this machine (Triton's
front end and the ptxas it ships, a stand-in driver naming an SM90 target; nothing runs)
with its tile config from ``kernels.config.cast_config`` (``--k-blocks`` overrides the
column blocks per program). Its SASS is counted from cuobjdump: instructions per element =
(instructions outside the column-block loop + k_blocks x those inside) / (elements a thread
casts per program), as if every program walked k_blocks blocks (a row-only cast with
``--token-unroll`` below 16 also loops over its tokens inside each block). Registers and
spill bytes come from cuobjdump's resource usage. "compile s": Triton's compile of the
variant into an empty cache on this machine's CPU -- a cold first step waits for the
slowest kernel of its forward, then of its backward.

    python benchmarks/cast_sass.py [--groups 8 128] [--k-blocks 1 4] [--token-unroll 16 4]
        [--variants row+col "col sr" ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter
from test_traced_launches import SM90_DRIVER  # noqa: E402

exec(SM90_DRIVER)  # defines SM90 and makes it Triton's active driver
SM90.get_current_stream = lambda self, device=None: 0  # noqa: F821  (warmup asks; nothing launches)

import torch  # noqa: E402
import triton  # noqa: E402

from nvfp4_inductor import activations  # noqa: E402
from nvfp4_inductor.inspection import format_table  # noqa: E402
from nvfp4_inductor.kernels import _registry, config  # noqa: E402
from nvfp4_inductor.kernels.group_cast import _group_cast_kernel  # noqa: E402

VARIANTS = {  # name: (rowwise, columnwise, rht, block_2d, sr, stacked[, row_deq[, activation of C]])
    "row+col": (True, True, True, False, False, False),  # activations (forward)
    # gradients: an SR row + column cast is a row-wise and a column-wise launch (config.cast_launches)
    "row sr": (True, False, False, False, True, False),  # dC's row-wise launch (dY's: "row sr, row deq")
    "col sr": (False, True, True, False, True, False),
    "weights 2d": (True, True, False, True, False, True),  # expert weight stacks
    "row": (True, False, False, False, False, False),  # the recompute's fc2 input
    "col": (False, True, True, False, False, False),
    # the row-wise copy a GEMM reads next, written as bf16 deq() values (Steps.deq_operands)
    "row+col, row deq": (True, True, True, False, False, False, True),
    "weights 2d, row deq": (True, True, False, True, False, True, True),
    "row deq": (True, False, False, False, False, False, True),
    "row sr, row deq": (True, False, False, False, True, False, True),  # dY's row-wise launch (fc2's dgrad)
    # the backward's recompute: D made from C (and probs) inside its column-wise cast
    "col, D from C srelu": (False, True, True, False, False, False, False, "srelu"),
    "col, D from C swiglu": (False, True, True, False, False, False, False, "swiglu"),
}
HEADERS = ["variant", "groups", "k_blocks", "token_unroll", "SASS", "in loop", "per element", "registers",
           "spill bytes", "compile s"]
_BRANCH = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def row_only(variant: str) -> bool:
    rowwise, columnwise, _, block_2d = VARIANTS[variant][:4]
    return rowwise and not columnwise and not block_2d


def compile_cast(variant: str, groups: int, k_blocks: int | None, k: int = 2048, token_unroll: int | None = None):
    """(cubin bytes, config) of one cast variant for sm_90a."""
    spec = VARIANTS[variant]  # 6 to 8 entries: row_deq and the activation default to False, None
    rowwise, columnwise, rht, block_2d, sr, stacked, row_deq, activation = (*spec, *(False, None)[len(spec) - 6:])
    act = -1 if activation is None else activations.get_activation(activation).triton_code
    gated = activation is not None and activations.get_activation(activation).gated
    cfg = config.cast_config(1 << 16, k, rht=columnwise and rht, sr=sr, rowwise=rowwise, columnwise=columnwise,
                             stacked=stacked, row_deq=row_deq)
    if k_blocks is not None:
        cfg = dataclasses.replace(cfg, k_blocks=k_blocks)
    if token_unroll is not None:
        cfg = dataclasses.replace(cfg, token_unroll=token_unroll)
    x = torch.empty(4096, 2 * k if gated else k, dtype=torch.bfloat16)
    u8, f32, i64 = torch.empty(16, dtype=torch.uint8), torch.empty(groups), torch.empty(groups + 1, dtype=torch.int64)
    probs = torch.empty(4096)
    compiled = _group_cast_kernel.warmup(
        x, probs, i64, i64, f32, f32, i64, u8, u8, u8, u8, f32, f32, k, groups, 4096, 4096, 0, 1.0,
        ROWWISE=rowwise, COLUMNWISE=columnwise, RHT=rht, SIGN_MASK=0xD7E8, BLOCK_2D=block_2d, SR=sr,
        STACKED=stacked, EVEN_K=True, SHARED_CODES=block_2d and rowwise and columnwise and not sr,  # one amax
        ROW_DEQ=row_deq,
        BLOCK_G=max(_registry.next_power_of_2(groups), 2), BM=cfg.block_m,
        BK=cfg.block_k, K_BLOCKS=cfg.k_blocks, TOKEN_UNROLL=cfg.token_unroll, ACT_IN=act >= 0,
        ACT=max(act, 0), GATED=gated, HAS_PROBS=act >= 0, GPU=True, grid=(1,), **cfg.launch_options())
    return compiled.asm["cubin"], cfg


def resources(cubin: bytes) -> dict:
    """A cubin's SASS instructions, those of its largest loop (a backward branch's span),
    registers per thread and spill (stack) bytes, from cuobjdump."""
    path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    addresses = []
    loops = []  # (first address, last address, instructions) of each loop
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        addresses.append(addr)
        branch = _BRANCH.search(m.group(2))
        if branch and int(branch.group(1), 16) < addr:  # a backward branch closes the loop
            target = int(branch.group(1), 16)
            loops.append((target, addr, sum(1 for a in addresses if target <= a <= addr)))
    outer = max(loops, key=lambda span: span[2], default=(0, 0, 0))
    inner = max((span for span in loops if outer[0] < span[0] and span[1] < outer[1]), key=lambda span: span[2],
                default=(0, 0, 0))
    return dict(sass=len(addresses), loop=outer[2], inner_loop=inner[2],
                registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                spills=int(re.search(r"STACK:(\d+)", usage).group(1)))


def count(cubin: bytes, cfg, token_loop: bool) -> dict:
    """Instructions (all, inside the column-block loop, per element), registers, spill bytes.
    With `token_loop` (a row-only cast) and token_unroll < 16, the token loop's body runs
    16 / token_unroll times a column block: the column-block loop's innermost loop, or the
    only loop with one block."""
    res = resources(cubin)
    per_thread = cfg.block_m * cfg.block_k // (32 * cfg.num_warps)
    steps = 16 // cfg.token_unroll if token_loop else 1
    token_body = res["loop"] if cfg.k_blocks == 1 else res["inner_loop"]
    block = res["loop"] + (steps - 1) * token_body  # the column-block loop's body, as executed
    executed = res["sass"] - res["loop"] + cfg.k_blocks * block
    return dict(res, per_element=executed / (cfg.k_blocks * per_thread))


def main(argv=None) -> list[list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 128])
    ap.add_argument("--k-blocks", type=int, nargs="+", default=None,
                    help="column blocks per program (default: the heuristic's)")
    ap.add_argument("--token-unroll", type=int, nargs="+", default=None,
                    help="row-only variants: tokens per unrolled step (default: the heuristic's)")
    args = ap.parse_args(argv)
    # compile times in an empty cache, after one throwaway compile (Triton's and LLVM's
    # first-use setup would otherwise land in the first row)
    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="cast_sass_cache_")
    compile_cast("col", 2, 1, k=64)
    rows = []
    for variant in args.variants:
        for groups in args.groups:
            for k_blocks in args.k_blocks or [None]:
                token_loop = row_only(variant)
                for unroll in (args.token_unroll or [None]) if token_loop else [None]:
                    start = time.perf_counter()
                    cubin, cfg = compile_cast(variant, groups, k_blocks, token_unroll=unroll)
                    seconds = time.perf_counter() - start
                    c = count(cubin, cfg, token_loop)
                    rows.append([variant, str(groups), str(cfg.k_blocks), str(cfg.token_unroll), str(c["sass"]),
                                 str(c["loop"]), f"{c['per_element']:.1f}", str(c["registers"]), str(c["spills"]),
                                 f"{seconds:.1f}"])
                    print(f"[{variant}, G={groups}, k_blocks={cfg.k_blocks}, token_unroll={cfg.token_unroll}] "
                          f"{c['per_element']:.1f} per element, compiled in {seconds:.1f} s", flush=True)
    print(format_table(HEADERS, rows))
    return rows


if __name__ == "__main__":
    main()
