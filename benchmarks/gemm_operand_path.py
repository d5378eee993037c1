"""How should NVFP4 operands reach Hopper's bf16 tensor cores? Two ways, in one process:

  (a) in-register dequant: kernels.grouped_gemm / grouped_gemm_wgrad (dequantize each K
      step in registers, then wgmma)
  (b) dequantize + bf16 GEMM: kernels.dequantize.dequantize_bf16 writes bf16 deq() copies
      of both operands, then kernels.grouped_gemm_bf16's grouped GEMM reads them
      (grouped_gemm_via_bf16 / grouped_gemm_wgrad_via_bf16); the dequant time is also
      reported alone, the GEMM on ready bf16 copies alone, and the total (one call, timed
      as such); pointer loads and TMA loads
  (c) torch._grouped_mm on bf16 operands of the same shapes (the BF16 baseline)

Shapes (experts G, tokens T, hidden H, ffn F) of benchmarks/grouped_gemm.py, fc1 GEMMs:
  S1 (8, 16384, 4096, 2048)   S3 (32, 32768, 2048, 768, uneven routing, 2 empty experts)
  fprop x . W1_g^T (T, F) | dgrad dC . W1_g (T, H) | wgrad dC_g^T . x_g (G, F, H)
Random non-zero data (benchmarks/grouped_gemm.py's operands); do_bench medians.
bf16 GEMM tile configs: a few on S1 first (pointers / TMA), the fastest per kind is used
on every shape (all printed).

Usage: python benchmarks/gemm_operand_path.py [--out DIR]   (needs a CUDA device)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grouped_gemm import SHAPES, bench, group_sizes, nvfp4  # noqa: E402

from nvfp4_inductor import numerics  # noqa: E402
from nvfp4_inductor.kernels.dequantize import dequantize_bf16  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm import grouped_gemm  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_bf16 import (  # noqa: E402
    Bf16GemmConfig, _grouped_gemm_bf16_op, _grouped_gemm_wgrad_bf16_op, grouped_gemm_via_bf16,
    grouped_gemm_wgrad_via_bf16, override_config,
)
from nvfp4_inductor.kernels.grouped_gemm_wgrad import grouped_gemm_wgrad  # noqa: E402

RUN_SHAPES = ["S1", "S3"]
CONFIGS = [
    Bf16GemmConfig(128, 256, 64, 8, 3, 0, False),
    Bf16GemmConfig(128, 256, 64, 8, 3, 0, True),
    Bf16GemmConfig(128, 256, 64, 8, 4, 0, True),
]


def label(cfg: Bf16GemmConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages}/{'tma' if cfg.tma else 'ptr'}"


def problems(name, device):
    groups, tokens, hidden, ffn = SHAPES[name]
    sizes = group_sizes(groups, tokens, name == "S3", device)
    amax = torch.rand(groups, device=device) + 0.5
    x, x_s = nvfp4(tokens, hidden, device=device)
    w, w_s = nvfp4(groups, ffn, hidden, device=device)
    dc, dc_s = nvfp4(tokens, ffn, device=device)
    wt, wt_s = nvfp4(groups, hidden, ffn, device=device)
    cap = numerics.columnwise_capacity(tokens, groups)
    _, _, offsets, _ = numerics.group_layout(sizes, tokens)
    dcc, dcc_s = nvfp4(ffn, cap, device=device)
    xc, xc_s = nvfp4(hidden, cap, device=device)
    nv = {
        "fprop": (x, x_s, amax, w, w_s, amax, sizes),
        "dgrad": (dc, dc_s, amax, wt, wt_s, amax, sizes),
        "wgrad": (dcc, dcc_s, amax, xc, xc_s, amax, offsets),
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


def paths(which, args):
    """(in-register call, dequant-only call, bf16-GEMM-only call on ready copies, total call, dequant bytes)."""
    a, sa, aa, b, sb, ba, layout = args
    a16, b16 = dequantize_bf16(a, sa), dequantize_bf16(b, sb)
    aa, ba = aa.float().contiguous(), ba.float().contiguous()
    nbytes = (a.numel() + b.numel()) * 2 * (0.5625 + 2) // 1  # packed data + scales read, bf16 written
    deq = lambda: (dequantize_bf16(a, sa), dequantize_bf16(b, sb))  # noqa: E731
    if which == "wgrad":
        return (lambda: grouped_gemm_wgrad(*args), deq,
                lambda: _grouped_gemm_wgrad_bf16_op(a16, aa, b16, ba, layout),
                lambda: grouped_gemm_wgrad_via_bf16(*args), nbytes)
    return (lambda: grouped_gemm(*args), deq, lambda: _grouped_gemm_bf16_op(a16, aa, b16, ba, layout),
            lambda: grouped_gemm_via_bf16(*args), nbytes)


def try_bench(fn):
    try:
        return bench(fn)
    except Exception as exc:  # a variant that fails to compile or launch on this Triton
        print(f"    failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    log = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    log["triton"] = triton.__version__

    # bf16 GEMM configs on S1 (GEMM alone, on ready bf16 copies); the in-register kernels
    # run their default (run 2's best)
    nv, _, flops = problems("S1", device)
    best, sweep = {}, []
    for kind, which in (("fprop", "fprop"), ("wgrad", "wgrad")):
        timings = []
        for cfg in CONFIGS:
            with override_config(**{kind: cfg}):
                _, _, gemm, _, _ = paths(which, nv[which])
                t = try_bench(gemm)
            print(f"  sweep {kind} {label(cfg)}: {t * 1e3:.3f} ms {flops / t / 1e12:.0f} TFLOP/s", flush=True)
            sweep.append({"kind": kind, "cfg": label(cfg), "ms": t * 1e3})
            if t == t:
                timings.append((t, cfg))
        best[kind] = min(timings, key=lambda x: x[0])[1]
    del nv
    log["sweep"] = sweep
    log["best"] = {k: label(v) for k, v in best.items()}

    rows = []
    with override_config(fprop=best["fprop"], wgrad=best["wgrad"]):
        for name in RUN_SHAPES:
            nv, baseline, flops = problems(name, device)
            for which in ("fprop", "dgrad", "wgrad"):
                inreg, deq, gemm, total, nbytes = paths(which, nv[which])
                r = {"shape": name, "gemm": which}
                r["a_ms"] = bench(inreg) * 1e3
                r["deq_ms"] = bench(deq) * 1e3
                r["deq_tbs"] = nbytes / (r["deq_ms"] * 1e-3) / 1e12
                r["b_gemm_ms"] = bench(gemm) * 1e3
                r["b_total_ms"] = bench(total) * 1e3
                r["c_ms"] = bench(baseline[which]) * 1e3
                for k in ("a", "b_gemm", "b_total", "c"):
                    r[f"{k}_tflops"] = flops / (r[f"{k}_ms"] * 1e-3) / 1e12
                r["a_over_b_total"] = r["a_ms"] / r["b_total_ms"]
                rows.append(r)
                print(f"{name} {which}: {r}", flush=True)
            del nv, baseline
            torch.cuda.empty_cache()
    log["rows"] = rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm_operand_path.json"), "w") as f:
        json.dump(log, f, indent=1)

    print(f"\nbf16 GEMM configs: fprop/dgrad {label(best['fprop'])}, wgrad {label(best['wgrad'])}")
    print("(a) in-register dequant  (b) dequantize + bf16 GEMM  (c) torch._grouped_mm bf16; ms, TFLOP/s")
    print(f"{'shape':5} {'gemm':5} {'(a)ms':>7} {'TF':>4} {'deq ms':>6} {'TB/s':>5} {'(b)gemm':>7} {'TF':>4} "
          f"{'(b)tot':>7} {'TF':>4} {'(c)ms':>7} {'TF':>4} {'a/b':>5} {'c/b':>5}")
    for r in rows:
        print(f"{r['shape']:5} {r['gemm']:5} {r['a_ms']:7.3f} {r['a_tflops']:4.0f} {r['deq_ms']:6.3f} {r['deq_tbs']:5.2f} "
              f"{r['b_gemm_ms']:7.3f} {r['b_gemm_tflops']:4.0f} {r['b_total_ms']:7.3f} {r['b_total_tflops']:4.0f} "
              f"{r['c_ms']:7.3f} {r['c_tflops']:4.0f} {r['a_over_b_total']:5.2f} {r['c_ms'] / r['b_total_ms']:5.2f}")


if __name__ == "__main__":
    main()
