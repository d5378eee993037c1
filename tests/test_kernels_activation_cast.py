"""``kernels.activation_group_quantize``: the cast that makes D = bf16(f(C) * p) from C as it
loads it (group_cast's ACT_IN), bit for bit ``group_quantize(activation_forward(C, ...))``,
the two launches it replaces in the backward's recompute of the fc2 input. Every copy
the cast can write (column-wise RHT, the backward's; row-wise RNE, SR and deq(); row +
column in one launch), each activation with a Triton kernel, with and without router
probabilities, on uneven groups with an empty one and a K tail, and on C values that
make D's blocks zero, saturate, underflow and take subnormal scales. SReLU is also held
to the reference chain (``activations.py`` + ``numerics.py``: only products, so exact on
every device); tanh-SReLU and SwiGLU call tanh / exp, whose kernel values differ from
torch's by ulps (tests/test_kernels_activation.py), so they are held to the Triton chain.
"""

from __future__ import annotations

import pytest
import torch

from _assertions import assert_nvfp4_equal

triton = pytest.importorskip("triton")
from nvfp4_inductor import activations, kernels, numerics  # noqa: E402
from nvfp4_inductor.kernels import config  # noqa: E402
from nvfp4_inductor.kernels.activation import activation_forward  # noqa: E402
from nvfp4_inductor.kernels.config import CastConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not kernels.available(DEVICE):
    pytest.skip(f"Triton kernels cannot run on {DEVICE}", allow_module_level=True)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ACTIVATIONS = [("srelu", None), ("tanh_srelu", 2.5), ("swiglu", None)]
COPIES = {
    "col-rht": dict(rowwise=False, columnwise=True, rht=True),  # the backward's D cast
    "row-rne": dict(rowwise=True, columnwise=False),
    "row-sr": dict(rowwise=True, columnwise=False, stochastic_rounding=True, seed=17),
    "row-deq": dict(rowwise=True, columnwise=False, rowwise_deq=True),
    "row+col": dict(rowwise=True, columnwise=True, rht=True),
}


def _c(tokens: int, f: int, gated: bool, seed: int) -> torch.Tensor:
    """C with rows whose D blocks are zero, saturate against the group amax, underflow, or
    have subnormal E4M3 scales (tiny rows beside a large one)."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(tokens, 2 * f if gated else f, generator=gen) * torch.randn(tokens, 1, generator=gen).exp()
    c[0, :16] = 0.0  # a zero block of D
    c[1, :16] = -1.0  # relu -> zero (SReLU), a small negative D (SwiGLU)
    c[2, :] *= 2.0**-12  # tiny D blocks: subnormal scales beside row 3
    c[3, 0] = 200.0  # a large D element: saturation against the group amax
    return c.to(torch.bfloat16).to(DEVICE)


def _probs(tokens: int, dtype, seed: int):
    if dtype is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, generator=gen).to(dtype).to(DEVICE)


def _amaxes(d, sizes):
    pre, post = kernels.group_hadamard_amax(d, sizes)
    return dict(rowwise_amax=pre, columnwise_amax=post)


def _both(c, probs, activation, scale, sizes, copies):
    """(fused cast, activation kernel then cast) with D's amaxes supplied, as the backward does."""
    d = activation_forward(c, probs, activation, scale)
    amax = _amaxes(d, sizes)
    options = dict(copies, rowwise_amax=amax["rowwise_amax"] if copies["rowwise"] else None,
                   columnwise_amax=amax["columnwise_amax"] if copies["columnwise"] else None)
    fused = kernels.activation_group_quantize(c, probs, activation, scale, sizes, **options)
    return fused, kernels.group_quantize(d, sizes, **options), d, options


# every copy with SReLU; the backward's column-wise copy and the SR row copy (the kernel's two
# load paths: 16 tokens held, one token a step) with each activation and probability dtype
CASES = [("srelu", None, copies, torch.float32) for copies in COPIES] + [
    ("srelu", None, "col-rht", None), ("srelu", None, "row-sr", torch.bfloat16),
    ("tanh_srelu", 2.5, "col-rht", torch.float32), ("tanh_srelu", 2.5, "row-sr", None),
    ("swiglu", None, "col-rht", torch.float32), ("swiglu", None, "col-rht", None),
    ("swiglu", None, "row-sr", torch.bfloat16), ("swiglu", None, "row+col", torch.float32),
]


@pytest.mark.parametrize("activation,scale,copies,probs_dtype", CASES,
                         ids=[f"{a}-{c}-{str(p).removeprefix('torch.')}" for a, _, c, p in CASES])
def test_activation_cast_equals_activation_then_cast(activation, scale, copies, probs_dtype):
    gated = activations.get_activation(activation).gated
    sizes = torch.tensor([21, 0, 40, 9], device=DEVICE)  # uneven, one empty, runs past group ends
    c = _c(70, 80, gated, seed=len(activation) + len(copies))  # F = 80: a tail past 32/64-column blocks
    probs = _probs(70, probs_dtype, seed=3)
    fused, unfused, _, _ = _both(c, probs, activation, scale, sizes, COPIES[copies])
    assert_nvfp4_equal(fused, unfused, f"{activation} {copies} {probs_dtype}")


@pytest.mark.parametrize("copies", ["col-rht", "row-sr"])
def test_srelu_activation_cast_equals_the_reference_chain(copies):
    sizes = torch.tensor([33, 0, 31], device=DEVICE)
    c = _c(64, 48, False, seed=9)
    probs = _probs(64, torch.float32, seed=4)
    fused, _, d, options = _both(c, probs, "srelu", None, sizes, COPIES[copies])
    d_ref = activations.activation_forward(c.cpu(), probs.cpu(), "srelu")
    assert torch.equal(d.cpu(), d_ref)
    ref_options = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    assert_nvfp4_equal(fused, numerics.group_quantize_torch(d_ref, sizes.cpu(), **ref_options), f"srelu {copies}")


@pytest.mark.parametrize("tiles", [CastConfig(16, 32, 1, k_blocks=2), CastConfig(16, 32, 1, k_blocks=2, token_unroll=1),
                                   CastConfig(32, 256, 4, k_blocks=1)],
                         ids=["16x32 k2", "16x32 k2 u1", "32x256 w4 k1 (the GPU's act_in column default)"])
def test_activation_cast_tiles_change_no_bit(tiles):
    """The token loop and column-block loop take the prologue too; so does a block wider
    than C (config.cast_config's act_in tiles, masked here past column 96)."""
    sizes = torch.tensor([18, 30], device=DEVICE)
    c = _c(48, 96, True, seed=5)
    with config.override(cast=tiles):
        for copies in ("col-rht", "row-sr"):
            fused, unfused, _, _ = _both(c, None, "swiglu", None, sizes, COPIES[copies])
            assert_nvfp4_equal(fused, unfused, f"swiglu {copies} {tiles}")


def test_activation_cast_needs_supplied_amaxes():
    c = _c(32, 32, False, seed=1)
    sizes = torch.tensor([32], device=DEVICE)
    with pytest.raises(ValueError, match="supply the amax"):
        kernels.activation_group_quantize(c, None, "srelu", None, sizes, rowwise=False, columnwise=True)


def test_activation_cast_rejects_bad_input():
    sizes = torch.tensor([32], device=DEVICE)
    amax = torch.ones(1, device=DEVICE)
    c = _c(32, 32, False, seed=1)
    with pytest.raises(ValueError, match="probs"):
        kernels.activation_group_quantize(c, torch.ones(31, device=DEVICE), "srelu", None, sizes, rowwise_amax=amax)
    with pytest.raises(NotImplementedError, match="bf16"):
        kernels.activation_group_quantize(c.float(), None, "srelu", None, sizes, rowwise_amax=amax)
    with pytest.raises(ValueError, match="tanh_clamp_scale"):
        kernels.activation_group_quantize(c, None, "tanh_srelu", None, sizes, rowwise_amax=amax)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("activation,scale", ACTIVATIONS, ids=[a for a, _ in ACTIVATIONS])
def test_gpu_activation_cast_big(activation, scale):
    """128 uneven groups at S4's width (F = 768), the default tiles: the backward's D cast."""
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 200, (128,), generator=gen)
    sizes[5] = 0
    sizes = sizes.to(DEVICE)
    tokens = int(sizes.sum())
    gated = activations.get_activation(activation).gated
    c = _c(tokens, 768, gated, seed=1)
    probs = _probs(tokens, torch.float32, seed=2)
    for copies in ("col-rht", "row-sr", "row+col"):
        fused, unfused, _, _ = _both(c, probs, activation, scale, sizes, COPIES[copies])
        assert_nvfp4_equal(fused, unfused, f"gpu {activation} {copies}")
