"""How fast are the grouped NVFP4 GEMMs of the Triton lowering (dequantize to bf16 deq()
copies, then a bf16-operand grouped GEMM: kernels/grouped_gemm_bf16.py) against the BF16
grouped GEMM the model would otherwise run?

Shapes (experts G, tokens T, hidden H, ffn F), fc1 of a SReLU MLP:
  S1 (8, 16384, 4096, 2048)   S2 (8, 65536, 4096, 4096)   S3 (32, 32768, 2048, 768, uneven)
Per shape, three GEMMs of 2*T*H*F FLOPs each:
  fprop  x (T, H) . W1_g^T         -> (T, F)      grouped_gemm_via_bf16
  dgrad  dC (T, F) . W1_g          -> (T, H)      grouped_gemm_via_bf16 (W1's column-wise copy)
  wgrad  dC_g^T . x_g over tokens  -> (G, F, H)   grouped_gemm_wgrad_via_bf16 (padded tokens)
Each is timed with triton.testing.do_bench (median, after warm-up) on random non-zero
NVFP4 operands (random codes, E4M3 scales in [2**-5, 2**3]): the dequant pass alone, the
bf16 GEMM alone on ready bf16 copies, and the whole call; compared in the same process with
  bf16: torch._grouped_mm on bf16 operands of the same shapes (the BF16 baseline),
  dense: a dense bf16 torch.matmul of the same FLOPs (the machine's bf16 rate today).
Tile configs: a few (pointer and TMA loads) are timed on S1 first, GEMM alone, and the
fastest per kind is used for every shape. (Until run P1 this benchmark timed the
in-register dequant GEMMs, since removed: benchmarks/NOTES.md.)

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
from nvfp4_inductor.kernels import config  # noqa: E402
from nvfp4_inductor.kernels.config import Bf16GemmConfig  # noqa: E402
from nvfp4_inductor.kernels.dequantize import dequantize_bf16  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_bf16 import (  # noqa: E402
    _grouped_gemm_bf16_op, _grouped_gemm_wgrad_bf16_op, grouped_gemm_via_bf16, grouped_gemm_wgrad_via_bf16,
)

SHAPES = {
    "S1": (8, 16384, 4096, 2048),
    "S2": (8, 65536, 4096, 4096),
    "S3": (32, 32768, 2048, 768),
}
CONFIGS = [  # run P1's sweep (NOTES.md): pointers vs TMA, 3 or 4 stages
    Bf16GemmConfig(128, 256, 64, 8, 3, 0, False),
    Bf16GemmConfig(128, 256, 64, 8, 3, 0, True),
    Bf16GemmConfig(128, 256, 64, 8, 4, 0, True),
]


def label(cfg: Bf16GemmConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages}/{'tma' if cfg.tma else 'ptr'}"


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
    """The three NVFP4 GEMMs' arguments and their bf16 _grouped_mm twins for one shape."""
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
    nv = {
        "fprop": (x, x_s, amax, w, w_s, amax, sizes),
        "dgrad": (dc, dc_s, amax, wt, wt_s, amax, sizes),
        "wgrad": (dcc, dcc_s, amax, xc, xc_s, amax, padded_offsets),
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
    return nv, baseline, 2.0 * tokens * hidden * ffn


def calls(which, args):
    """(dequant-only call, bf16-GEMM-only call on ready copies, whole call, dequant bytes)."""
    a, sa, aa, b, sb, ba, layout = args
    a16, b16 = dequantize_bf16(a, sa), dequantize_bf16(b, sb)
    nbytes = (a.numel() + b.numel()) * 2 * (0.5625 + 2) // 1  # packed data + scales read, bf16 written
    deq = lambda: (dequantize_bf16(a, sa), dequantize_bf16(b, sb))  # noqa: E731
    if which == "wgrad":
        return (deq, lambda: _grouped_gemm_wgrad_bf16_op(a16, aa, b16, ba, layout),
                lambda: grouped_gemm_wgrad_via_bf16(*args), nbytes)
    return deq, lambda: _grouped_gemm_bf16_op(a16, aa, b16, ba, layout), lambda: grouped_gemm_via_bf16(*args), nbytes


def dump_compiled(out_dir: str) -> None:
    """Registers, spills, shared memory and wgmma count of every compiled GEMM variant."""
    from nvfp4_inductor.kernels import grouped_gemm_bf16 as mod

    for name, fn in (("fprop", mod._grouped_gemm_bf16_kernel), ("wgrad", mod._grouped_gemm_wgrad_bf16_kernel)):
        try:
            for cache in fn.device_caches.values():
                for i, kernel in enumerate(cache[0].values()):
                    ptx = kernel.asm.get("ptx", "")
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
    os.makedirs(args.out, exist_ok=True)

    # Step 1: the machine's dense bf16 rate today (8192^3, random data)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    dense_rate = 2 * 8192**3 / bench(lambda: a @ b)
    del a, b
    print(f"dense bf16 matmul 8192^3: {dense_rate / 1e12:.0f} TFLOP/s", flush=True)

    # Step 2: pick tile configs on S1, bf16 GEMM alone (the fprop config also serves dgrad)
    best = {"fprop": config.bf16_gemm_config("fprop", device), "wgrad": config.bf16_gemm_config("wgrad", device)}
    if not args.no_sweep:
        nv, _, flops = problems("S1", device)
        for kind in ("fprop", "wgrad"):
            timings = []
            for cfg in CONFIGS:
                try:
                    with config.override(**{kind: cfg}):
                        t = bench(calls(kind, nv[kind])[1])
                except Exception as exc:  # a config that does not compile (shared memory)
                    print(f"  sweep {kind} {label(cfg)}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                timings.append((t, cfg))
                print(f"  sweep {kind} {label(cfg)}: {flops / t / 1e12:.0f} TFLOP/s", flush=True)
            best[kind] = min(timings, key=lambda x: x[0])[1]
        del nv
    log["configs"] = {k: label(v) for k, v in best.items()}

    # Step 3: every shape, every GEMM (dequant, GEMM, whole call) against bf16 _grouped_mm
    rows = []
    with config.override(fprop=best["fprop"], wgrad=best["wgrad"]):
        for name in SHAPES:
            nv, baseline, flops = problems(name, device)
            for which in ("fprop", "dgrad", "wgrad"):
                deq, gemm, total, nbytes = calls(which, nv[which])
                r = {"shape": name, "gemm": which}
                r["deq_ms"] = bench(deq) * 1e3
                r["deq_tbs"] = nbytes / (r["deq_ms"] * 1e-3) / 1e12
                r["gemm_ms"] = bench(gemm) * 1e3
                r["ms"] = bench(total) * 1e3
                r["bf16_ms"] = bench(baseline[which]) * 1e3
                for k in ("gemm", "", "bf16"):
                    r[f"{k}_tflops" if k else "tflops"] = flops / (r[f"{k}_ms" if k else "ms"] * 1e-3) / 1e12
                r["vs_bf16"] = r["bf16_ms"] / r["ms"]
                r["vs_dense"] = r["tflops"] * 1e12 / dense_rate
                rows.append(r)
                print(f"{name} {which}: {r}", flush=True)
            del nv, baseline
            torch.cuda.empty_cache()
    dump_compiled(args.out)
    log["dense_tflops"] = dense_rate / 1e12
    log["rows"] = rows
    with open(os.path.join(args.out, "grouped_gemm_bench.json"), "w") as f:
        json.dump(log, f, indent=1)

    print(f"\nconfigs: fprop/dgrad {label(best['fprop'])}, wgrad {label(best['wgrad'])}")
    print(f"dense bf16 rate: {dense_rate / 1e12:.0f} TFLOP/s")
    print(f"{'shape':5} {'gemm':6} {'deq ms':>6} {'TB/s':>5} {'gemm ms':>7} {'TF':>4} {'ms':>7} {'TF':>4} "
          f"{'bf16 ms':>7} {'TF':>4} {'x bf16':>6} {'x dense':>7}")
    for r in rows:
        print(f"{r['shape']:5} {r['gemm']:6} {r['deq_ms']:6.3f} {r['deq_tbs']:5.2f} {r['gemm_ms']:7.3f} "
              f"{r['gemm_tflops']:4.0f} {r['ms']:7.3f} {r['tflops']:4.0f} {r['bf16_ms']:7.3f} {r['bf16_tflops']:4.0f} "
              f"{r['vs_bf16']:6.2f} {r['vs_dense']:7.2f}")


if __name__ == "__main__":
    main()
