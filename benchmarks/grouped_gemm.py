"""How fast are the grouped NVFP4 GEMMs (emulated on bf16/fp16 tensor cores) against the
BF16 grouped GEMM the model would otherwise run?

Shapes (experts G, tokens T, hidden H, ffn F), fc1 of a SReLU MLP:
  S1 (8, 16384, 4096, 2048)   S2 (8, 65536, 4096, 4096)   S3 (32, 32768, 2048, 768, uneven)
Per shape, three GEMMs of 2*T*H*F FLOPs each:
  fprop  x (T, H) . W1_g^T         -> (T, F)      grouped_gemm
  dgrad  dC (T, F) . W1_g          -> (T, H)      grouped_gemm (W1's column-wise copy)
  wgrad  dC_g^T . x_g over tokens  -> (G, F, H)   grouped_gemm_wgrad (padded tokens)
Each is timed with triton.testing.do_bench (median, after warm-up) on random non-zero
NVFP4 operands (random codes, E4M3 scales in [2**-5, 2**3]), and compared in the same
process with
  bf16: torch._grouped_mm on bf16 operands of the same shapes (the BF16 baseline),
  dense: a dense bf16 torch.matmul of the same FLOPs (the machine's bf16 rate today).
Tile configs: a few are timed on S1 first and the fastest is used for every shape.

Usage: python benchmarks/grouped_gemm.py [--out DIR] [--no-sweep]   (needs a CUDA device)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nvfp4_inductor import numerics  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm import GemmConfig, grouped_gemm, override_config  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_wgrad import grouped_gemm_wgrad  # noqa: E402

SHAPES = {
    "S1": (8, 16384, 4096, 2048),
    "S2": (8, 65536, 4096, 4096),
    "S3": (32, 32768, 2048, 768),
}
CONFIGS = [  # the 3 best of runs 1-2 (NOTES.md); BK=128 spills with 256-wide tiles
    GemmConfig(256, 128, 64, 8, 3, 0),
    GemmConfig(128, 256, 64, 8, 3, 0),
    GemmConfig(256, 128, 64, 8, 4, 0),
]


def group_sizes(groups: int, tokens: int, uneven: bool, device) -> torch.Tensor:
    if not uneven:
        return torch.full((groups,), tokens // groups, dtype=torch.int64, device=device)
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(groups, generator=g) ** 3  # skewed routing
    weights[[3, 17]] = 0.0  # two empty experts
    sizes = (weights / weights.sum() * tokens).floor().long()
    sizes[0] += tokens - sizes.sum()
    return sizes.to(device)


def nvfp4(*shape, device):
    """An NVFP4 copy of a tensor of `shape` (last dim = logical elements K): random packed
    codes (..., K/2) and E4M3 scale bits 0x10..0x58 (2**-5 .. 2**3) (..., K/16), non-zero."""
    data = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, device=device)
    scale = torch.randint(0x10, 0x58, (*shape[:-1], shape[-1] // 16), dtype=torch.uint8, device=device)
    return data, scale.view(torch.float8_e4m3fn)


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def problems(name, device):
    """The three NVFP4 calls and their bf16 _grouped_mm twins for one shape."""
    groups, tokens, hidden, ffn = SHAPES[name]
    sizes = group_sizes(groups, tokens, name == "S3", device)
    amax = torch.rand(groups, device=device) + 0.5
    x, x_s = nvfp4(tokens, hidden, device=device)  # x row-wise
    w, w_s = nvfp4(groups, ffn, hidden, device=device)  # W1 row-wise
    dc, dc_s = nvfp4(tokens, ffn, device=device)  # dC row-wise
    wt, wt_s = nvfp4(groups, hidden, ffn, device=device)  # W1 column-wise
    cap = numerics.columnwise_capacity(tokens, groups)
    _, _, padded_offsets, _ = numerics.group_layout(sizes, tokens)
    dcc, dcc_s = nvfp4(ffn, cap, device=device)  # dC column-wise
    xc, xc_s = nvfp4(hidden, cap, device=device)  # x column-wise
    calls = {
        "fprop": lambda: grouped_gemm(x, x_s, amax, w, w_s, amax, sizes),
        "dgrad": lambda: grouped_gemm(dc, dc_s, amax, wt, wt_s, amax, sizes),
        "wgrad": lambda: grouped_gemm_wgrad(dcc, dcc_s, amax, xc, xc_s, amax, padded_offsets),
    }
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    xb = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    w1b = torch.randn(groups, ffn, hidden, device=device, dtype=torch.bfloat16)
    dcb = torch.randn(tokens, ffn, device=device, dtype=torch.bfloat16)
    baseline = {
        "fprop": lambda: torch._grouped_mm(xb, w1b.transpose(1, 2), offs=offs),
        "dgrad": lambda: torch._grouped_mm(dcb, w1b, offs=offs),
        "wgrad": lambda: torch._grouped_mm(dcb.t(), xb, offs=offs),
    }
    flops = 2.0 * tokens * hidden * ffn
    return calls, baseline, flops, (tokens, hidden, ffn)


def dump_compiled(out_dir: str) -> None:
    """Registers, spills, shared memory and wgmma count of every compiled GEMM variant."""
    from nvfp4_inductor.kernels import grouped_gemm as fprop_mod, grouped_gemm_wgrad as wgrad_mod

    for name, fn in (("fprop", fprop_mod._grouped_gemm_kernel), ("wgrad", wgrad_mod._grouped_gemm_wgrad_kernel)):
        try:
            for cache in fn.device_caches.values():
                for i, kernel in enumerate(cache[0].values()):
                    ptx = kernel.asm.get("ptx", "")
                    c = kernel.metadata.constants if hasattr(kernel.metadata, "constants") else {}
                    print(f"  compiled {name}[{i}]: regs {kernel.n_regs} spills {kernel.n_spills} "
                          f"shared {kernel.metadata.shared} wgmma {ptx.count('wgmma.mma_async')} "
                          f"mma.sync {ptx.count('mma.sync')} warps {kernel.metadata.num_warps}", flush=True)
                    with open(os.path.join(out_dir, f"{name}.ttgir"), "a") as f:
                        f.write(f"// ===== variant {i}: regs {kernel.n_regs} spills {kernel.n_spills}\n")
                        f.write(kernel.asm.get("ttgir", ""))
        except Exception as exc:  # introspection only
            print(f"  compiled {name}: n/a ({type(exc).__name__}: {exc})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    log = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    # Step 1: the machine's dense bf16 rate today (8192^3, random data)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    dense_rate = 2 * 8192**3 / bench(lambda: a @ b)
    del a, b
    print(f"dense bf16 matmul 8192^3: {dense_rate / 1e12:.0f} TFLOP/s", flush=True)

    # Step 2: pick tile configs on S1 (fprop config also serves dgrad)
    best = {"fprop": CONFIGS[0], "wgrad": CONFIGS[0]}
    if not args.no_sweep:
        calls, _, flops, _ = problems("S1", device)
        for kind, which in (("fprop", "fprop"), ("wgrad", "wgrad")):
            timings = []
            for cfg in CONFIGS:
                try:
                    with override_config(**{kind: cfg}):
                        t = bench(calls[which])
                except Exception as exc:  # a config that does not compile (shared memory)
                    print(f"  sweep {kind} {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                timings.append((t, cfg))
                print(f"  sweep {kind} {cfg}: {flops / t / 1e12:.0f} TFLOP/s", flush=True)
            best[kind] = min(timings, key=lambda x: x[0])[1]
        log["sweep_best"] = {k: v.__dict__ for k, v in best.items()}
        del calls

    # Step 3: every shape, every GEMM, against bf16 _grouped_mm and the dense rate
    rows = []
    with override_config(fprop=best["fprop"], wgrad=best["wgrad"]):
        for name in SHAPES:
            calls, baseline, flops, dims = problems(name, device)
            for which in ("fprop", "dgrad", "wgrad"):
                t = bench(calls[which])
                t_bf16 = bench(baseline[which])
                rows.append({
                    "shape": name, "gemm": which, "ms": t * 1e3, "tflops": flops / t / 1e12,
                    "bf16_ms": t_bf16 * 1e3, "bf16_tflops": flops / t_bf16 / 1e12,
                    "vs_bf16": t_bf16 / t, "vs_dense": flops / t / dense_rate,
                })
                print(f"{name} {which}: {rows[-1]}", flush=True)
            del calls, baseline
            torch.cuda.empty_cache()
    dump_compiled(args.out)
    log["dense_tflops"] = dense_rate / 1e12
    log["rows"] = rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grouped_gemm_bench.json"), "w") as f:
        json.dump(log, f, indent=1)

    print(f"\nconfigs: fprop/dgrad {best['fprop']}, wgrad {best['wgrad']}")
    print(f"dense bf16 rate: {dense_rate / 1e12:.0f} TFLOP/s")
    print(f"{'shape':5} {'gemm':6} {'ms':>8} {'TFLOP/s':>8} {'bf16 ms':>8} {'bf16 TF':>8} {'x bf16':>7} {'x dense':>7}")
    for r in rows:
        print(f"{r['shape']:5} {r['gemm']:6} {r['ms']:8.3f} {r['tflops']:8.0f} {r['bf16_ms']:8.3f} "
              f"{r['bf16_tflops']:8.0f} {r['vs_bf16']:7.2f} {r['vs_dense']:7.2f}")


if __name__ == "__main__":
    main()
