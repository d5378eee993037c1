"""The six GEMMs of an NVFP4 grouped-MLP training step on Hopper, per tile config, against
torch._grouped_mm on the same shapes: which config should each GEMM kind take?

At each shape of benchmarks/grouped_mlp.py (its routing: uneven at S3/S4) and activation,
on ready bf16 deq() operands (random; the dequantize and cast passes are not timed: no tile
config changes them), one process, do_bench medians:

    fc1 fprop + act    x (T, H) . W1_g^T -> C, D       _grouped_gemm_act_op        kind "act"
    fc2 fprop          D (T, F) . W2_g^T -> Y          _grouped_gemm_bf16_op       kind "fprop"
    fc2 dgrad + dact   dY (T, H) . W2_g -> dC, dprob   _grouped_gemm_dact_op       kind "dact"
    fc1 dgrad          dC (T, F1) . W1_g -> dX         _grouped_gemm_bf16_op       kind "fprop"
    dW2                dY_g^T . D_g over tokens        _grouped_gemm_wgrad_bf16_op kind "wgrad"
    dW1                dC_g^T . x_g over tokens        _grouped_gemm_wgrad_bf16_op kind "wgrad"

(the dact kernel as the step runs it: D is rebuilt after it, not in its epilogue). The
baseline is torch._grouped_mm on bf16 operands of the same shapes, the GEMM stock Inductor
runs for the BF16 model; the fused kernels' epilogues (the activation, dprob) are extra
work it does not do. Each kind is timed at the heuristic's config (`default`) and at the
candidates of `candidates`; no config changes a result bit (kernels/config.py).

    python benchmarks/grouped_gemm.py [--shapes S1 S2 S3 S4] [--activations srelu swiglu]
        [--kinds act fprop dact wgrad]   (needs a CUDA device)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grouped_mlp import SHAPES, routing  # noqa: E402

from nvfp4_inductor import numerics  # noqa: E402
from nvfp4_inductor.inspection import format_table  # noqa: E402
from nvfp4_inductor.kernels import config  # noqa: E402
from nvfp4_inductor.kernels.activation import _act_code, _clamp  # noqa: E402
from nvfp4_inductor.kernels.config import Bf16GemmConfig  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_act import _grouped_gemm_act_op  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_bf16 import _grouped_gemm_bf16_op, _grouped_gemm_wgrad_bf16_op  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_dact import _grouped_gemm_dact_op  # noqa: E402


def candidates(default: Bf16GemmConfig, kind: str) -> dict[str, Bf16GemmConfig]:
    """The configs tried beside the heuristic's: its TMA twin, with one stage more, its tile
    turned over (BM <-> BN), pointers and TMA, and for the fprop-shaped kinds its tiles
    walked in bands of 4, 8 and 16 M tiles (``band_m``; not the wgrads' schedule). Two
    programs an SM (one warp group each) lost everywhere (docs/decisions.md, "GEMM operands")."""
    turned = dataclasses.replace(default, block_m=default.block_n, block_n=default.block_m)
    out = {
        "tma": dataclasses.replace(default, tma=True),
        "tma +1 stage": dataclasses.replace(default, tma=True, num_stages=default.num_stages + 1),
        "+1 stage": dataclasses.replace(default, num_stages=default.num_stages + 1),
        "turned": turned,
        "turned tma": dataclasses.replace(turned, tma=True),
    }
    if kind != "wgrad":
        out.update({f"band {band}": dataclasses.replace(default, band_m=band) for band in (4, 8, 16)})
    seen, unique = {default}, {}
    for name, cfg in out.items():
        if cfg not in seen:
            seen.add(cfg)
            unique[name] = cfg
    return unique


def label(cfg: Bf16GemmConfig) -> str:
    split = f" /{cfg.epilogue_split}" if cfg.epilogue_split > 1 else ""
    band = f" band {cfg.band_m}" if cfg.band_m else ""
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
            f"{'tma' if cfg.tma else 'ptr'}{split}{band}")


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def gemms(shape: str, act: str, dev):
    """[(name, kind, our call, torch._grouped_mm call, FLOPs)] of one step's six GEMMs."""
    groups, tokens, hidden, ffn, uneven = SHAPES[shape]
    f1 = 2 * ffn if act == "swiglu" else ffn
    sizes = routing(groups, tokens, uneven, dev)
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    _, _, padded, _ = numerics.group_layout(sizes, tokens)
    cap = numerics.columnwise_capacity(tokens, groups)
    amax = torch.rand(groups, device=dev) + 0.5
    probs = torch.rand(tokens, device=dev)
    code, clamp = _act_code(act), _clamp(act, None)

    def bf16(*shape_):
        return torch.randn(*shape_, device=dev, dtype=torch.bfloat16)

    x, dy, d, dc = bf16(tokens, hidden), bf16(tokens, hidden), bf16(tokens, ffn), bf16(tokens, f1)
    c = bf16(tokens, f1)
    w1, w2 = bf16(groups, f1, hidden), bf16(groups, hidden, ffn)
    w1t, w2t = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()  # column-wise copies
    # wgrad operands: token-major columns in the padded column-wise layout (the values do not matter)
    dy_col, d_col, dc_col, x_col = bf16(hidden, cap), bf16(ffn, cap), bf16(f1, cap), bf16(hidden, cap)
    flops = 2 * tokens * hidden
    return [
        ("fc1 fprop + act", "act", lambda: _grouped_gemm_act_op(x, amax, w1, amax, sizes, probs, code, clamp),
         lambda: torch._grouped_mm(x, w1.transpose(1, 2), offs=offs), flops * f1),
        ("fc2 fprop", "fprop", lambda: _grouped_gemm_bf16_op(d, amax, w2, amax, sizes),
         lambda: torch._grouped_mm(d, w2.transpose(1, 2), offs=offs), flops * ffn),
        ("fc2 dgrad + dact", "dact",
         lambda: _grouped_gemm_dact_op(dy, amax, w2t, amax, sizes, c, probs, code, clamp, False),
         lambda: torch._grouped_mm(dy, w2, offs=offs), flops * ffn),
        ("fc1 dgrad", "fprop", lambda: _grouped_gemm_bf16_op(dc, amax, w1t, amax, sizes),
         lambda: torch._grouped_mm(dc, w1, offs=offs), flops * f1),
        ("dW2", "wgrad", lambda: _grouped_gemm_wgrad_bf16_op(dy_col, amax, d_col, amax, padded),
         lambda: torch._grouped_mm(dy.t(), d, offs=offs), flops * ffn),
        ("dW1", "wgrad", lambda: _grouped_gemm_wgrad_bf16_op(dc_col, amax, x_col, amax, padded),
         lambda: torch._grouped_mm(dc.t(), x, offs=offs), flops * f1),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["S1", "S2", "S3", "S4"], choices=sorted(SHAPES))
    parser.add_argument("--activations", nargs="+", default=["srelu", "swiglu"], choices=["srelu", "swiglu"])
    parser.add_argument("--kinds", nargs="+", default=["act", "fprop", "dact", "wgrad"],
                        choices=["act", "fprop", "dact", "wgrad"])
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows, total = [], {}
    for shape in args.shapes:
        for act in args.activations:
            for name, kind, ours, theirs, flops in gemms(shape, act, dev):
                if kind not in args.kinds:
                    continue
                default = config.bf16_gemm_config(kind, dev, swiglu=act == "swiglu")
                base = ms(theirs)
                timed = {"default": (ms(ours), default)}
                for cname, cfg in candidates(default, kind).items():
                    try:
                        with config.override(**{kind: cfg}):
                            timed[cname] = (ms(ours), cfg)
                    except Exception as error:  # noqa: BLE001 - a config that cannot run is reported
                        print(f"  {shape} {act} {name} {label(cfg)}: failed {type(error).__name__}: "
                              f"{str(error)[:160]}", flush=True)
                best_name = min(timed, key=lambda n: timed[n][0])
                t_def, (t_best, cfg_best) = timed["default"][0], timed[best_name]
                acc = total.setdefault((shape, act), [0.0, 0.0, 0.0])
                acc[0] += base
                acc[1] += t_def
                acc[2] += t_best
                rows.append([shape, act, name, f"{base:.3f}", f"{t_def:.3f}", f"{t_def / base:.2f}",
                             f"{flops / t_def * 1e-9:.0f}", f"{best_name}: {label(cfg_best)}", f"{t_best:.3f}",
                             f"{t_best / base:.2f}"])
                print(" | ".join(rows[-1]), "|", " ".join(f"{n} {t:.3f}" for n, (t, _) in timed.items()), flush=True)
    print()
    print(format_table(["shape", "act", "GEMM", "torch ms", "ours ms", "x torch", "TFLOP/s", "best config",
                        "best ms", "x torch"], rows))
    print()
    print(format_table(["shape", "act", "torch ms", "ours ms", "best ms"],
                       [[s, a, f"{t[0]:.3f}", f"{t[1]:.3f}", f"{t[2]:.3f}"] for (s, a), t in total.items()]))


if __name__ == "__main__":
    main()
