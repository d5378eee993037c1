"""The dequantize -> bf16 GEMM path (kernels/dequantize.py, kernels/grouped_gemm_bf16.py).

* ``dequantize_bf16`` bit for bit against ``formats.block_values(...).to(bf16)`` (every code,
  both signs, subnormal to 448 scales), for a (R, C/2) copy and a (G, N, K/2) weight stack.
* ``grouped_gemm_via_bf16`` / ``grouped_gemm_wgrad_via_bf16`` against the fp64 bound of
  tests/test_kernels_gemm.py (same cases: every GEMM of a training step, uneven and empty
  groups, sizes not multiples of 16), determinism, and against the in-register kernels:
  both meet the bound, so they differ by fp32 accumulation order alone (at most a couple of
  bf16 ulps per element, never more than the bound allows).

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without
CUDA); ``@pytest.mark.gpu`` tests run big shapes, the TMA variant included, on CUDA.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from nvfp4_inductor import numerics
from nvfp4_inductor.formats import block_values

from _assertions import assert_bytes_equal

triton = pytest.importorskip("triton")
from nvfp4_inductor import kernels  # noqa: E402
from nvfp4_inductor.kernels.dequantize import dequantize_bf16  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm import grouped_gemm  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_bf16 import (  # noqa: E402
    Bf16GemmConfig, grouped_gemm_via_bf16, grouped_gemm_wgrad_via_bf16, override_config,
)
from nvfp4_inductor.kernels.grouped_gemm_wgrad import grouped_gemm_wgrad  # noqa: E402
from test_kernels_gemm import (  # noqa: E402
    GEMMS, STEPS, WGRADS, check_bound, fprop_case, fprop_ref, nvfp4, wgrad_case, wgrad_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not kernels.available(DEVICE):
    pytest.skip(f"Triton kernels cannot run on {DEVICE} (no CUDA and TRITON_INTERPRET unset)", allow_module_level=True)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def deq_ref(data, scale):
    half = data.shape[-1]
    vals = block_values(data.reshape(-1, half).cpu(), scale.reshape(-1, half // 8).cpu())
    return vals.to(torch.bfloat16).reshape(*data.shape[:-1], 2 * half)


def bf16_ulps(a, b):
    ai, bi = a.contiguous().view(torch.int16).long(), b.contiguous().view(torch.int16).long()
    ai = torch.where(ai < 0, -(ai + 32768), ai)
    bi = torch.where(bi < 0, -(bi + 32768), bi)
    return int((ai - bi).abs().max()) if ai.numel() else 0


# ---------------------------------------------------------------------------------------
# dequantize


@pytest.mark.parametrize("shape", [(37, 40), (3, 5, 24), (1, 8), (130, 200), (0, 16)], ids=str)
def test_dequantize_bit_exact(shape):
    gen = torch.Generator().manual_seed(zlib.crc32(str(shape).encode()))
    data, scale = nvfp4(*shape, gen=gen)
    out = dequantize_bf16(data, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (*shape[:-1], 2 * shape[-1])
    assert_bytes_equal(out.cpu(), deq_ref(data, scale), f"dequantize {shape}")
    assert_bytes_equal(dequantize_bf16(data, scale.view(torch.uint8)), out, "uint8 scale bits")


def test_dequantize_errors():
    data = torch.zeros(4, 12, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="C % 16"):
        dequantize_bf16(data, torch.zeros(4, 1, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_bf16(data.float(), torch.zeros(4, 1, dtype=torch.uint8, device=DEVICE))


# ---------------------------------------------------------------------------------------
# GEMMs: fp64 bound, determinism, agreement with the in-register kernels


@pytest.mark.parametrize("which", GEMMS)
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_grouped_gemm_via_bf16(step, which):
    args, k = fprop_case(step, which, salt="bf16/")
    out = grouped_gemm_via_bf16(*args)
    ref, absref = fprop_ref(*args)
    check_bound(out, ref, absref, k, f"{step} {which} via bf16")
    assert_bytes_equal(grouped_gemm_via_bf16(*args), out, f"{step} {which} determinism")
    inreg = grouped_gemm(*args)
    check_bound(inreg, ref, absref, k, f"{step} {which} in-register")
    print(f"{step} {which}: via bf16 vs in-register, max {bf16_ulps(out, inreg)} bf16 ulps")


@pytest.mark.parametrize("which", WGRADS)
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_grouped_gemm_wgrad_via_bf16(step, which):
    args, cap = wgrad_case(step, which, salt="bf16/")
    sizes = torch.tensor(step.sizes, dtype=torch.int64, device=DEVICE)
    out = grouped_gemm_wgrad_via_bf16(*args)
    ref, absref = wgrad_ref(*args)
    check_bound(out, ref, absref, cap, f"{step} {which} via bf16")
    for g in (sizes == 0).nonzero().flatten().tolist():
        assert_bytes_equal(out[g], torch.zeros_like(out[g]), f"{step} {which}: empty group {g} is zeros")
    assert_bytes_equal(grouped_gemm_wgrad_via_bf16(*args), out, f"{step} {which} determinism")
    print(f"{step} {which}: via bf16 vs in-register, max {bf16_ulps(out, grouped_gemm_wgrad(*args))} bf16 ulps")


def test_same_result_as_reference_twin_on_quantized_tensors():
    """Operands from the real quantizers: equal to numerics.grouped_gemm_torch up to fp32
    accumulation order (fp32 matmul of the same deq() values there)."""
    gen = torch.Generator().manual_seed(7)
    sizes = torch.tensor([3, 0, 29, 16], device=DEVICE)
    x = (torch.randn(48, 64, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(4, 32, 64, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    xq = numerics.group_quantize_torch(x, sizes, columnwise=True, rht=True)
    wq = numerics.quantize_weights_torch(w)
    args = (xq.rowwise_data, xq.rowwise_scale, xq.rowwise_amax, wq.rowwise_data, wq.rowwise_scale, wq.amax, sizes)
    out = grouped_gemm_via_bf16(*args)
    expected = numerics.grouped_gemm_torch(*args)
    assert bf16_ulps(out.cpu(), expected.cpu()) <= 2


def test_small_tiles_and_odd_k():
    """K not a multiple of BK (masked K tail), several M/N tiles per group, rows past N."""
    gen = torch.Generator().manual_seed(3)
    sizes = torch.tensor([40, 0, 7], device=DEVICE)
    a, sa = nvfp4(47, 40, gen=gen)  # K = 80
    b, sb = nvfp4(3, 36, 40, gen=gen)
    amax = torch.rand(3, generator=gen).to(DEVICE) + 0.5
    with override_config(fprop=Bf16GemmConfig(16, 16, 32, 4, 1, 3)):
        out = grouped_gemm_via_bf16(a, sa, amax, b, sb, amax, sizes)
    ref, absref = fprop_ref(a, sa, amax, b, sb, amax, sizes)
    check_bound(out, ref, absref, 80, "small tiles, K % BK != 0")


def test_zero_tokens_and_errors():
    gen = torch.Generator().manual_seed(0)
    a, sa = nvfp4(0, 16, gen=gen)
    b, sb = nvfp4(2, 32, 16, gen=gen)
    amax = torch.ones(2, device=DEVICE)
    zeros = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out = grouped_gemm_via_bf16(a, sa, amax, b, sb, amax, zeros)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="K/2"):
        grouped_gemm_via_bf16(a[:, :8], sa, amax, b, sb, amax, zeros)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_gemm_via_bf16(a, sa, amax, b, sb, amax, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="share P"):
        grouped_gemm_wgrad_via_bf16(a, sa, amax, b[0, :, :8], sb[0, :, :1], amax, torch.zeros(3, dtype=torch.int64))


# ---------------------------------------------------------------------------------------
# GPU: big shapes, pointer and TMA loads (pytest -m gpu)

GPU_SIZES = [1000, 0, 17, 2900, 1, 4095, 0, 203]


@pytest.mark.gpu
@needs_cuda
def test_gpu_dequantize_big():
    gen = torch.Generator().manual_seed(11)
    for shape in [(4099, 1024), (8, 768, 1024)]:
        data, scale = nvfp4(*shape, gen=gen)
        assert_bytes_equal(dequantize_bf16(data, scale).cpu(), deq_ref(data, scale), f"gpu dequantize {shape}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("n,k", [(768, 2048), (2048, 768)])
def test_gpu_grouped_gemm_via_bf16_big(n, k, tma):
    gen = torch.Generator().manual_seed(n)
    sizes = torch.tensor(GPU_SIZES, device=DEVICE)
    tokens = int(sizes.sum())
    a, sa = nvfp4(tokens, k // 2, gen=gen)
    b, sb = nvfp4(8, n, k // 2, gen=gen)
    aa, ba = torch.rand(8, device=DEVICE) * 4, torch.rand(8, device=DEVICE) * 4
    args = (a, sa, aa, b, sb, ba, sizes)
    with override_config(fprop=Bf16GemmConfig(128, 256, 64, 8, 3, 0, tma)):
        out = grouped_gemm_via_bf16(*args)
        again = grouped_gemm_via_bf16(*args)
    ref, absref = fprop_ref(*args)
    rel = check_bound(out, ref, absref, k, f"gpu fprop via bf16 n={n} k={k} tma={tma}")
    print(f"gpu grouped_gemm_via_bf16 n={n} k={k} tma={tma}: relative error {rel:.3g}, "
          f"max {bf16_ulps(out, grouped_gemm(*args))} bf16 ulps from in-register")
    assert_bytes_equal(again, out, "gpu determinism")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_gpu_grouped_gemm_wgrad_via_bf16_big(tma):
    gen = torch.Generator().manual_seed(5)
    sizes = torch.tensor(GPU_SIZES, device=DEVICE)
    tokens = int(sizes.sum())
    cap = numerics.columnwise_capacity(tokens, 8)
    _, _, offsets, _ = numerics.group_layout(sizes, tokens)
    a, sa = nvfp4(768, cap // 2, gen=gen)
    b, sb = nvfp4(1024, cap // 2, gen=gen)
    aa, ba = torch.rand(8, device=DEVICE) * 4, torch.rand(8, device=DEVICE) * 4
    args = (a, sa, aa, b, sb, ba, offsets)
    with override_config(wgrad=Bf16GemmConfig(128, 256, 64, 8, 3, 0, tma)):
        out = grouped_gemm_wgrad_via_bf16(*args)
        again = grouped_gemm_wgrad_via_bf16(*args)
    ref, absref = wgrad_ref(*args)
    rel = check_bound(out, ref, absref, cap, f"gpu wgrad via bf16 tma={tma}")
    print(f"gpu grouped_gemm_wgrad_via_bf16 tma={tma}: relative error {rel:.3g}, "
          f"max {bf16_ulps(out, grouped_gemm_wgrad(*args))} bf16 ulps from in-register")
    assert_bytes_equal(out[1], torch.zeros_like(out[1]), "gpu wgrad empty group")
    assert_bytes_equal(again, out, "gpu wgrad determinism")
