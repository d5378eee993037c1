"""Would a GEMM that decodes its packed NVFP4 operand inside the K loop beat today's path on
SM90? Today each packed operand is first expanded to its bf16 deq() values by a dequantize
pass, which a bf16 GEMM then reads; those copies cost bytes (the S3/S4 floors) and memory (the
peaks). This measures the alternative for the weight operand on a plain GEMM
C = A @ deq(B)^T, A bf16 (M, K), B packed E2M1 codes (N, K/2) with an E4M3 scale per 16
along K (stored (K/16, N), so a TMA box is at least 16 bytes wide):

    bf16 B                     the same kernel on B's deq() values (the GEMM of today's path)
    decode B in the K loop     codes and scales loaded by TMA, decoded to bf16 before each dot
    ..., warp_specialize       the same with tl.range(..., warp_specialize=True) (Triton's
                               Hopper warp specialization: a producer warp group loads)
    dequantize pass            the kernel that writes B's deq() values (today's extra pass)

best of a few tiles each, timed with triton.testing.do_bench; every GEMM is checked against
torch, the decode bit for bit against ``formats.operand_values``. The kernels are a
probe (not persistent, no groups): compare rows with each other, not with torch.mm.

    python benchmarks/inkernel_decode.py                 # S1's two fprop GEMMs, S4's fc1 un-grouped
    python benchmarks/inkernel_decode.py --shapes 16384x2048x4096

On an H100 with Triton 3.6 (benchmarks/results/inkernel_decode_run_AF5.log) decoding in the loop
took 1.9-2.3x the bf16 kernel's time, with or without warp specialization, against 8-26 us for
the dequantize pass it would save.
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

SHAPES = ["16384x2048x4096", "16384x4096x2048", "65536x768x2048"]  # M x N x K
TILES = [(128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 2),
         (128, 128, 64, 4, 4)]  # BM, BN, BK, warps, stages
VARIANTS = [("bf16 B", False, False), ("bf16 B, warp_specialize", False, True),
            ("decode B in the K loop", True, False), ("decode B, warp_specialize", True, True)]


def _scratch(size, alignment, stream):
    """Global scratch for the kernels' device-side TMA descriptors."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _decode(codes, scales, BN: tl.constexpr, BK: tl.constexpr):
    """codes (BN, BK/2) uint8, two E2M1 codes a byte (low nibble first), and scales (BK/16, BN)
    E4M3 bytes -> (BK, BN) bf16 deq() values: the E2M1 value's bf16 bits made with integer
    ops, times its block's scale (exact: 2 x 4 significant bits)."""
    n = tl.reshape(tl.join((codes & 0xF).to(tl.int16), (codes >> 4).to(tl.int16)), (BN, BK))
    magnitude = n & 7
    exponent = magnitude >> 1
    normal = ((exponent + 126) << 7) | ((magnitude & 1) << 6)  # 1, 1.5, 2, 3, 4, 6
    bits = tl.where(exponent == 0, tl.where(magnitude == 1, 0x3F00, 0), normal)  # 0.5, 0
    value = ((bits | ((n & 8) << 12)).to(tl.int16)).to(tl.bfloat16, bitcast=True).to(tl.float32)
    scale = scales.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    value = tl.reshape(value, (BN, BK // 16, 16)) * tl.reshape(tl.trans(scale), (BN, BK // 16, 1))
    return tl.trans(tl.reshape(value, (BN, BK)).to(tl.bfloat16))


@triton.jit
def _gemm(a_ptr, b_ptr, codes_ptr, scales_ptr, out_ptr, M, N, K, DECODE: tl.constexpr, WS: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    pm, pn = pid % tiles_m, pid // tiles_m
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    if DECODE:
        codes_desc = tl.make_tensor_descriptor(codes_ptr, shape=[N, K // 2], strides=[K // 2, 1],
                                               block_shape=[BN, BK // 2])
        scales_desc = tl.make_tensor_descriptor(scales_ptr, shape=[K // 16, N], strides=[N, 1],
                                                block_shape=[BK // 16, BN])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES, warp_specialize=WS):
        k = ki * BK
        if DECODE:
            b = _decode(codes_desc.load([pn * BN, k // 2]), scales_desc.load([k // 16, pn * BN]), BN, BK)
        else:
            b = tl.trans(b_desc.load([pn * BN, k]))
        acc = tl.dot(a_desc.load([pm * BM, k]), b, acc)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _dequantize(codes_ptr, scales_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """B's deq() values (N, K) bf16, one (BN, BK) tile a program: today's extra pass."""
    pn, pk = tl.program_id(0), tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    codes = tl.load(codes_ptr + rn[:, None] * (K // 2) + pk * (BK // 2) + tl.arange(0, BK // 2)[None, :])
    scales = tl.load(scales_ptr + (pk * (BK // 16) + tl.arange(0, BK // 16))[:, None] * N + rn[None, :])
    rk = pk * BK + tl.arange(0, BK)
    tl.store(out_ptr + rn[:, None] * K + rk[None, :], tl.trans(_decode(codes, scales, BN, BK)))


DEQ_TILE = (64, 128)  # BN, BK of _dequantize


def random_weight(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, K/2) uint8 with every code, scales (K/16, N) as E4M3 bytes in [0.5, 8.5))."""
    gen = torch.Generator(device=device).manual_seed(0)
    codes = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8, generator=gen)
    scales = (torch.rand(k // 16, n, device=device, generator=gen) * 8 + 0.5).to(torch.float8_e4m3fn)
    return codes, scales.view(torch.uint8)


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """B's deq() values by ``_dequantize`` (CUDA, or the Triton interpreter on the CPU)."""
    n, k = codes.shape[0], 2 * codes.shape[1]
    out = torch.empty(n, k, device=codes.device, dtype=torch.bfloat16)
    bn, bk = DEQ_TILE
    _dequantize[(n // bn, k // bk)](codes, scales, out, n, k, BN=bn, BK=bk, num_warps=4)
    return out


def expected(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The package's deq() values of the same operand (scales back in (N, K/16) order)."""
    return operand_values(codes, scales.t().contiguous().view(torch.float8_e4m3fn)).to(torch.bfloat16)


def best_time(a, b, codes, scales, out, want, decode, ws):
    """(us, tile) of the fastest tile that compiles and matches `want`; failures printed."""
    m, k = a.shape
    n = want.shape[1]
    best = None
    for bm, bn, bk, warps, stages in TILES:
        tile = f"{bm}x{bn}x{bk} w{warps} s{stages}"

        def launch():
            _gemm[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](a, b, codes, scales, out, m, n, k, DECODE=decode, WS=ws,
                                                              BM=bm, BN=bn, BK=bk, STAGES=stages, num_warps=warps)
        try:
            launch()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects is reported, not fatal
            print(f"  {tile}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}", flush=True)
            continue
        error = ((out.float() - want).abs().max() / want.abs().max()).item()
        if error > 1e-2:
            print(f"  {tile}: wrong result (relative error {error:.3g})", flush=True)
            continue
        us = triton.testing.do_bench(launch) * 1e3
        print(f"  {tile}: {us:.0f} us", flush=True)
        if best is None or us < best[0]:
            best = (us, tile)
    return best


def run(shape: str) -> list[list[str]]:
    m, n, k = (int(v) for v in shape.split("x"))
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    codes, scales = random_weight(n, k, "cuda")
    b = dequantize(codes, scales)
    if not torch.equal(b, expected(codes, scales)):
        raise AssertionError("the dequantize kernel's values differ from formats.operand_values")
    want = a.float() @ b.float().t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    rows = [[shape, "torch.mm on bf16 B", f"{triton.testing.do_bench(lambda: torch.mm(a, b.t(), out=out)) * 1e3:.0f}",
             "-"]]
    rows.append([shape, "dequantize pass", f"{triton.testing.do_bench(lambda: dequantize(codes, scales)) * 1e3:.0f}",
                 "-"])
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
        parser.error("needs a CUDA GPU (the decode alone runs on the CPU: tests/test_benchmark_grouped_mlp_smoke.py)")
    for shape in opts.shapes:
        if len(shape.split("x")) != 3 or any(int(v) % 128 for v in shape.split("x")):
            parser.error(f"--shapes: {shape!r} is not M x N x K with each a multiple of 128")
    from grouped_mlp import machine_line  # beside this file; imported here, where a GPU run needs it

    print(machine_line("cuda"), flush=True)
    triton.set_allocator(_scratch)
    rows = [row for shape in opts.shapes for row in run(shape)]
    print("\n" + format_table(["M x N x K", "kernel", "us", "best tile"], rows))
    return rows


if __name__ == "__main__":
    main()
