"""The dequantize -> bf16 GEMM path (kernels/dequantize.py, kernels/grouped_gemm_bf16.py),
the Triton lowering's fprop/dgrad/wgrad.

* ``dequantize_bf16`` bit for bit against ``formats.block_values(...).to(bf16)`` (every code,
  both signs, subnormal to 448 scales), for a (R, C/2) copy and a (G, N, K/2) weight stack;
  ``dequantize_bf16_pair`` (both operands of a GEMM, one launch) the same for each output,
  with zero blocks, uneven and empty row counts, small tiles.
* ``grouped_gemm_via_bf16`` / ``grouped_gemm_wgrad_via_bf16`` against an fp64 matmul of the
  same exact deq() operands times alpha, within the fp64 bound of tests/gemm_cases.py
  (``check_bound``: half a bf16 ulp for the output rounding plus the worst-case fp32
  accumulation error of K terms). Cases are data (gemm_cases.py): every GEMM of a training step (fc1/fc2 fprop, dgrad, wgrad) on
  groups of uneven sizes, empty groups included and sizes not multiples of 16; plus
  operands from the real quantizers against the reference twins
  ``numerics.grouped_gemm_torch`` / ``grouped_gemm_wgrad_torch``. Determinism: two runs
  give the same bytes.

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without
CUDA); ``@pytest.mark.gpu`` tests run big shapes, the TMA variant included, on CUDA.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from nvfp4_inductor import numerics
from nvfp4_inductor.formats import block_values
from nvfp4_inductor.tensor import Operand

from _assertions import assert_bytes_equal
from gemm_cases import Step, check_bound, fprop_case, fprop_ref, nvfp4, wgrad_case, wgrad_ref

triton = pytest.importorskip("triton")
from nvfp4_inductor import kernels  # noqa: E402
from nvfp4_inductor.kernels import config  # noqa: E402
from nvfp4_inductor.kernels.config import Bf16GemmConfig  # noqa: E402
from nvfp4_inductor.kernels.config import DequantConfig  # noqa: E402
from nvfp4_inductor.kernels.dequantize import dequantize_bf16, dequantize_bf16_pair  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_bf16 import (_grouped_gemm_bf16_op, grouped_gemm_via_bf16,  # noqa: E402
                                                       grouped_gemm_wgrad_via_bf16, slice_rows)
from nvfp4_inductor.sizes import copy_slices  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not kernels.available(DEVICE):
    pytest.skip(f"Triton kernels cannot run on {DEVICE} (no CUDA and TRITON_INTERPRET unset)", allow_module_level=True)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---------------------------------------------------------------------------------------
# Cases: the GEMMs of one training step of a grouped MLP (gemm_cases.py)


STEPS = [
    Step("uneven_empty", (5, 0, 37, 16, 22, 0), 64, 48),
    Step("swiglu_edges", (0, 1, 15, 17, 0, 33), 32, 32, swiglu=True),
    Step("one_group", (45,), 48, 32),
]
# the GEMMs of a step by name (gemm_cases.gemm_dims: their sizes)
GEMMS = ["fc1_fprop", "fc2_fprop", "fc2_dgrad", "fc1_dgrad"]
WGRADS = ["fc2_wgrad", "fc1_wgrad"]


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



def edge_blocks(data, scale):
    """Overwrite some blocks of a random copy with the edge cases: zero codes under a
    nonzero scale, a zero scale over nonzero codes, and every subnormal scale (0x01-0x07)."""
    data, bits = data.clone(), scale.view(torch.uint8).clone()
    rows = data.reshape(-1, data.shape[-1])
    srows = bits.reshape(-1, bits.shape[-1])
    if rows.shape[0]:
        rows[0, :8] = 0
        srows[-1, -1] = 0
        srows[: min(7, srows.shape[0]), 0] = torch.arange(1, 1 + min(7, srows.shape[0]), dtype=torch.uint8)
    return data, bits.view(torch.float8_e4m3fn)


# (shape of a's data, shape of b's data): same packed width, uneven row counts, one or both
# empty, stacked weights against flat rows
PAIRS = [((37, 40), (130, 40)), ((3, 5, 24), (45, 24)), ((0, 16), (9, 16)), ((9, 16), (0, 16)),
         ((0, 8), (0, 8)), ((1, 8), (2, 3, 8))]


@pytest.mark.parametrize("tiles", [None, DequantConfig(16, 8, 1)], ids=["default_tiles", "small_tiles"])
@pytest.mark.parametrize("shapes", PAIRS, ids=str)
def test_dequantize_pair_bit_exact(shapes, tiles):
    """One launch for a GEMM's two operands: each output equals the reference bit for bit
    (and the single-operand launcher), whatever the row counts and tiles (small tiles:
    several row blocks of each operand and several column blocks)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"pair{shapes}".encode()))
    a, sa = edge_blocks(*nvfp4(*shapes[0], gen=gen))
    b, sb = edge_blocks(*nvfp4(*shapes[1], gen=gen))
    with config.override(dequant=tiles):
        out_a, out_b = dequantize_bf16_pair(a, sa, b, sb)
        single = dequantize_bf16(b, sb)
    for out, (data, scale), name in ((out_a, (a, sa), "a"), (out_b, (b, sb), "b")):
        assert out.dtype == torch.bfloat16 and out.shape == (*data.shape[:-1], 2 * data.shape[-1]), name
        assert_bytes_equal(out.cpu(), deq_ref(data, scale), f"dequantize pair {shapes} {name}")
    assert_bytes_equal(single, out_b, "single-operand launcher")


def test_dequantize_pair_is_one_launch_and_returns_no_aliases(monkeypatch):
    """Through the registered op (as a trace sees it): one launch, and torch's alias check
    passes (two outputs, neither a view of the other or of an input)."""
    from nvfp4_inductor.kernels import dequantize

    launches = []
    real = dequantize.launch
    monkeypatch.setattr(dequantize, "launch",
                        lambda kernel, grid, **kw: launches.append(grid) or real(kernel, grid, **kw))
    gen = torch.Generator().manual_seed(7)
    a, sa = nvfp4(70, 16, gen=gen)
    b, sb = nvfp4(3, 20, 16, gen=gen)
    out_a, out_b = torch.ops.nvfp4_kernels.dequantize_bf16_pair(a, sa.view(torch.uint8), b.reshape(60, 16),
                                                                sb.view(torch.uint8).reshape(60, 2))
    assert len(launches) == 1, launches
    assert_bytes_equal(out_a.cpu(), deq_ref(a, sa), "op a")
    assert_bytes_equal(out_b.cpu(), deq_ref(b, sb).reshape(60, 32), "op b")


def test_dequantize_pair_errors():
    data = torch.zeros(4, 8, dtype=torch.uint8, device=DEVICE)
    scale = torch.zeros(4, 1, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="same packed width"):
        dequantize_bf16_pair(data, scale, data[:, :0], scale[:, :0])
    with pytest.raises(ValueError, match="C % 16"):
        dequantize_bf16_pair(data, scale, data, scale[:, :0])


# ---------------------------------------------------------------------------------------
# GEMMs: fp64 bound, determinism, the reference twins


@pytest.mark.parametrize("which", GEMMS)
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_grouped_gemm_via_bf16(step, which):
    args, k = fprop_case(step, which, salt="bf16/")
    out = grouped_gemm_via_bf16(*args)
    ref, absref = fprop_ref(*args)
    check_bound(out, ref, absref, k, f"{step} {which} via bf16")
    assert_bytes_equal(grouped_gemm_via_bf16(*args), out, f"{step} {which} determinism")


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


def test_same_result_as_reference_twins_on_quantized_tensors():
    """Operands from the real quantizers, fc1 fprop and dW1: inside the fp64 bound and equal
    to numerics.grouped_gemm_torch / grouped_gemm_wgrad_torch up to fp32 accumulation order
    (fp32 matmuls of the same deq() values there)."""
    gen = torch.Generator().manual_seed(7)
    sizes = torch.tensor([3, 0, 29, 16], device=DEVICE)
    x = (torch.randn(48, 64, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    dc = torch.randn(48, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(4, 32, 64, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    xq = numerics.group_quantize_torch(x, sizes, columnwise=True, rht=True)
    dcq = numerics.group_quantize_torch(dc, sizes, columnwise=True, rht=True, stochastic_rounding=True, seed=3)
    wq = numerics.quantize_weights_torch(w)
    args = (xq.rowwise(), wq.rowwise(), sizes)
    out = grouped_gemm_via_bf16(*args)
    check_bound(out, *fprop_ref(*args), 64, "quantized fc1 fprop")
    assert bf16_ulps(out.cpu(), numerics.grouped_gemm_torch(*args).cpu()) <= 2
    wargs = (dcq.columnwise(), xq.columnwise(), xq.columnwise_offsets)
    wout = grouped_gemm_wgrad_via_bf16(*wargs)
    check_bound(wout, *wgrad_ref(*wargs), xq.columnwise_data.shape[1] * 2, "quantized dW1")
    assert bf16_ulps(wout.cpu(), numerics.grouped_gemm_wgrad_torch(*wargs).cpu()) <= 2


def whole_copy_gemm(a_operand, b_operand, sizes):
    """The GEMM on one bf16 copy of each whole operand (no slices)."""
    (a, sa, aa), (b, sb, ba) = a_operand, b_operand
    a16, b16 = dequantize_bf16_pair(a, sa, b, sb)
    return _grouped_gemm_bf16_op(a16, aa.float(), b16, ba.float(), sizes)


# 16x16 tiles, weight copies in slices of 16 rows or more
SMALL_SLICES = Bf16GemmConfig(16, 16, 32, 4, 1, 2, min_slice_rows=16)


@pytest.mark.parametrize("step", STEPS, ids=str)
def test_copy_slices_change_no_bit(step):
    """A packed weight stack's bf16 copy made a slice of its rows (out's columns) at a time
    where it is large beside the token operand's (sizes.copy_slices) gives the whole copy's
    result bit for bit -- slices of whole tiles and a partial one, K tails, empty groups, a
    zero-amax group."""
    with config.override(fprop=SMALL_SLICES):
        for which in GEMMS:
            args, _ = fprop_case(step, which, salt="slices/")
            a, b = args[0].data, args[1].data
            assert slice_rows(len(a), *b.shape[:2], SMALL_SLICES) < b.shape[1], which  # every GEMM here slices
            assert_bytes_equal(grouped_gemm_via_bf16(*args), whole_copy_gemm(*args), f"{step} {which}")


def test_copy_slices_rule():
    """Each slice at most half the token operand's copy, no slice under the minimum rows, at
    most 8; 1 for an unknown token count."""
    shapes = {"S1": (8, 16384, 4096), "S2": (8, 65536, 4096), "S3": (32, 32768, 2048), "S4": (128, 65536, 2048)}
    assert {name: copy_slices(t, g, h) for name, (g, t, h) in shapes.items()} == dict(S1=4, S2=1, S3=2, S4=2)
    assert copy_slices(65536, 128, 2048, min_rows=128) == 8 and copy_slices(16384, 8, 768) == 1
    assert copy_slices(100, 1, 10, min_rows=1) == 1 and copy_slices(0, 1, 10) == 1
    assert copy_slices(torch.fx.experimental.symbolic_shapes.ShapeEnv().create_unbacked_symint(), 8, 4096) == 1


def test_small_tiles_and_odd_k():
    """K not a multiple of BK (masked K tail), several M/N tiles per group, rows past N."""
    gen = torch.Generator().manual_seed(3)
    sizes = torch.tensor([40, 0, 7], device=DEVICE)
    a, sa = nvfp4(47, 40, gen=gen)  # K = 80
    b, sb = nvfp4(3, 36, 40, gen=gen)
    amax = torch.rand(3, generator=gen).to(DEVICE) + 0.5
    with config.override(fprop=Bf16GemmConfig(16, 16, 32, 4, 1, 3)):
        out = grouped_gemm_via_bf16(Operand(a, sa, amax), Operand(b, sb, amax), sizes)
    ref, absref = fprop_ref(Operand(a, sa, amax), Operand(b, sb, amax), sizes)
    check_bound(out, ref, absref, 80, "small tiles, K % BK != 0")


def test_zero_tokens_and_errors():
    gen = torch.Generator().manual_seed(0)
    a, sa = nvfp4(0, 16, gen=gen)
    b, sb = nvfp4(2, 32, 16, gen=gen)
    amax = torch.ones(2, device=DEVICE)
    zeros = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out = grouped_gemm_via_bf16(Operand(a, sa, amax), Operand(b, sb, amax), zeros)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="K/2"):
        grouped_gemm_via_bf16(Operand(a[:, :8], sa, amax), Operand(b, sb, amax), zeros)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_gemm_via_bf16(Operand(a, sa, amax), Operand(b, sb, amax),
                              torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="share P"):
        grouped_gemm_wgrad_via_bf16(Operand(a, sa, amax), Operand(b[0, :, :8], sb[0, :, :1], amax),
                                    torch.zeros(3, dtype=torch.int64))


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
def test_gpu_dequantize_pair_big():
    """The pair launch on CUDA (compiled kernel, its operand branch): both outputs bit for bit,
    for every GEMM's operand shapes of a step (fprop: flat rows and a weight stack;
    wgrad: two flat operands), uneven row counts, an empty operand, the edge blocks."""
    gen = torch.Generator().manual_seed(12)
    for shapes in [((4099, 1024), (8, 768, 1024)), ((2048, 4112), (1536, 4112)), ((0, 512), (8, 33, 512)),
                   ((77, 512), (0, 512))]:
        a, sa = edge_blocks(*nvfp4(*shapes[0], gen=gen))
        b, sb = edge_blocks(*nvfp4(*shapes[1], gen=gen))
        out_a, out_b = dequantize_bf16_pair(a, sa, b, sb)
        assert_bytes_equal(out_a.cpu(), deq_ref(a, sa), f"gpu dequantize pair {shapes} a")
        assert_bytes_equal(out_b.cpu(), deq_ref(b, sb), f"gpu dequantize pair {shapes} b")


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
    args = (Operand(a, sa, aa), Operand(b, sb, ba), sizes)
    tiles = Bf16GemmConfig(128, 256, 64, 8, 3, 0, tma, min_slice_rows=256)
    with config.override(fprop=tiles):
        out = grouped_gemm_via_bf16(*args)
        again = grouped_gemm_via_bf16(*args)
        # the weight copied in slices (sizes.copy_slices): 512 + 256 rows (n 768), 4 x 512
        # (n 2048); equal bit for bit to the GEMM on the whole copy
        assert slice_rows(tokens, 8, n, tiles) == 512
        assert_bytes_equal(out, whole_copy_gemm(*args), f"gpu weight slices n={n} k={k} tma={tma}")
    ref, absref = fprop_ref(*args)
    rel = check_bound(out, ref, absref, k, f"gpu fprop via bf16 n={n} k={k} tma={tma}")
    print(f"gpu grouped_gemm_via_bf16 n={n} k={k} tma={tma}: relative error {rel:.3g}")
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
    args = (Operand(a, sa, aa), Operand(b, sb, ba), offsets)
    with config.override(wgrad=Bf16GemmConfig(128, 256, 64, 8, 3, 0, tma)):
        out = grouped_gemm_wgrad_via_bf16(*args)
        again = grouped_gemm_wgrad_via_bf16(*args)
    ref, absref = wgrad_ref(*args)
    rel = check_bound(out, ref, absref, cap, f"gpu wgrad via bf16 tma={tma}")
    print(f"gpu grouped_gemm_wgrad_via_bf16 tma={tma}: relative error {rel:.3g}")
    assert_bytes_equal(out[1], torch.zeros_like(out[1]), "gpu wgrad empty group")
    assert_bytes_equal(again, out, "gpu wgrad determinism")
