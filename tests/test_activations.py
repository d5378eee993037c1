"""nvfp4_inductor/activations.py through ``torch.ops.nvfp4.activation`` /
``activation_backward``: gradients, the regenerated D, and the pinned dprob order.

* gradcheck in fp64 (the reference keeps fp64 as fp64 for this purpose) on the op with its
  registered autograd formula, for every activation, with and without router probs. Inputs
  keep |c| > 1e-2 so no finite-difference step of gradcheck (eps = 1e-6) crosses the kink
  of relu at 0 (SReLU, tanh-SReLU).
* ``activation_backward(regenerate=True)`` hands back D with exactly the bytes of
  ``activation_forward`` (the backward recompute of the fc2 input, numerics.md 5/6).
* ``row_sum`` (the dprob reduction) equals a hand-written loop in the documented order,
  and differs from a naive left-to-right sum on an adversarial row: the order is pinned,
  not whatever torch.sum picks. dprob is identical across runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _assertions import assert_bytes_equal
from nvfp4_inductor import ops  # noqa: F401  (registers torch.ops.nvfp4)
from nvfp4_inductor.activations import activation_backward, activation_forward, row_sum

nvfp4 = torch.ops.nvfp4

ACTS = [("srelu", None), ("tanh_srelu", 3.0), ("swiglu", None)]
ACT_IDS = [a for a, _ in ACTS]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _away_from_kink(c: torch.Tensor, margin: float = 1e-2) -> torch.Tensor:
    """Push every |c| above `margin`, keeping its sign (0 goes to +margin)."""
    sign = torch.where(c < 0, -1.0, 1.0).to(c.dtype)
    return sign * (c.abs() + margin)


def _inputs(seed, activation, with_probs, t=8, f=16, dtype=torch.float64, scale=2.0):
    gen = _gen(seed)
    f1 = 2 * f if activation == "swiglu" else f
    c = _away_from_kink(torch.randn(t, f1, generator=gen, dtype=torch.float64) * scale).to(dtype)
    g = torch.randn(t, f, generator=gen, dtype=torch.float64).to(dtype)
    probs = torch.rand(t, generator=gen, dtype=torch.float64) if with_probs else None
    return c, g, probs


# ---------------------------------------------------------------------------------------
# gradcheck


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_gradcheck(activation, clamp, with_probs):
    c, _, probs = _inputs(1, activation, with_probs)
    c.requires_grad_()
    inputs = (c, probs.requires_grad_()) if with_probs else (c,)

    def fn(*args):
        return nvfp4.activation(args[0], args[1] if with_probs else None, activation, clamp)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_tanh_srelu_saturating_clamp():
    """A small clamp (0.5) puts many inputs deep in tanh's saturation, where f' -> 0."""
    c, _, probs = _inputs(2, "tanh_srelu", True, scale=3.0)
    c.requires_grad_()
    probs.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda c_, p_: nvfp4.activation(c_, p_, "tanh_srelu", 0.5), (c, probs), eps=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_forward_matches_spec_formula(activation, clamp):
    """D = bf16(f(float(C)) * p), f written out from numerics.md 5 independently of activations.py."""
    c, _, probs = _inputs(3, activation, True, t=32, f=32, dtype=torch.bfloat16)
    probs = probs.float()
    cf = c.float()
    if activation == "srelu":
        f = torch.relu(cf) ** 2
    elif activation == "tanh_srelu":
        f = (clamp * torch.tanh(torch.relu(cf) / clamp)) ** 2
    else:
        a, u = cf[:, :32], cf[:, 32:]
        f = torch.nn.functional.silu(a) * u
    expected = (f * probs[:, None]).to(torch.bfloat16)
    actual = nvfp4.activation(c, probs, activation, clamp)
    # the formula's operation order may differ from the pinned one by an fp32 ulp, which can
    # flip a bf16 rounding: allow one bf16 ulp, on a few elements at most
    diff = (actual.float() - expected.float()).abs()
    ulp = expected.float().abs() * 2.0**-7 + 1e-30
    assert bool((diff <= ulp).all()), f"max |diff| / bf16 ulp = {float((diff / ulp).max())}"
    assert int((diff > 0).sum()) <= actual.numel() // 100


# ---------------------------------------------------------------------------------------
# Backward: regenerated D, determinism


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_regenerated_d_is_forward_d(activation, clamp, with_probs):
    c, g, probs = _inputs(4, activation, with_probs, t=64, f=32, dtype=torch.bfloat16, scale=3.0)
    probs = probs.float() if probs is not None else None
    d_fwd = nvfp4.activation(c, probs, activation, clamp)
    _, _, d_regen = nvfp4.activation_backward(g, c, probs, activation, clamp, True)
    assert_bytes_equal(d_regen, d_fwd, f"regenerated D ({activation})")
    # and the reference function itself
    assert_bytes_equal(activation_backward(g, c, probs, activation, clamp, regenerate=True)[2],
                       activation_forward(c, probs, activation, clamp), "reference regenerated D")


@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_dprob_deterministic(activation, clamp):
    c, g, probs = _inputs(5, activation, True, t=64, f=64, dtype=torch.bfloat16, scale=3.0)
    probs = probs.float()
    first = nvfp4.activation_backward(g, c, probs, activation, clamp, False)
    second = nvfp4.activation_backward(g.clone(), c.clone(), probs.clone(), activation, clamp, False)
    for name, a, b in zip(("dC", "dprobs"), first[:2], second[:2]):
        assert_bytes_equal(a, b, f"{name}, second run")
    assert first[1].dtype == torch.float32


@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_dprob_is_row_sum_of_g_times_f(activation, clamp):
    """dp = row_sum(float(G) * f(float(C))) in fp32, bit for bit (f without the prob)."""
    c, g, probs = _inputs(6, activation, True, t=32, f=48, dtype=torch.bfloat16, scale=3.0)
    probs = probs.float()
    f = activation_forward(c.float(), None, activation, clamp)  # fp32 in, fp32 out: unrounded f
    expected = row_sum(g.float() * f)
    assert_bytes_equal(nvfp4.activation_backward(g, c, probs, activation, clamp, False)[1], expected, "dprobs")


# ---------------------------------------------------------------------------------------
# row_sum: the pinned order


def _row_sum_loop(row: np.ndarray) -> np.float32:
    """The documented order, by hand in fp32: in each run of 16, a halving tree
    (x[:8] + x[8:], then 4, 2, 1); then the run totals left to right from 0."""
    total = np.float32(0.0)
    for start in range(0, len(row), 16):
        part = [np.float32(v) for v in row[start:start + 16]]
        while len(part) > 1:
            half = len(part) // 2
            part = [np.float32(part[i] + part[i + half]) for i in range(half)]
        total = np.float32(total + part[0])
    return total


def _naive_sum(row: np.ndarray) -> np.float32:
    total = np.float32(0.0)
    for v in row:
        total = np.float32(total + np.float32(v))
    return total


def test_row_sum_matches_hand_loop():
    v = torch.randn(8, 64, generator=_gen(7)) * torch.logspace(-3, 3, 64)
    expected = torch.tensor([_row_sum_loop(r) for r in v.numpy()], dtype=torch.float32)
    assert_bytes_equal(row_sum(v), expected, "row_sum vs hand loop")


def test_row_sum_order_is_pinned_not_left_to_right():
    """Row [2**24, 1 x 15]: left to right every +1 is lost to round-to-even (2**24 + 1 is a
    tie), giving 2**24; the halving tree adds the ones among themselves first, 2**24 + 14."""
    row = np.array([2.0**24] + [1.0] * 15 + [0.0] * 16, dtype=np.float32)
    assert _naive_sum(row) == np.float32(2.0**24)
    assert _row_sum_loop(row) == np.float32(2.0**24 + 14)
    got = row_sum(torch.from_numpy(row).unsqueeze(0))
    assert float(got[0]) == 2.0**24 + 14, f"row_sum gave {float(got[0])}"


def test_dprob_uses_the_pinned_order():
    """Through activation_backward: srelu with C chosen so that G * f(C) is the adversarial
    row above; dprob must be the tree sum, not the left-to-right one."""
    c = torch.zeros(1, 32, dtype=torch.bfloat16)
    c[0, :16] = 1.0  # f = 1
    g = torch.zeros(1, 32, dtype=torch.bfloat16)
    g[0, 0] = 2.0**24
    g[0, 1:16] = 1.0
    _, dp, _ = nvfp4.activation_backward(g, c, torch.ones(1), "srelu", None, False)
    assert float(dp[0]) == 2.0**24 + 14
