"""Cases and the fp64 reference of the grouped GEMM tests (no pytest import): random NVFP4
operands of the GEMMs of one training step of a grouped MLP, the exact (fp64) GEMM of their
deq() values, and the bound a GEMM's bf16 output must meet against it. Shared by
tests/test_kernels_gemm_bf16.py (the bf16-operand GEMMs) and tests/test_native_fp4.py (the
FP4 tensor-core GEMMs).

The kernels accumulate in fp32 and round once to bf16, so per element

    |out - ref| <= 1.01 * 2**-8 * |ref| + 2 * K * 2**-24 * alpha * sum_k |deq(a)| |deq(b)|

(half a bf16 ulp, 2**-8 relative, for the output rounding; the second term is the
worst-case fp32 accumulation error of K terms, with the alpha multiply absorbed in the
1.01): ``check_bound``.

    nvfp4(*shape, gen)                  random packed codes and E4M3 scale bits
    Step, gemm_dims                     a training step's sizes; each GEMM's (N, K) / (N, M)
    fprop_case / wgrad_case             one GEMM's random operands, seeded by its name
    fprop_ref / wgrad_ref               the fp64 GEMM and its |a| |b| sum
    check_bound                         the bound above, elementwise
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from nvfp4_inductor import numerics
from nvfp4_inductor.formats import block_values
from nvfp4_inductor.tensor import Operand

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------
# Inputs and the fp64 reference


def nvfp4(*shape, gen, device=DEVICE):
    """Random packed codes (every code, both signs) and E4M3 scale bits spanning subnormal
    (0x01..0x07) to 448 (0x7E); no NaN code (0x7F)."""
    data = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    scale = torch.randint(0, 0x7F, (*shape[:-1], shape[-1] // 8), dtype=torch.uint8, generator=gen)
    return data.to(device), scale.view(torch.float8_e4m3fn).to(device)


def deq64(data, scale):
    shape = data.shape
    vals = block_values(data.reshape(-1, shape[-1]), scale.reshape(-1, scale.shape[-1]))
    return vals.reshape(*shape[:-1], 2 * shape[-1]).double()


def check_bound(out, ref, absref, k, label):
    """The module docstring's bound, elementwise (`ref`, `absref` from ``fprop_ref`` /
    ``wgrad_ref``, `k` the GEMM's K); returns the relative error."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape, f"{label}: {out.dtype} {tuple(out.shape)}"
    err = (out.double() - ref).abs()
    bound = 1.01 * 2.0**-8 * ref.abs() + 2.0 * k * 2.0**-24 * absref + 1e-300
    bad = err > bound
    rel = (err.norm() / ref.norm().clamp_min(1e-300)).item()
    assert not bad.any(), (
        f"{label}: {int(bad.sum())} of {bad.numel()} elements outside the bound; worst err/bound "
        f"{(err / bound).max().item():.3g}; relative error {rel:.3g}"
    )
    return rel


def fprop_ref(a_operand, b_operand, sizes):
    (a, sa, aa), (b, sb, ba) = a_operand, b_operand
    av, bv = deq64(a, sa), deq64(b, sb)
    alpha = numerics.gemm_alpha(aa, ba).double()
    out = torch.zeros(av.shape[0], bv.shape[1], dtype=torch.float64, device=av.device)
    absout = torch.zeros_like(out)
    start = 0
    for g, m in enumerate(sizes.tolist()):
        rows = slice(start, start + m)
        out[rows] = alpha[g] * (av[rows] @ bv[g].T)
        absout[rows] = alpha[g] * (av[rows].abs() @ bv[g].abs().T)
        start += m
    return out, absout


def wgrad_ref(a_operand, b_operand, offsets):
    (a, sa, aa), (b, sb, ba) = a_operand, b_operand
    av, bv = deq64(a, sa), deq64(b, sb)
    alpha = numerics.gemm_alpha(aa, ba).double()
    offs = offsets.tolist()
    out = torch.zeros(len(offs) - 1, av.shape[0], bv.shape[0], dtype=torch.float64, device=av.device)
    absout = torch.zeros_like(out)
    for g in range(len(offs) - 1):
        cols = slice(offs[g], offs[g + 1])
        out[g] = alpha[g] * (av[:, cols] @ bv[:, cols].T)
        absout[g] = alpha[g] * (av[:, cols].abs() @ bv[:, cols].abs().T)
    return out, absout


# ---------------------------------------------------------------------------------------
# Cases: the GEMMs of one training step of a grouped MLP (a test file lists its Steps)


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    sizes: tuple[int, ...]
    hidden: int
    ffn: int
    swiglu: bool = False

    def __str__(self):
        return self.name


def gemm_dims(step: Step, which: str) -> tuple[int, int]:
    """(N, K) of a fprop/dgrad GEMM, (N, M) of a wgrad."""
    h, f = step.hidden, step.ffn
    f1 = 2 * f if step.swiglu else f
    return {
        "fc1_fprop": (f1, h), "fc2_fprop": (h, f), "fc2_dgrad": (f, h), "fc1_dgrad": (h, f1),
        "fc2_wgrad": (h, f), "fc1_wgrad": (f1, h),
    }[which]


def fprop_case(step, which, salt=""):
    """Random NVFP4 operands of one fprop/dgrad GEMM of `step`: (a, b, sizes), K."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{salt}{step.name}/{which}".encode()))
    sizes = torch.tensor(step.sizes, dtype=torch.int64, device=DEVICE)
    tokens, groups = sum(step.sizes), len(step.sizes)
    n, k = gemm_dims(step, which)
    a, sa = nvfp4(tokens, k // 2, gen=gen)
    b, sb = nvfp4(groups, n, k // 2, gen=gen)
    aa = (torch.rand(groups, generator=gen) * 4).to(DEVICE)
    ba = (torch.rand(groups, generator=gen) * 4).to(DEVICE)
    ba[0] = 0.0  # alpha 0: a group whose weight amax is 0
    return (Operand(a, sa, aa), Operand(b, sb, ba), sizes), k


def wgrad_case(step, which, salt=""):
    """Random column-wise NVFP4 operands of one wgrad GEMM of `step`: (a, b, offsets), P."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{salt}{step.name}/{which}".encode()))
    sizes = torch.tensor(step.sizes, dtype=torch.int64, device=DEVICE)
    tokens, groups = sum(step.sizes), len(step.sizes)
    n, m = gemm_dims(step, which)
    cap = numerics.columnwise_capacity(tokens, groups)
    _, _, offsets, _ = numerics.group_layout(sizes, tokens)
    a, sa = nvfp4(n, cap // 2, gen=gen)
    b, sb = nvfp4(m, cap // 2, gen=gen)
    aa = (torch.rand(groups, generator=gen) * 4).to(DEVICE)
    ba = (torch.rand(groups, generator=gen) * 4).to(DEVICE)
    return (Operand(a, sa, aa), Operand(b, sb, ba), offsets), cap
