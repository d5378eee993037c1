"""The ``torch.ops.nvfp4.*`` ops (nvfp4_inductor/ops.py and the fused ops of
nvfp4_inductor/compiler/fused.py): registration checks and reference equality.

Two things per op:

* ``torch.library.opcheck`` (schema, autograd registration, fake impl against the real
  one, AOT dispatch with dynamic shapes). Stochastic rounding is off in every opcheck:
  an SR op draws a fresh Philox seed from torch's generator on every call, so two calls
  with the same inputs differ by design and opcheck's "run twice and compare" checks
  would fail for a reason that is not a bug.
* Bit-for-bit equality of each op's outputs with the reference function in
  ``numerics.py`` / ``activations.py`` that it wraps (the CPU lowering). The fused ops
  are compared with the reference chain written out here from those functions.

Cases cover an empty group and group sizes that are not multiples of 16; shapes are
tiny (G = 4, H/F = 32..64, T = 64..96) so the whole file runs in seconds on a CPU.
Pruned: CUDA lowerings (no device here) and large shapes (nothing shape-specific in
the reference beyond multiples of 16, which the small cases already cover).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

from _assertions import assert_bytes_equal
from nvfp4_inductor import numerics
from nvfp4_inductor import ops  # noqa: F401  (registers torch.ops.nvfp4)
from nvfp4_inductor.activations import activation_backward, activation_forward
from nvfp4_inductor.compiler import fused
from nvfp4_inductor.recipe import DEFAULT_SIGN_MASK

nvfp4 = torch.ops.nvfp4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _assert_tuple_equal(actual, expected, label):
    assert len(actual) == len(expected), f"{label}: {len(actual)} outputs, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bytes_equal(a, e, f"{label}[{i}]")


def _ref_tuple(container, dtypes):
    """A reference dataclass's fields as the op returns them: an absent copy (None) is
    compared by the op's fake impl contract, an empty tensor of the copy's dtype."""
    fields = [getattr(container, f.name) for f in dataclasses.fields(container)]
    return tuple(torch.empty(0, dtype=d) if t is None else t for t, d in zip(fields, dtypes))


_QDTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float32) * 2


# opcheck's test_schema runs the op under SchemaCheckMode, which compares inputs before and
# after with torch.allclose: not implemented for float8_e4m3fn on the CPU in this torch. Ops
# that take E4M3 scales (the GEMMs, the backward op) get the same check by hand instead
# (_check_functional); the other three opcheck tests run as usual.
NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _check_functional(op, args, label):
    """What test_schema checks, by hand: no input mutated, no output aliases an input."""
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = op(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor):
            assert_bytes_equal(a, b, f"{label}: input {i} after the call")
    in_ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
    for j, o in enumerate(outs):
        assert not (o.numel() and o.untyped_storage().data_ptr() in in_ptrs), f"{label}: output {j} aliases an input"


# ---------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class QCase:
    m: int
    k: int
    rowwise: bool = True
    columnwise: bool = False
    rht: bool = False
    block_2d: bool = False
    dtype: torch.dtype = torch.bfloat16
    given_amax: bool = False

    def __str__(self):
        flags = [n for n in ("rowwise", "columnwise", "rht", "block_2d", "given_amax") if getattr(self, n)]
        return f"{self.m}x{self.k}-{str(self.dtype)[6:]}-" + "+".join(flags)


QUANTIZE_CASES = [
    QCase(32, 64),
    QCase(48, 32, columnwise=True),
    QCase(32, 32, rowwise=False, columnwise=True, rht=True),
    QCase(64, 48, columnwise=True, rht=True),
    QCase(32, 64, block_2d=True),
    QCase(48, 32, columnwise=True, block_2d=True),
    QCase(32, 32, columnwise=True, dtype=torch.float32),
    QCase(40, 32, dtype=torch.float16),  # row-wise only: M need not be a multiple of 16
]
QUANTIZE_GIVEN_AMAX = QCase(32, 32, columnwise=True, rht=True, given_amax=True)

# opcheck is ~1 s a call (AOT compile with dynamic shapes): one case per distinct code path
QUANTIZE_OPCHECK_CASES = [
    QCase(64, 48, columnwise=True, rht=True),
    QCase(32, 64, columnwise=True, rht=True, block_2d=True),
    pytest.param(QCase(32, 64), id="32x64-rowwise-only"),
    pytest.param(QCase(32, 32, rowwise=False, columnwise=True, rht=True),
                 id="32x32-columnwise-only"),
    pytest.param(QCase(48, 32, columnwise=True, dtype=torch.float32),
                 id="48x32-fp32-columnwise-no-rht"),
    pytest.param(QUANTIZE_GIVEN_AMAX, id="given-amax"),
]


@dataclasses.dataclass(frozen=True)
class GCase:
    sizes: tuple[int, ...]
    k: int = 32
    rowwise: bool = True
    columnwise: bool = True
    rht: bool = True
    sign_mask: int = DEFAULT_SIGN_MASK
    given_amax: bool = False

    def __str__(self):
        flags = [n for n in ("rowwise", "columnwise", "rht", "given_amax") if getattr(self, n)]
        return f"{'-'.join(map(str, self.sizes))}xK{self.k}-mask{self.sign_mask:x}-" + "+".join(flags)


# (20, 0, 37, 23): an empty group and sizes not multiples of 16 (T = 80)
UNEVEN = (20, 0, 37, 23)
GROUP_CASES = [
    GCase(UNEVEN),
    GCase(UNEVEN, rht=False),
    GCase(UNEVEN, rowwise=False),
    GCase(UNEVEN, columnwise=False, rht=False),
    GCase((16, 32, 0, 16), k=64, sign_mask=0),  # aligned sizes, mask 0 (plain H/4)
    GCase((0, 64, 0, 0), k=48),  # all tokens in one group
    GCase((0, 0, 0, 0)),  # zero-size: no tokens at all (a rank that received none)
]
GROUP_GIVEN_AMAX = GCase(UNEVEN, given_amax=True)

GROUP_OPCHECK_CASES = [
    GCase(UNEVEN),
    pytest.param(GCase(UNEVEN, columnwise=False, rht=False), id="rowwise-only"),
    pytest.param(GCase(UNEVEN, rht=False), id="no-rht"),
    pytest.param(GROUP_GIVEN_AMAX, id="given-amax"),
]


def _group_inputs(case: GCase, seed: int):
    gen = _gen(seed)
    t = sum(case.sizes)
    x = _randn(gen, t, case.k, scale=2.0)
    gs = torch.tensor(case.sizes, dtype=torch.int64)
    ra = ca = None
    if case.given_amax:
        ra = torch.rand(len(case.sizes), generator=gen) * 4 + 0.5
        ca = torch.rand(len(case.sizes), generator=gen) * 4 + 0.5
    return x, gs, ra, ca


def _quantize_args(case: QCase, seed: int):
    x = _randn(_gen(seed), case.m, case.k, dtype=case.dtype, scale=3.0)
    amax = torch.tensor(5.0) if case.given_amax else None
    return (x, case.rowwise, case.columnwise, case.rht, DEFAULT_SIGN_MASK, case.block_2d, False, amax, amax)


def _assert_present_equal(out, expected, present, label):
    """Present copies byte for byte; absent ones empty, with the copy's dtype (as the fake
    impl says) and on x's device."""
    for i, (o, e, keep) in enumerate(zip(out, expected, present)):
        if not keep:
            assert o.numel() == 0, f"{label}[{i}]: absent copy should be empty, got shape {tuple(o.shape)}"
        assert_bytes_equal(o, e, f"{label}[{i}]")


# ---------------------------------------------------------------------------------------
# Quantizers


@pytest.mark.parametrize("case", QUANTIZE_OPCHECK_CASES, ids=str)
def test_quantize_opcheck(case: QCase):
    torch.library.opcheck(nvfp4.quantize, _quantize_args(case, 1))


@pytest.mark.parametrize(
    "case", QUANTIZE_CASES + [pytest.param(QUANTIZE_GIVEN_AMAX, id="given-amax")],
    ids=str,
)
def test_quantize_matches_reference(case: QCase):
    args = _quantize_args(case, 2)
    out = nvfp4.quantize(*args)
    ref = numerics.quantize_torch(
        args[0], rowwise=case.rowwise, columnwise=case.columnwise, rht=case.rht, sign_mask=DEFAULT_SIGN_MASK,
        block_2d=case.block_2d, rowwise_amax=args[7], columnwise_amax=args[8],
    )
    present = [case.rowwise] * 3 + [case.columnwise] * 3
    _assert_present_equal(out, _ref_tuple(ref, _QDTYPES), present, f"quantize {case}")


def test_quantize_stochastic_matches_reference_under_same_manual_seed():
    """SR draws its seed from torch's generator: the same torch.manual_seed gives the
    op and the reference (seed=None, drawn the same way) the same bits."""
    x = _randn(_gen(3), 32, 48, scale=3.0)
    torch.manual_seed(1234)
    out = nvfp4.quantize(x, True, True, True, DEFAULT_SIGN_MASK, False, True, None, None)
    torch.manual_seed(1234)
    ref = numerics.quantize_torch(x, rowwise=True, columnwise=True, rht=True, stochastic_rounding=True)
    _assert_tuple_equal(out, _ref_tuple(ref, _QDTYPES), "quantize SR")


def test_absent_copy_has_the_fake_impls_dtype():
    x = _randn(_gen(16), 32, 32)
    out = nvfp4.quantize(x, True, False, False, DEFAULT_SIGN_MASK, False, False, None, None)
    assert (out[3].dtype, out[4].dtype) == (torch.uint8, torch.float8_e4m3fn), [o.dtype for o in out[3:]]


def test_columnwise_copy_without_rht_is_contiguous():
    x = _randn(_gen(17), 48, 32)
    out = nvfp4.quantize(x, True, True, False, DEFAULT_SIGN_MASK, False, False, None, None)
    assert out[3].is_contiguous(), f"columnwise data {tuple(out[3].shape)} has strides {out[3].stride()}"


def test_public_quantize_with_given_amax():
    """A supplied amax comes back as a new tensor, never an alias of the input."""
    import nvfp4_inductor

    x = _randn(_gen(18), 32, 32)
    q = nvfp4_inductor.quantize(x, rowwise_amax=torch.tensor(4.0))
    assert float(q.rowwise_amax) == 4.0


@pytest.mark.parametrize("case", GROUP_OPCHECK_CASES, ids=str)
def test_group_quantize_opcheck(case: GCase):
    x, gs, ra, ca = _group_inputs(case, 4)
    torch.library.opcheck(
        nvfp4.group_quantize, (x, gs, case.rowwise, case.columnwise, case.rht, case.sign_mask, False, ra, ca)
    )


@pytest.mark.parametrize(
    "case", GROUP_CASES + [pytest.param(GROUP_GIVEN_AMAX, id="given-amax")], ids=str
)
def test_group_quantize_matches_reference(case: GCase):
    x, gs, ra, ca = _group_inputs(case, 5)
    out = nvfp4.group_quantize(x, gs, case.rowwise, case.columnwise, case.rht, case.sign_mask, False, ra, ca)
    ref = numerics.group_quantize_torch(
        x, gs, rowwise=case.rowwise, columnwise=case.columnwise, rht=case.rht, sign_mask=case.sign_mask,
        rowwise_amax=ra, columnwise_amax=ca,
    )
    present = [case.rowwise] * 3 + [case.columnwise] * 3 + [True]
    _assert_present_equal(out, _ref_tuple(ref, _QDTYPES + (torch.int64,))[:7], present, f"group_quantize {case}")


def test_group_quantize_stochastic_matches_reference_under_same_manual_seed():
    x, gs, _, _ = _group_inputs(GCase(UNEVEN), 6)
    torch.manual_seed(99)
    out = nvfp4.group_quantize(x, gs, True, True, True, DEFAULT_SIGN_MASK, True, None, None)
    torch.manual_seed(99)
    ref = numerics.group_quantize_torch(x, gs, rowwise=True, columnwise=True, rht=True, stochastic_rounding=True)
    _assert_tuple_equal(out, _ref_tuple(ref, _QDTYPES + (torch.int64,))[:7], "group_quantize SR")


@pytest.mark.parametrize("sizes", [UNEVEN, (16, 32, 0, 16)], ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("sign_mask", [DEFAULT_SIGN_MASK, 0], ids=lambda m: f"mask{m:x}")
def test_group_hadamard_amax(sizes, sign_mask):
    gen = _gen(7)
    x = _randn(gen, sum(sizes), 48, scale=2.0)
    gs = torch.tensor(sizes)
    if sizes == UNEVEN and sign_mask == DEFAULT_SIGN_MASK:
        torch.library.opcheck(nvfp4.group_hadamard_amax, (x, gs, sign_mask))
    out = nvfp4.group_hadamard_amax(x, gs, sign_mask)
    _assert_tuple_equal(out, numerics.group_hadamard_amax_torch(x, gs, sign_mask), "group_hadamard_amax")
    # and they are the amaxes group_quantize computes for its two copies
    q = numerics.group_quantize_torch(x, gs, rowwise=True, columnwise=True, rht=True, sign_mask=sign_mask)
    assert_bytes_equal(out[0], q.rowwise_amax, "pre-RHT amax vs group_quantize")
    assert_bytes_equal(out[1], q.columnwise_amax, "post-RHT amax vs group_quantize")
    for gi, size in enumerate(sizes):  # empty groups get amax 0
        if size == 0:
            assert float(out[0][gi]) == 0.0 and float(out[1][gi]) == 0.0


@pytest.mark.parametrize("block_2d", [True, False], ids=["2d", "1x16"])
def test_quantize_weights(block_2d):
    w = _randn(_gen(8), 4, 48, 32, scale=0.1)
    if block_2d:
        torch.library.opcheck(nvfp4.quantize_weights, (w, block_2d))
    out = nvfp4.quantize_weights(w, block_2d)
    _assert_tuple_equal(out, numerics.quantize_weights_torch(w, block_2d=block_2d).as_tuple(), "quantize_weights")


# ---------------------------------------------------------------------------------------
# Grouped GEMMs


def _gemm_operands(seed: int, sizes=UNEVEN, k=32, n=48):
    gen = _gen(seed)
    gs = torch.tensor(sizes)
    a = numerics.group_quantize_torch(_randn(gen, sum(sizes), k), gs, rowwise=True, columnwise=False)
    b = numerics.quantize_weights_torch(_randn(gen, len(sizes), n, k, scale=0.1), block_2d=True)
    return (a.rowwise_data, a.rowwise_scale, a.rowwise_amax, b.rowwise_data, b.rowwise_scale, b.amax, gs)


@pytest.mark.parametrize("sizes", [UNEVEN, (0, 64, 0, 0)], ids=lambda s: "-".join(map(str, s)))
def test_grouped_gemm(sizes):
    args = _gemm_operands(9, sizes)
    if sizes == UNEVEN:
        torch.library.opcheck(nvfp4.grouped_gemm, args, test_utils=NO_SCHEMA)
        _check_functional(nvfp4.grouped_gemm, args, "grouped_gemm")
    assert_bytes_equal(nvfp4.grouped_gemm(*args), numerics.grouped_gemm_torch(*args), "grouped_gemm")


def _wgrad_operands(seed: int, sizes=UNEVEN, n=32, m=48):
    gen = _gen(seed)
    gs = torch.tensor(sizes)
    t = sum(sizes)
    a = numerics.group_quantize_torch(_randn(gen, t, n), gs, rowwise=False, columnwise=True, rht=True)
    b = numerics.group_quantize_torch(_randn(gen, t, m), gs, rowwise=False, columnwise=True, rht=True)
    return (a.columnwise_data, a.columnwise_scale, a.columnwise_amax,
            b.columnwise_data, b.columnwise_scale, b.columnwise_amax, a.columnwise_offsets)


@pytest.mark.parametrize("sizes", [UNEVEN, (16, 32, 0, 16)], ids=lambda s: "-".join(map(str, s)))
def test_grouped_gemm_wgrad(sizes):
    args = _wgrad_operands(10, sizes)
    if sizes == UNEVEN:
        torch.library.opcheck(nvfp4.grouped_gemm_wgrad, args, test_utils=NO_SCHEMA)
        _check_functional(nvfp4.grouped_gemm_wgrad, args, "grouped_gemm_wgrad")
    out = nvfp4.grouped_gemm_wgrad(*args)
    assert_bytes_equal(out, numerics.grouped_gemm_wgrad_torch(*args), "grouped_gemm_wgrad")
    for gi, size in enumerate(sizes):  # an empty group's weight gradient is exactly zero
        if size == 0:
            assert bool((out[gi] == 0).all())


# ---------------------------------------------------------------------------------------
# Activation and its backward

ACTS = [("srelu", None), ("tanh_srelu", 3.0), ("swiglu", None)]
ACT_IDS = [a for a, _ in ACTS]


def _act_inputs(seed: int, activation: str, with_probs: bool, t=64, f=32):
    gen = _gen(seed)
    f1 = 2 * f if activation == "swiglu" else f
    c = _randn(gen, t, f1, scale=2.0)
    g = _randn(gen, t, f)
    probs = torch.rand(t, generator=gen) if with_probs else None
    return c, g, probs


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_activation(activation, clamp, with_probs):
    c, _, probs = _act_inputs(11, activation, with_probs)
    if with_probs:  # with gradients required, so AOT dispatch also runs the registered backward
        p_req = probs.detach().requires_grad_()
        torch.library.opcheck(nvfp4.activation, (c.detach().requires_grad_(), p_req, activation, clamp))
    elif activation == "srelu":
        torch.library.opcheck(nvfp4.activation, (c, probs, activation, clamp))
    assert_bytes_equal(nvfp4.activation(c, probs, activation, clamp),
                       activation_forward(c, probs, activation, clamp), f"activation {activation}")


@pytest.mark.parametrize("regenerate", [True, False], ids=["regen", "noregen"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("activation,clamp", ACTS, ids=ACT_IDS)
def test_activation_backward(activation, clamp, with_probs, regenerate):
    c, g, probs = _act_inputs(12, activation, with_probs)
    if with_probs == regenerate:  # both flags covered per activation, half the opcheck cost
        torch.library.opcheck(nvfp4.activation_backward, (g, c, probs, activation, clamp, regenerate))
    out = nvfp4.activation_backward(g, c, probs, activation, clamp, regenerate)
    dc, dp, d = activation_backward(g, c, probs, activation, clamp, regenerate=regenerate)
    assert_bytes_equal(out[0], dc, "dC")
    assert_bytes_equal(out[1], dp if dp is not None else torch.empty(0), "dprobs")
    assert_bytes_equal(out[2], d if d is not None else torch.empty(0, dtype=torch.bfloat16), "D")


# ---------------------------------------------------------------------------------------
# Fused grouped-MLP ops, against the chain of reference functions


@dataclasses.dataclass(frozen=True)
class MCase:
    activation: str
    clamp: Optional[float]
    with_probs: bool
    sizes: tuple[int, ...] = UNEVEN
    hidden: int = 32
    ffn: int = 48
    rht: bool = True
    block_2d: bool = True

    def __str__(self):
        sizes = "-".join(map(str, self.sizes))
        return (f"{self.activation}-{'probs' if self.with_probs else 'noprobs'}-{sizes}-H{self.hidden}F{self.ffn}"
                + ("" if self.rht else "-northt") + ("" if self.block_2d else "-1x16w"))


MLP_CASES = [MCase(a, c, p) for a, c in ACTS for p in (True, False)] + [
    MCase("srelu", None, True, sizes=(16, 32, 0, 16), hidden=64, ffn=32, rht=False, block_2d=False),
]
NORHT = MLP_CASES[-1]
# opcheck on one case per activation (probs on for two of them), recompute on (and off for
# swiglu); every case is compared with the reference chain. opcheck costs ~1-4 s a call.
MLP_OPCHECK = {str(MLP_CASES[0]), str(MLP_CASES[3]), str(MLP_CASES[4])}


def _mlp_inputs(case: MCase, seed: int):
    gen = _gen(seed)
    g = len(case.sizes)
    t = sum(case.sizes)
    f1 = 2 * case.ffn if case.activation == "swiglu" else case.ffn
    x = _randn(gen, t, case.hidden)
    w1 = _randn(gen, g, f1, case.hidden, scale=case.hidden ** -0.5)
    w2 = _randn(gen, g, case.hidden, case.ffn, scale=case.ffn ** -0.5)
    gs = torch.tensor(case.sizes)
    probs = torch.rand(t, generator=gen) if case.with_probs else None
    dy = _randn(gen, t, case.hidden)
    return x, w1, w2, gs, probs, dy


def _reference_forward(case: MCase, x, w1, w2, gs, probs):
    """SPEC 5 forward from the reference functions: (Y, C, xq, W1q, W2q, D, Dq)."""
    xq = numerics.group_quantize_torch(x, gs, rowwise=True, columnwise=True, rht=case.rht)
    w1q = numerics.quantize_weights_torch(w1, block_2d=case.block_2d)
    w2q = numerics.quantize_weights_torch(w2, block_2d=case.block_2d)
    c = numerics.grouped_gemm_torch(xq.rowwise_data, xq.rowwise_scale, xq.rowwise_amax,
                                    w1q.rowwise_data, w1q.rowwise_scale, w1q.amax, gs)
    d = activation_forward(c, probs, case.activation, case.clamp)
    dq = numerics.group_quantize_torch(d, gs, rowwise=True, columnwise=True, rht=case.rht)
    y = numerics.grouped_gemm_torch(dq.rowwise_data, dq.rowwise_scale, dq.rowwise_amax,
                                    w2q.rowwise_data, w2q.rowwise_scale, w2q.amax, gs)
    return y, c, xq, w1q, w2q, d, dq


def _reference_backward(case: MCase, dy, c, probs, gs, xq, w1q, w2q, dq):
    """SPEC 5 backward from the reference functions, SR off: (dX, dW1, dW2, dprobs)."""
    def quantize_grad(t):
        return numerics.group_quantize_torch(t, gs, rowwise=True, columnwise=True, rht=case.rht)

    dyq = quantize_grad(dy)
    g = numerics.grouped_gemm_torch(dyq.rowwise_data, dyq.rowwise_scale, dyq.rowwise_amax,
                                    w2q.columnwise_data, w2q.columnwise_scale, w2q.amax, gs)
    dc, dp, _ = activation_backward(g, c, probs, case.activation, case.clamp)
    dw2 = numerics.grouped_gemm_wgrad_torch(dyq.columnwise_data, dyq.columnwise_scale, dyq.columnwise_amax,
                                            dq.columnwise_data, dq.columnwise_scale, dq.columnwise_amax,
                                            dq.columnwise_offsets)
    dcq = quantize_grad(dc)
    dx = numerics.grouped_gemm_torch(dcq.rowwise_data, dcq.rowwise_scale, dcq.rowwise_amax,
                                     w1q.columnwise_data, w1q.columnwise_scale, w1q.amax, gs)
    dw1 = numerics.grouped_gemm_wgrad_torch(dcq.columnwise_data, dcq.columnwise_scale, dcq.columnwise_amax,
                                            xq.columnwise_data, xq.columnwise_scale, xq.columnwise_amax,
                                            xq.columnwise_offsets)
    return dx, dw1, dw2, (dp if dp is not None else torch.empty(0))


def _fwd_args(case: MCase, x, w1, w2, gs, probs, recompute: bool):
    return (x, w1, w2, gs, probs, case.activation, case.clamp, case.rht, DEFAULT_SIGN_MASK, case.block_2d,
            False, recompute)


@pytest.mark.parametrize("case", MLP_CASES, ids=str)
def test_grouped_mlp_infer(case: MCase):
    x, w1, w2, gs, probs, _ = _mlp_inputs(case, 13)
    args = (x, w1, w2, gs, probs, case.activation, case.clamp, case.rht, DEFAULT_SIGN_MASK, case.block_2d)
    if str(case) in MLP_OPCHECK:
        torch.library.opcheck(nvfp4.grouped_mlp_infer, args)
    y_ref = _reference_forward(case, x, w1, w2, gs, probs)[0]
    assert_bytes_equal(nvfp4.grouped_mlp_infer(*args), y_ref, "grouped_mlp_infer Y")


def _fwd_expected(case, recompute, y, c, xq, w1q, w2q, d, dq, gs):
    pre, post = numerics.group_hadamard_amax_torch(d, gs, DEFAULT_SIGN_MASK)
    d_col = (post if case.rht else pre,) + (
        (torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.float8_e4m3fn)) if recompute
        else (dq.columnwise_data, dq.columnwise_scale))
    return (y, c, xq.columnwise_data, xq.columnwise_scale, xq.columnwise_amax, xq.columnwise_offsets,
            w1q.columnwise_data, w1q.columnwise_scale, w1q.amax,
            w2q.columnwise_data, w2q.columnwise_scale, w2q.amax) + d_col


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saveD"])
@pytest.mark.parametrize("case", MLP_CASES, ids=str)
def test_grouped_mlp_fwd(case: MCase, recompute: bool):
    x, w1, w2, gs, probs, _ = _mlp_inputs(case, 14)
    if str(case) in MLP_OPCHECK and (recompute or case.activation == "swiglu"):
        torch.library.opcheck(nvfp4.grouped_mlp_fwd, _fwd_args(case, x, w1, w2, gs, probs, recompute))
        # with gradients required: the autograd registration check. test_schema and
        # test_aot_dispatch_dynamic cannot run here: they would differentiate through the
        # E4M3 scale outputs (sum / allclose are not implemented for float8_e4m3fn on the
        # CPU). The backward itself is checked above the op level in test_nn.py (fused
        # pair == eager chain, bitwise) and by test_grouped_mlp_bwd below.
        req = [t.detach().requires_grad_() for t in (x, w1, w2)]
        p_req = probs.detach().requires_grad_() if probs is not None else None
        torch.library.opcheck(nvfp4.grouped_mlp_fwd, _fwd_args(case, *req, gs, p_req, recompute),
                              test_utils="test_autograd_registration")
    out = nvfp4.grouped_mlp_fwd(*_fwd_args(case, x, w1, w2, gs, probs, recompute))
    ref = _reference_forward(case, x, w1, w2, gs, probs)
    _assert_tuple_equal(out, _fwd_expected(case, recompute, *ref, gs), f"grouped_mlp_fwd {case}")
    # the saved D column-wise amax is the one group_quantize computes for D's RHT copy
    assert_bytes_equal(out[12], ref[6].columnwise_amax, "saved D column-wise amax")


def test_grouped_mlp_fwd_opcheck_without_rht():
    x, w1, w2, gs, probs, _ = _mlp_inputs(NORHT, 14)
    torch.library.opcheck(nvfp4.grouped_mlp_fwd, _fwd_args(NORHT, x, w1, w2, gs, probs, True),
                          test_utils="test_faketensor")


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saveD"])
@pytest.mark.parametrize("case", MLP_CASES, ids=str)
def test_grouped_mlp_bwd(case: MCase, recompute: bool):
    x, w1, w2, gs, probs, dy = _mlp_inputs(case, 15)
    saved = nvfp4.grouped_mlp_fwd(*_fwd_args(case, x, w1, w2, gs, probs, recompute))
    args = (dy, saved[1], probs, gs, *saved[2:], case.activation, case.clamp, case.rht, DEFAULT_SIGN_MASK,
            False, recompute)
    if case.with_probs and str(case) in MLP_OPCHECK and recompute == (case.activation == "srelu"):
        # two cases (srelu recompute, swiglu saveD): the op's shapes depend on little else.
        # The backward's other two ops are the eager GEMM ops, checked above.
        fc2_args = (dy, saved[1], probs, gs, saved[5], *saved[9:], case.activation, case.clamp, case.rht,
                    DEFAULT_SIGN_MASK, False, recompute)
        torch.library.opcheck(nvfp4.grouped_mlp_bwd_fc2, fc2_args, test_utils=NO_SCHEMA)
        _check_functional(nvfp4.grouped_mlp_bwd_fc2, fc2_args, "grouped_mlp_bwd_fc2")
    _, c, xq, w1q, w2q, _, dq = _reference_forward(case, x, w1, w2, gs, probs)
    expected = _reference_backward(case, dy, c, probs, gs, xq, w1q, w2q, dq)
    _assert_tuple_equal(fused.grouped_mlp_bwd(*args), expected, f"grouped_mlp_bwd {case}")
