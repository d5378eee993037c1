"""The activation kernels (kernels/activation.py) against activations.py on the CPU.

SReLU bit for bit; tanh-SReLU and SwiGLU (tanh / exp from another library) within 1 bf16
ulp on D and dC and 1e-5 relative on dp, with the largest difference in ulps printed.
Determinism: two runs give the same bytes. (The GEMM kernels' tests are in
tests/test_kernels_gemm_bf16.py and tests/test_kernels_epilogue.py.)

On a machine without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and the kernels run
in the interpreter on CPU tensors (tiny shapes). ``@pytest.mark.gpu`` tests run bigger
shapes on a CUDA device (``pytest -m gpu``) and are skipped, with the reason, without one.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_inductor import activations

from _assertions import assert_bytes_equal

triton = pytest.importorskip("triton")
from nvfp4_inductor import kernels  # noqa: E402
from nvfp4_inductor.kernels.activation import activation_backward, activation_forward  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not kernels.available(DEVICE):
    pytest.skip(f"Triton kernels cannot run on {DEVICE} (no CUDA and TRITON_INTERPRET unset)", allow_module_level=True)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
@pytest.mark.parametrize("activation", ["srelu", "tanh_srelu", "swiglu"])
def test_gpu_activations_big(activation):
    for with_probs in (True, False):
        report = compare_activation(activation, 4099, 768, with_probs, seed=3, exact=activation == "srelu")
        print(f"gpu {activation} probs={with_probs}: max ulp difference {report}")
