"""How close do the Triton NVFP4 quantize kernels come to HBM speed, and how much faster
are they than torch.compile of the numerics.py reference?

For (T, K) in {(16384, 2048), (65536, 4096)} bf16 with 8 uneven groups (empty ones, sizes
not multiples of 128), each step below is timed with triton.testing.do_bench (median,
after warm-up) on random data, and reported as
    time, effective bandwidth over the fewest bytes the step must move, % of a
    device-to-device copy measured in this run, speed-up over torch.compile(reference).
Bytes per element: read bf16 2; a 1x16 copy writes 0.5 + 1/16 (codes + E4M3 scales); the
column-wise copy spans P = columnwise_capacity(T, G) tokens.

Steps:
  amax      group_hadamard_amax: pre- and post-RHT amax per group        (reads x)
  row+col   group_quantize row + column-wise RHT, supplied amaxes         (x -> both copies)
  row+col SR  the same with stochastic rounding (gradients)
  row       group_quantize row-wise only, supplied amax (fc2_x recompute) (x -> row copy)
  full      group_quantize row + column RHT, amaxes computed (amax + cast launches)
Last line: ratio row / full (the recompute's cast against the forward's; target <= 0.6).

Usage: python benchmarks/quantize.py [--out DIR] [--sweep]   (needs a CUDA device)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nvfp4_inductor import kernels, numerics  # noqa: E402
from nvfp4_inductor.kernels import config  # noqa: E402

SHAPES = [(16384, 2048), (65536, 4096)]
GROUPS_65536 = [0, 9000, 127, 0, 20000, 1, 15937, 20471]


def group_sizes(tokens: int) -> list[int]:
    sizes = [s * tokens // 65536 for s in GROUPS_65536]
    sizes[-1] += tokens - sum(sizes)
    return sizes


def same_bits(a, b) -> bool:
    """Every field of two quantized results (``as_tuple``) equal byte for byte."""
    return all((x is None) == (y is None) and (x is None or torch.equal(x.view(torch.uint8), y.view(torch.uint8)))
               for x, y in zip(a.as_tuple(), b.as_tuple()))


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def bench_graph(fn) -> float:
    """GPU time without the host's launch overhead (the call replayed from a CUDA graph)."""
    try:
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3
    except Exception as err:  # noqa: BLE001 - report and go on
        print(f"  cuda-graph timing failed: {type(err).__name__}: {err}"[:200])
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sweep", action="store_true", help="also time a few tile configs")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--compile-budget", type=float, default=240.0, help="seconds of reference compiles")
    parser.add_argument("--ref-json", help="take the compiled-reference times from an earlier run's json "
                        "(the reference does not change between kernel versions; saves minutes of compiles)")
    args = parser.parse_args()
    torch.manual_seed(0)
    bw_copy = 1.0
    rows, log = [], []
    compile_spent = 0.0
    earlier = {}
    if args.ref_json:
        with open(args.ref_json) as f:
            earlier = {(r[0], r[1]): r[6] for r in json.load(f)["rows"]}
    for tokens, k in SHAPES:
        x = (torch.randn(tokens, k, device="cuda") * torch.randn(tokens, 1, device="cuda").exp()).to(torch.bfloat16)
        sizes = torch.tensor(group_sizes(tokens), device="cuda")
        g = sizes.numel()
        cap = numerics.columnwise_capacity(tokens, g)
        pre, post = kernels.group_hadamard_amax(x, sizes)
        # the copy ceiling: read + write of x's bytes
        copy_out = torch.empty_like(x)
        t_copy = bench(lambda: copy_out.copy_(x))
        bw_copy = 2 * x.numel() * 2 / t_copy
        n = tokens * k
        row_bytes = n * (0.5 + 1 / 16)
        col_bytes = k * cap * (0.5 + 1 / 16)
        rht = dict(rowwise=True, columnwise=True, rht=True)
        steps = {
            "amax": (lambda: kernels.group_hadamard_amax(x, sizes),
                     lambda x, s: numerics.group_hadamard_amax_torch(x, s, 0xD7E8), 2 * n),
            "row+col": (lambda: kernels.group_quantize(x, sizes, **rht, rowwise_amax=pre, columnwise_amax=post),
                        lambda x, s: numerics.group_quantize_torch(x, s, **rht, rowwise_amax=pre, columnwise_amax=post).as_tuple(),
                        2 * n + row_bytes + col_bytes),
            "row+col SR": (lambda: kernels.group_quantize(x, sizes, **rht, rowwise_amax=pre, columnwise_amax=post,
                                                          stochastic_rounding=True, seed=7),
                           lambda x, s: numerics.group_quantize_torch(x, s, **rht, rowwise_amax=pre, columnwise_amax=post,
                                                                      stochastic_rounding=True, seed=7).as_tuple(),
                           2 * n + row_bytes + col_bytes),
            "row": (lambda: kernels.group_quantize(x, sizes, rowwise=True, rowwise_amax=pre),
                    lambda x, s: numerics.group_quantize_torch(x, s, rowwise=True, rowwise_amax=pre).as_tuple(),
                    2 * n + row_bytes),
            "full": (lambda: kernels.group_quantize(x, sizes, **rht),
                     lambda x, s: numerics.group_quantize_torch(x, s, **rht).as_tuple(),
                     2 * n + 2 * n + row_bytes + col_bytes),
        }
        times = {}
        for name, (fn, ref, nbytes) in steps.items():
            t = bench(fn)
            t_graph = bench_graph(fn)
            times[name] = t
            t_ref = earlier.get((f"{tokens}x{k}", name), float("nan")) * 1e-6
            if not args.ref_json and not args.no_compile and name != "row+col SR" and compile_spent < args.compile_budget:
                t0 = time.time()
                try:
                    torch._dynamo.reset()
                    compiled = torch.compile(ref, fullgraph=False, dynamic=False)
                    compiled(x, sizes)
                    t_ref = bench(lambda: compiled(x, sizes))
                except Exception as err:  # report, keep benchmarking
                    print(f"  compile of the reference for {name} failed: {type(err).__name__}: {err}"[:300])
                compile_spent += time.time() - t0
                log.append(dict(step=name, compile_s=time.time() - t0))
            bw = nbytes / t
            rows.append((f"{tokens}x{k}", name, t * 1e6, bw / 1e12, 100 * bw / bw_copy, t_ref / t, t_ref * 1e6,
                         t_graph * 1e6, 100 * nbytes / t_graph / bw_copy))
            print(f"{tokens}x{k} {name:11s} {t*1e6:9.1f} us  {bw/1e12:5.2f} TB/s  {100*bw/bw_copy:5.1f}% of copy"
                  f"  compiled ref {t_ref*1e6:10.1f} us  x{t_ref/t:6.1f}  graph {t_graph*1e6:9.1f} us", flush=True)
        rows.append((f"{tokens}x{k}", "copy", t_copy * 1e6, bw_copy / 1e12, 100.0, float("nan"), float("nan"),
                     float("nan"), float("nan")))
        rows.append((f"{tokens}x{k}", "ratio row/full", times["row"] / times["full"], 0, 0, 0, 0, 0, 0))
        del x, copy_out
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_quantize.json"), "w") as f:
        json.dump(dict(rows=rows, log=log, device=torch.cuda.get_device_name()), f, indent=1)
    print(f"\n{'shape':12s} {'step':15s} {'time us':>9s} {'TB/s':>6s} {'%copy':>6s} {'x compiled':>10s}"
          f" {'graph us':>9s} {'%copy':>6s}")
    for shape, name, t, bw, pct, speedup, _, t_graph, pct_graph in rows:
        if name.startswith("ratio"):
            print(f"{shape:12s} {name:15s} {t:9.3f}   (target <= 0.6)")
        else:
            print(f"{shape:12s} {name:15s} {t:9.1f} {bw:6.2f} {pct:6.1f} {speedup:10.1f} {t_graph:9.1f} {pct_graph:6.1f}")

    if args.sweep:  # tile configs of the two big kernels at the large shape (results do not change)
        tokens, k = SHAPES[-1]
        x = (torch.randn(tokens, k, device="cuda") * torch.randn(tokens, 1, device="cuda").exp()).to(torch.bfloat16)
        sizes = torch.tensor(group_sizes(tokens), device="cuda")
        cap = numerics.columnwise_capacity(tokens, sizes.numel())
        n = tokens * k
        row_bytes, col_bytes = n * (0.5 + 1 / 16), k * cap * (0.5 + 1 / 16)
        rht = dict(rowwise=True, columnwise=True, rht=True)
        pre, post = kernels.group_hadamard_amax(x, sizes)
        # (block_m, block_k, warps, register cap): the caps trade spills for occupancy
        for sr, tiles in ((False, [(32, 128, 1, None), (32, 128, 1, 200), (32, 128, 1, 168), (32, 128, 1, 128),
                                   (32, 256, 2, None), (32, 256, 2, 128)]),
                          (True, [(16, 256, 2, None), (16, 256, 2, 168), (16, 256, 2, 128)])):
            def cast():
                return kernels.group_quantize(x, sizes, **rht, rowwise_amax=pre, columnwise_amax=post,
                                              stochastic_rounding=sr, seed=1 if sr else None)

            default = cast()
            for bm, bk, warps, regs in tiles:
                cfg = config.CastConfig(block_m=bm, block_k=bk, num_warps=warps, max_registers=regs)
                with config.override(cast=cfg):
                    same = same_bits(cast(), default)  # no tile choice may change a bit
                    t = bench(cast)
                print(f"  sweep cast{' SR' if sr else ''} {cfg}: {t*1e6:.1f} us "
                      f"{100*(2*n+row_bytes+col_bytes)/t/bw_copy:.1f}% of copy, bits == default: {same}", flush=True)
                log.append(dict(sweep="cast SR" if sr else "cast", cfg=str(cfg), us=t * 1e6, same_bits=same))
        for bm, bk, split, warps in [(32, 256, 1, 2), (32, 256, 2, 2), (64, 128, 1, 4)]:
            cfg = config.AmaxConfig(block_m=bm, block_k=bk, k_split=split, num_warps=warps)
            with config.override(amax=cfg):
                t = bench(lambda: kernels.group_hadamard_amax(x, sizes))
            print(f"  sweep amax {cfg}: {t*1e6:.1f} us {100*2*n/t/bw_copy:.1f}% of copy", flush=True)
            log.append(dict(sweep="amax", cfg=str(cfg), us=t * 1e6))
        with open(os.path.join(args.out, "bench_quantize.json"), "w") as f:
            json.dump(dict(rows=rows, log=log, device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
