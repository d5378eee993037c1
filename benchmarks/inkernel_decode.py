"""Would a GEMM that decodes its packed NVFP4 operand inside the K loop beat today's path on
SM90? Today each packed operand is first expanded to its bf16 deq() values by a dequantize
pass (``kernels.dequantize``), which a bf16 GEMM then reads; those copies cost bytes (the
S3/S4 floors) and memory (the peaks). This measures the alternative for the weight operand on
a plain GEMM C = A @ deq(B)^T, A bf16 (M, K), B in the weight's row-wise layout: E2M1 codes
(N, K/2) and an E4M3 scale per 16 along K (N, K/16):

    bf16 B                     the same kernel on B's deq() values (the GEMM of today's path)
    decode B in the K loop     codes loaded by TMA, scales by pointers (a TMA box would be
                               under 16 bytes wide), decoded before each dot with the
                               dequantize kernel's own arithmetic (``dequantize._deq_nibbles``)
    ..., warp_specialize       the same with tl.range(..., warp_specialize=True) (Triton's
                               Hopper warp specialization: a producer warp group loads)
    dequantize pass            ``kernels.dequantize.dequantize_bf16`` on B (today's extra pass),
                               replayed from a CUDA graph

best of a few tiles each, timed with triton.testing.do_bench; every GEMM is checked against
torch, B's deq() values bit for bit against ``formats.operand_values``. The GEMM kernel is a
probe (not persistent, no groups): compare rows with each other, not with torch.mm.

    python benchmarks/inkernel_decode.py                 # S1's two fprop GEMMs, S4's fc1 un-grouped
    python benchmarks/inkernel_decode.py --shapes 16384x2048x4096

On an H100 with Triton 3.6 (benchmarks/results/h100_inkernel_decode.log; docs/decisions.md, "GEMM operands") decoding in the loop
took 1.4-1.6x the bf16 kernel's time (200-290 us more a GEMM), with or without warp
specialization, against 3-7 us for the dequantize pass it would save.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nvfp4_inductor.formats import operand_values  # noqa: E402
from nvfp4_inductor.inspection import format_table  # noqa: E402
from nvfp4_inductor.kernels.dequantize import (_deq_nibbles, _expand_scales, _scale_fp16,  # noqa: E402
                                               dequantize_bf16)
from nvfp4_inductor.kernels.grouped_gemm_bf16 import _mma, set_launch_allocator  # noqa: E402

SHAPES = ["16384x2048x4096", "16384x4096x2048", "65536x768x2048"]  # M x N x K
TILES = [(128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 2),
         (128, 128, 64, 4, 4)]  # BM, BN, BK, warps, stages
VARIANTS = [("bf16 B", False, False), ("bf16 B, warp_specialize", False, True),
            ("decode B in the K loop", True, False), ("decode B, warp_specialize", True, True)]


@triton.jit
def _decode(codes, scales, BN: tl.constexpr, BK: tl.constexpr):
    """codes (BN, BK/2) uint8 and scales (BN, BK/16) E4M3 bytes -> (BN, BK) bf16 deq()
    values, as ``dequantize._dequantize_rows`` makes them."""
    lo, hi = _deq_nibbles(codes, _expand_scales(_scale_fp16(scales), BN, BK))
    lo = (lo.to(tl.float32) * 16384.0).to(tl.bfloat16)  # exact: deq() * 2**-14 -> deq()
    hi = (hi.to(tl.float32) * 16384.0).to(tl.bfloat16)
    return tl.reshape(tl.join(lo, hi), (BN, BK))


@triton.jit
def _gemm(a_ptr, b_ptr, codes_ptr, scales_ptr, out_ptr, M, N, K, DECODE: tl.constexpr, WS: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    pm, pn = pid % tiles_m, pid // tiles_m
    rn = pn * BN + tl.arange(0, BN)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    if DECODE:
        codes_desc = tl.make_tensor_descriptor(codes_ptr, shape=[N, K // 2], strides=[K // 2, 1],
                                               block_shape=[BN, BK // 2])
        scale_ptrs = scales_ptr.to(tl.pointer_type(tl.uint8)) + rn[:, None] * (K // 16) + tl.arange(0, BK // 16)[None, :]
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES, warp_specialize=WS):
        k = ki * BK
        if DECODE:
            b = _decode(codes_desc.load([pn * BN, k // 2]), tl.load(scale_ptrs + k // 16), BN, BK)
        else:
            b = b_desc.load([pn * BN, k])
        acc = _mma(a_desc.load([pm * BM, k]), b, acc)  # through fp64 under the interpreter
    rm = pm * BM + tl.arange(0, BM)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


def random_weight(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, K/2) uint8 with every code, scales (N, K/16) E4M3 in [0.5, 8.5))."""
    gen = torch.Generator(device=device).manual_seed(0)
    codes = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 16, device=device, generator=gen) * 8 + 0.5).to(torch.float8_e4m3fn)
    return codes, scales


def expected(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The reference deq() values of the operand (``formats.operand_values``)."""
    return operand_values(codes, scales).to(torch.bfloat16)


def gemm(a, b, codes, scales, out, decode: bool, ws: bool, tile) -> None:
    """out = a @ deq(B)^T by ``_gemm`` on one tile (BM, BN, BK, warps, stages): from B's
    deq() values `b`, or decoding `codes` and `scales` in the K loop."""
    bm, bn, bk, warps, stages = tile
    (m, k), n = a.shape, out.shape[1]
    _gemm[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](a, b, codes, scales, out, m, n, k, DECODE=decode, WS=ws, BM=bm,
                                                      BN=bn, BK=bk, STAGES=stages, num_warps=warps)


def best_time(a, b, codes, scales, out, want, decode, ws):
    """(us, tile) of the fastest tile that compiles and matches `want`; failures printed."""
    best = None
    for tile in TILES:
        name = "{}x{}x{} w{} s{}".format(*tile)
        try:
            gemm(a, b, codes, scales, out, decode, ws, tile)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects is reported, not fatal
            print(f"  {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}", flush=True)
            continue
        error = ((out.float() - want).abs().max() / want.abs().max()).item()
        if error > 1e-2:
            print(f"  {name}: wrong result (relative error {error:.3g})", flush=True)
            continue
        us = triton.testing.do_bench(lambda: gemm(a, b, codes, scales, out, decode, ws, tile)) * 1e3
        print(f"  {name}: {us:.0f} us", flush=True)
        if best is None or us < best[0]:
            best = (us, name)
    return best


def run(shape: str) -> list[list[str]]:
    m, n, k = (int(v) for v in shape.split("x"))
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    codes, scales = random_weight(n, k, "cuda")
    b = dequantize_bf16(codes, scales)
    if not torch.equal(b, expected(codes, scales)):
        raise AssertionError("the dequantize kernel's values differ from formats.operand_values")
    want = a.float() @ b.float().t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    rows = [[shape, "torch.mm on bf16 B", f"{triton.testing.do_bench(lambda: torch.mm(a, b.t(), out=out)) * 1e3:.0f}",
             "-"]]
    # replayed from a CUDA graph: launched one by one, this ~10 us kernel would time its host launch
    deq_us = triton.testing.do_bench_cudagraph(lambda: dequantize_bf16(codes, scales)) * 1e3
    rows.append([shape, "dequantize pass", f"{deq_us:.0f}", "-"])
    for name, decode, ws in VARIANTS:
        print(f"{shape} {name}:", flush=True)
        best = best_time(a, b, codes, scales, out, want, decode, ws)
        rows.append([shape, name, f"{best[0]:.0f}" if best else "none ran", best[1] if best else "-"])
    return rows


def main(argv=None) -> list[list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="M x N x K, e.g. 16384x2048x4096")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (its kernel runs on the CPU under the Triton interpreter: "
                     "tests/test_benchmark_grouped_mlp_smoke.py)")
    for shape in opts.shapes:
        if len(shape.split("x")) != 3 or any(int(v) % 128 for v in shape.split("x")):
            parser.error(f"--shapes: {shape!r} is not M x N x K with each a multiple of 128")
    from grouped_mlp import machine_line  # beside this file; imported here, where a GPU run needs it

    print(machine_line("cuda"), flush=True)
    set_launch_allocator()  # the descriptors' scratch, as the package's GEMMs take it
    rows = [row for shape in opts.shapes for row in run(shape)]
    print("\n" + format_table(["M x N x K", "kernel", "us", "best tile"], rows))
    return rows


if __name__ == "__main__":
    main()
