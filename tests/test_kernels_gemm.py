"""Grouped NVFP4 GEMMs and activation kernels (Triton) against the references.

GEMMs (kernels/grouped_gemm.py, kernels/grouped_gemm_wgrad.py) are compared with an fp64
matmul of the same exact deq() operands times alpha. The kernels accumulate in fp32 (in a
permuted K order) and round once to bf16, so per element

    |out - ref| <= 1.01 * 2**-8 * |ref| + 2 * K * 2**-24 * alpha * sum_k |deq(a)| |deq(b)|

(half a bf16 ulp, 2**-8 relative, for the output rounding; the second term is the worst-case fp32
accumulation error of K terms, with the alpha multiply absorbed in the 1.01). Activations
(kernels/activation.py): SReLU bit for bit against activations.py; tanh-SReLU and SwiGLU
(tanh / exp from another library) within 1 bf16 ulp on D and dC and 1e-5 relative on dp,
with the largest difference in ulps printed. Determinism: two runs give the same bytes.

On a machine without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and the kernels run
in the interpreter on CPU tensors (tiny shapes). ``@pytest.mark.gpu`` tests run bigger
shapes on a CUDA device (``pytest -m gpu``) and are skipped, with the reason, without one.
Cases are data: every GEMM of a training step (fc1/fc2 fprop, dgrad, wgrad) on groups of
uneven sizes, empty groups included and sizes not multiples of 16.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from nvfp4_inductor import activations, numerics
from nvfp4_inductor.formats import block_values

from _assertions import assert_bytes_equal

triton = pytest.importorskip("triton")
from nvfp4_inductor import kernels  # noqa: E402
from nvfp4_inductor.kernels.activation import activation_backward, activation_forward  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm import grouped_gemm  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_wgrad import grouped_gemm_wgrad  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not kernels.available(DEVICE):
    pytest.skip(f"Triton kernels cannot run on {DEVICE} (no CUDA and TRITON_INTERPRET unset)", allow_module_level=True)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
    """The module docstring's bound, elementwise; also reports the relative error."""
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


def fprop_ref(a, sa, aa, b, sb, ba, sizes):
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


def wgrad_ref(a, sa, aa, b, sb, ba, offsets):
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
# Cases: the GEMMs of one training step of a grouped MLP


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    sizes: tuple[int, ...]
    hidden: int
    ffn: int
    swiglu: bool = False

    def __str__(self):
        return self.name


STEPS = [
    Step("uneven_empty", (5, 0, 37, 16, 22, 0), 64, 48),
    Step("swiglu_edges", (0, 1, 15, 17, 0, 33), 32, 32, swiglu=True),
    Step("one_group", (45,), 48, 32),
]
# (name, rows of a, N, K) of each fprop/dgrad GEMM; (name, N, M) of each wgrad
GEMMS = ["fc1_fprop", "fc2_fprop", "fc2_dgrad", "fc1_dgrad"]
WGRADS = ["fc2_wgrad", "fc1_wgrad"]


def gemm_dims(step: Step, which: str) -> tuple[int, int]:
    """(N, K) of a fprop/dgrad GEMM, (N, M) of a wgrad."""
    h, f = step.hidden, step.ffn
    f1 = 2 * f if step.swiglu else f
    return {
        "fc1_fprop": (f1, h), "fc2_fprop": (h, f), "fc2_dgrad": (f, h), "fc1_dgrad": (h, f1),
        "fc2_wgrad": (h, f), "fc1_wgrad": (f1, h),
    }[which]


def fprop_case(step, which, salt=""):
    """Random NVFP4 operands of one fprop/dgrad GEMM of `step`: (a..., b..., sizes), K."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{salt}{step.name}/{which}".encode()))
    sizes = torch.tensor(step.sizes, dtype=torch.int64, device=DEVICE)
    tokens, groups = sum(step.sizes), len(step.sizes)
    n, k = gemm_dims(step, which)
    a, sa = nvfp4(tokens, k // 2, gen=gen)
    b, sb = nvfp4(groups, n, k // 2, gen=gen)
    aa = (torch.rand(groups, generator=gen) * 4).to(DEVICE)
    ba = (torch.rand(groups, generator=gen) * 4).to(DEVICE)
    ba[0] = 0.0  # alpha 0: a group whose weight amax is 0
    return (a, sa, aa, b, sb, ba, sizes), k


def wgrad_case(step, which, salt=""):
    """Random column-wise NVFP4 operands of one wgrad GEMM of `step`: (a..., b..., offsets), P."""
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
    return (a, sa, aa, b, sb, ba, offsets), cap


@pytest.mark.parametrize("which", GEMMS)
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_grouped_gemm_vs_fp64(step, which):
    args, k = fprop_case(step, which)
    out = grouped_gemm(*args)
    ref, absref = fprop_ref(*args)
    check_bound(out, ref, absref, k, f"{step} {which}")
    assert_bytes_equal(grouped_gemm(*args), out, f"{step} {which} determinism")


@pytest.mark.parametrize("which", WGRADS)
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_grouped_gemm_wgrad_vs_fp64(step, which):
    args, cap = wgrad_case(step, which)
    sizes = torch.tensor(step.sizes, dtype=torch.int64, device=DEVICE)
    out = grouped_gemm_wgrad(*args)
    ref, absref = wgrad_ref(*args)
    check_bound(out, ref, absref, cap, f"{step} {which}")
    empty = (sizes == 0).nonzero().flatten().tolist()
    for g in empty:
        assert_bytes_equal(out[g], torch.zeros_like(out[g]), f"{step} {which}: empty group {g} is zeros")
    assert_bytes_equal(grouped_gemm_wgrad(*args), out, f"{step} {which} determinism")


def test_gemms_on_quantized_tensors():
    """Operands from the real quantizers (numerics): fc1 fprop and dW1, vs the reference
    functions' fp32 results and the fp64 bound."""
    gen = torch.Generator().manual_seed(7)
    sizes = torch.tensor([3, 0, 29, 16], device=DEVICE)
    x = (torch.randn(48, 64, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    dc = torch.randn(48, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(4, 32, 64, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    xq = numerics.group_quantize_torch(x, sizes, columnwise=True, rht=True)
    dcq = numerics.group_quantize_torch(dc, sizes, columnwise=True, rht=True, stochastic_rounding=True, seed=3)
    wq = numerics.quantize_weights_torch(w)
    args = (xq.rowwise_data, xq.rowwise_scale, xq.rowwise_amax, wq.rowwise_data, wq.rowwise_scale, wq.amax, sizes)
    out = grouped_gemm(*args)
    ref, absref = fprop_ref(*args)
    check_bound(out, ref, absref, 64, "quantized fc1 fprop")
    expected = numerics.grouped_gemm_torch(*args)
    assert (out.float() - expected.float()).abs().max() <= 2.0**-7 * expected.float().abs().max()
    wargs = (dcq.columnwise_data, dcq.columnwise_scale, dcq.columnwise_amax,
             xq.columnwise_data, xq.columnwise_scale, xq.columnwise_amax, xq.columnwise_offsets)
    wout = grouped_gemm_wgrad(*wargs)
    wref, wabs = wgrad_ref(*wargs)
    check_bound(wout, wref, wabs, xq.columnwise_data.shape[1] * 2, "quantized dW1")


def test_zero_tokens_and_errors():
    gen = torch.Generator().manual_seed(0)
    a, sa = nvfp4(0, 16, gen=gen)
    b, sb = nvfp4(2, 32, 16, gen=gen)
    amax = torch.ones(2, device=DEVICE)
    out = grouped_gemm(a, sa, amax, b, sb, amax, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="K/2"):
        grouped_gemm(a[:, :8], sa, amax, b, sb, amax, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_gemm(a, sa, amax, b, sb, amax, torch.zeros(3, dtype=torch.int64, device=DEVICE))


# ---------------------------------------------------------------------------------------
# Activations


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place between two same-dtype float tensors."""
    if a.numel() == 0:
        return 0
    itype = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    ai, bi = a.contiguous().view(itype).long(), b.contiguous().view(itype).long()
    bias = 1 << (8 * a.element_size() - 1)
    ai = torch.where(ai < 0, -(ai + bias), ai)  # sign-magnitude -> monotone integers
    bi = torch.where(bi < 0, -(bi + bias), bi)
    return int((ai - bi).abs().max())


def act_inputs(tokens, f, activation, gen, device=DEVICE):
    f1 = 2 * f if activation == "swiglu" else f
    c = torch.randn(tokens, f1, generator=gen) * 3
    c[0, : min(5, f1)] = -0.0
    c[1, : min(4, f1)] = 0.0
    g = torch.randn(tokens, f, generator=gen)
    p = torch.rand(tokens, generator=gen)
    return (c.to(torch.bfloat16).to(device), g.to(torch.bfloat16).to(device), p.to(device))


def compare_activation(activation, tokens, f, with_probs, seed, exact):
    gen = torch.Generator().manual_seed(seed)
    c, g, p = act_inputs(tokens, f, activation, gen)
    probs = p if with_probs else None
    scale = 2.5 if activation == "tanh_srelu" else None
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731  reference: activations.py on the CPU
    d = activation_forward(c, probs, activation, scale)
    d_ref = activations.activation_forward(c.cpu(), cpu(probs), activation, scale)
    dc, dp, d2 = activation_backward(g, c, probs, activation, scale, regenerate=True)
    dc_ref, dp_ref, d2_ref = activations.activation_backward(g.cpu(), c.cpu(), cpu(probs), activation, scale, regenerate=True)
    label = f"{activation} T={tokens} F={f} probs={with_probs}"
    assert_bytes_equal(d2, d, f"{label}: regenerated D == forward D")
    pairs = [("D", d, d_ref), ("dC", dc, dc_ref)] + ([("dp", dp, dp_ref)] if with_probs else [])
    report = {}
    for name, actual, expected in pairs:
        if exact:
            assert_bytes_equal(actual.cpu(), expected, f"{label}: {name}")
        report[name] = ulps(actual.cpu(), expected)
    if not with_probs:
        assert dp is None
    if not exact:
        print(f"{label}: max ulp difference vs activations.py on CPU {report}")
        assert report["D"] <= 1 and report["dC"] <= 1, f"{label}: {report}"
        if with_probs:
            assert torch.allclose(dp.cpu(), dp_ref, rtol=1e-5, atol=1e-5 * dp_ref.abs().max().item()), label
    # determinism
    dc2, dp2, _ = activation_backward(g, c, probs, activation, scale)
    assert_bytes_equal(dc2, dc, f"{label}: dC determinism")
    if with_probs:
        assert_bytes_equal(dp2, dp, f"{label}: dp determinism")
    return report


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("tokens,f", [(37, 48), (5, 160)])
def test_srelu_bit_exact(tokens, f, with_probs):
    compare_activation("srelu", tokens, f, with_probs, seed=tokens + f, exact=True)


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("activation", ["tanh_srelu", "swiglu"])
def test_transcendental_activations_within_ulp(activation, with_probs):
    compare_activation(activation, 37, 48, with_probs, seed=11, exact=False)


def test_activation_errors():
    c = torch.zeros(4, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="tanh_clamp_scale"):
        activation_forward(c, None, "tanh_srelu")
    with pytest.raises(ValueError, match="activation must be"):
        activation_forward(c, None, "gelu")
    with pytest.raises(NotImplementedError, match="bf16"):
        activation_forward(c.float(), None, "srelu")


# ---------------------------------------------------------------------------------------
# GPU: bigger shapes (pytest -m gpu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(768, 2048), (2048, 768)])
def test_gpu_grouped_gemm_big(n, k):
    gen = torch.Generator().manual_seed(n)
    sizes = torch.tensor([1000, 0, 17, 2900, 1, 4095, 0, 203], device=DEVICE)
    tokens = int(sizes.sum())
    a, sa = nvfp4(tokens, k // 2, gen=gen)
    b, sb = nvfp4(8, n, k // 2, gen=gen)
    aa, ba = torch.rand(8, device=DEVICE) * 4, torch.rand(8, device=DEVICE) * 4
    out = grouped_gemm(a, sa, aa, b, sb, ba, sizes)
    ref, absref = fprop_ref(a, sa, aa, b, sb, ba, sizes)
    rel = check_bound(out, ref, absref, k, f"gpu fprop n={n} k={k}")
    print(f"gpu grouped_gemm n={n} k={k}: relative error {rel:.3g}")
    assert_bytes_equal(grouped_gemm(a, sa, aa, b, sb, ba, sizes), out, "gpu determinism")


@pytest.mark.gpu
@needs_cuda
def test_gpu_grouped_gemm_wgrad_big():
    gen = torch.Generator().manual_seed(5)
    sizes = torch.tensor([1000, 0, 17, 2900, 1, 4095, 0, 203], device=DEVICE)
    tokens = int(sizes.sum())
    cap = numerics.columnwise_capacity(tokens, 8)
    _, _, offsets, _ = numerics.group_layout(sizes, tokens)
    a, sa = nvfp4(768, cap // 2, gen=gen)
    b, sb = nvfp4(1024, cap // 2, gen=gen)
    aa, ba = torch.rand(8, device=DEVICE) * 4, torch.rand(8, device=DEVICE) * 4
    out = grouped_gemm_wgrad(a, sa, aa, b, sb, ba, offsets)
    ref, absref = wgrad_ref(a, sa, aa, b, sb, ba, offsets)
    rel = check_bound(out, ref, absref, cap, "gpu wgrad")
    print(f"gpu grouped_gemm_wgrad: relative error {rel:.3g}")
    assert_bytes_equal(out[1], torch.zeros_like(out[1]), "gpu wgrad empty group")
    assert_bytes_equal(grouped_gemm_wgrad(a, sa, aa, b, sb, ba, offsets), out, "gpu wgrad determinism")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["srelu", "tanh_srelu", "swiglu"])
def test_gpu_activations_big(activation):
    for with_probs in (True, False):
        report = compare_activation(activation, 4099, 768, with_probs, seed=3, exact=activation == "srelu")
        print(f"gpu {activation} probs={with_probs}: max ulp difference {report}")
