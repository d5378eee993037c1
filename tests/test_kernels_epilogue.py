"""Fused GEMM epilogues (kernels/grouped_gemm_act.py, kernels/grouped_gemm_dact.py) against
the unfused kernels they stand in for, byte for byte:

    grouped_gemm_act  == grouped_gemm_via_bf16 -> activation_forward (C, D)
    grouped_gemm_dact == grouped_gemm_via_bf16 -> activation_backward (dC, dp, regenerated D)

grouped_gemm_via_bf16 (dequantize -> bf16-operand GEMM) is the Triton lowering's fprop/dgrad
(docs/decisions.md, "GEMM operands"); the fused kernels share its K loop (``bf16_tile_acc``).

Bit-identity with the unfused kernels is what lets the compiled path use the fused ones
while eager uses the unfused ones (compiled == eager bitwise). The references are the
Triton kernels on the same device, so the transcendental activations are exact too.

On a machine without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and everything runs
in the interpreter on CPU tensors (tiny shapes, 32x32x32 tiles: groups span several M
tiles, F several N tiles). ``@pytest.mark.gpu`` tests run bigger shapes with the H200
tile config (``pytest -m gpu``). Cases are data: uneven groups, empty groups, sizes not
multiples of 16 or of the tile height.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from nvfp4_inductor import numerics
from nvfp4_inductor.tensor import Operand

from _assertions import assert_bytes_equal

triton = pytest.importorskip("triton")
from nvfp4_inductor import kernels  # noqa: E402
from nvfp4_inductor.kernels.activation import activation_backward, activation_forward  # noqa: E402
from nvfp4_inductor.kernels import config  # noqa: E402
from nvfp4_inductor.kernels.config import Bf16GemmConfig  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_bf16 import grouped_gemm_via_bf16  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_act import grouped_gemm_act  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_dact import _grouped_gemm_dact_op, grouped_gemm_dact  # noqa: E402
from nvfp4_inductor.kernels.activation import _act_code, _clamp as kernel_clamp  # noqa: E402
from nvfp4_inductor.kernels.dequantize import dequantize_bf16_pair  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_act import epilogue_config  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_bf16 import slice_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not kernels.available(DEVICE):
    pytest.skip(f"Triton kernels cannot run on {DEVICE} (no CUDA and TRITON_INTERPRET unset)", allow_module_level=True)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ACTIVATIONS = ["srelu", "tanh_srelu", "swiglu"]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    sizes: tuple[int, ...]
    hidden: int  # K of fc1, N of the fc2 dgrad's dY
    ffn: int  # F (D's width); F1 = 2F for SwiGLU
    cancel: bool = False  # GEMM operands from _cancelling (K order visible in the bits)

    def __str__(self):
        return self.name


# uneven: empty groups first, middle and last; 37 spans two 32-row tiles, 5 and 22 end mid-run
UNEVEN = Case("uneven_empty", (5, 0, 37, 16, 22, 0), 64, 48)
# F = 80: one whole 64-column tile and one of 16 columns
WIDE = Case("uneven_f80", (5, 0, 37, 16, 22, 0), 64, 80)
# groups of 1 and 15 tokens (one partial run), 17 and 33 (a run of 1 after full runs)
SMALL = Case("tiny_groups", (0, 1, 15, 17, 0, 33), 32, 32)
GPU_CASE = Case("gpu_uneven", (1000, 0, 17, 2900, 1, 4095, 0, 203), 1024, 768)
# K order made visible (_cancelling); F = 48 is not a multiple of the 32-column tiles, so the
# fused SwiGLU kernel holds C's up columns F + j at other tile positions than the unfused GEMM
CANCEL = Case("cancelling", (5, 0, 37, 16, 22, 0), 64, 48, cancel=True)
# the same on the GPU: F = 640 is not a multiple of the H200 config's 256-column tiles
GPU_CANCEL = Case("gpu_cancelling", (1000, 0, 17, 2900, 1, 4095, 0, 203), 1024, 640, cancel=True)
# few tokens for 8 experts x F = 1152: W2's copy is made in slices (4 x 256 + 128 rows on 128-column tiles)
GPU_SLICES = Case("gpu_slices", (100, 0, 17, 290, 1, 409, 0, 203), 1024, 1152)


def _cancelling(a, b, gen):
    """In place on fp32 a (T, K) and b (..., N, K): K blocks 0 and 2 (16 elements each) large
    and cancelling (a's equal, b's opposite), the rest small. fp32 partial sums drop the small
    terms differently in different K orders, so unlike plain random inputs (whose sums are
    exact in fp32 at these sizes) these show which K loop produced a GEMM's bits."""
    a.mul_(2.0**-4)
    b.mul_(2.0**-4)
    a[:, 0:16] = torch.randn(a.shape[0], 16, generator=gen) * 2.0**8
    a[:, 32:48] = a[:, 0:16]
    b[..., 0:16] = torch.randn(*b.shape[:-1], 16, generator=gen) * 2.0**8
    b[..., 32:48] = -b[..., 0:16]


def assert_k_order_visible(args):
    """grouped_gemm_via_bf16 differs somewhere from the same GEMM with K blocks 1 and 2 swapped
    in both operands (equal in exact arithmetic; _cancelling's blocks 0 and 2 then meet in
    one K step of the interpreter's 32-wide steps and in adjacent 16-wide MMAs on the GPU)."""
    def swap_blocks(data, scale):
        data, scale = data.clone(), scale.view(torch.uint8).clone()
        data[..., 8:16], data[..., 16:24] = data[..., 16:24].clone(), data[..., 8:16].clone()
        scale[..., 1], scale[..., 2] = scale[..., 2].clone(), scale[..., 1].clone()
        return data, scale.view(torch.float8_e4m3fn)

    (a, sa, aa), (b, sb, ba), sizes = args
    swapped = (Operand(*swap_blocks(a, sa), aa), Operand(*swap_blocks(b, sb), ba), sizes)
    assert (grouped_gemm_via_bf16(*swapped) != grouped_gemm_via_bf16(*args)).any(), "inputs do not show the K order"


def _clamp(activation):
    return 2.5 if activation == "tanh_srelu" else None


def fc1_inputs(case: Case, activation: str, with_probs: bool, seed: str):
    """x's row-wise grouped copy and W1's copies from the real quantizers, probs, sizes."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    sizes = torch.tensor(case.sizes, dtype=torch.int64)
    tokens, groups = sum(case.sizes), len(case.sizes)
    f1 = 2 * case.ffn if activation == "swiglu" else case.ffn
    x = torch.randn(tokens, case.hidden, generator=gen) * 3
    w = torch.randn(groups, f1, case.hidden, generator=gen) * 0.2
    if case.cancel:
        _cancelling(x, w, gen)
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    probs = torch.rand(tokens, generator=gen) if with_probs else None
    x, w, sizes = x.to(DEVICE), w.to(DEVICE), sizes.to(DEVICE)
    xq, wq = numerics.group_quantize_torch(x, sizes), numerics.quantize_weights_torch(w)
    args = (xq.rowwise(), wq.rowwise(), sizes)
    return args, None if probs is None else probs.to(DEVICE)


def dgrad_inputs(case: Case, activation: str, with_probs: bool, seed: str):
    """dY's row-wise copy, W2's column-wise copies, a saved C with +-0 entries, probs."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    sizes = torch.tensor(case.sizes, dtype=torch.int64)
    tokens, groups, f = sum(case.sizes), len(case.sizes), case.ffn
    f1 = 2 * f if activation == "swiglu" else f
    dy = torch.randn(tokens, case.hidden, generator=gen)
    w2 = torch.randn(groups, case.hidden, f, generator=gen) * 0.2
    if case.cancel:
        _cancelling(dy, w2.transpose(1, 2), gen)  # K = H: W2's rows
    dy, w2 = dy.to(torch.bfloat16), w2.to(torch.bfloat16)
    c = torch.randn(tokens, f1, generator=gen) * 3
    if tokens >= 2:
        c[0, :5] = -0.0
        c[1, :4] = 0.0
    probs = torch.rand(tokens, generator=gen) if with_probs else None
    dy, w2, sizes = dy.to(DEVICE), w2.to(DEVICE), sizes.to(DEVICE)
    dyq, w2q = numerics.group_quantize_torch(dy, sizes), numerics.quantize_weights_torch(w2)
    args = (dyq.rowwise(), w2q.columnwise(), sizes)
    return args, c.to(torch.bfloat16).to(DEVICE), None if probs is None else probs.to(DEVICE)


def check_act(case, activation, with_probs, label):
    args, probs = fc1_inputs(case, activation, with_probs, label)
    clamp = _clamp(activation)
    c, d, pre, post = grouped_gemm_act(*args, probs, activation, clamp, 0xD7E8)
    assert pre is None and post is None, f"{label}: the Triton fc1 kernel computes no amax"
    c_ref = grouped_gemm_via_bf16(*args)
    assert_bytes_equal(c, c_ref, f"{label}: C")
    assert_bytes_equal(d, activation_forward(c_ref, probs, activation, clamp), f"{label}: D")


def check_dact(case, activation, with_probs, regenerate, label):
    args, c, probs = dgrad_inputs(case, activation, with_probs, label)
    clamp = _clamp(activation)
    dc, dp, d = grouped_gemm_dact(*args, c, probs, activation, clamp, regenerate=regenerate)
    dc_ref, dp_ref, d_ref = activation_backward(grouped_gemm_via_bf16(*args), c, probs, activation, clamp,
                                                regenerate=regenerate)
    assert_bytes_equal(dc, dc_ref, f"{label}: dC")
    for name, out, ref in (("dp", dp, dp_ref), ("D", d, d_ref)):
        assert (out is None) == (ref is None), f"{label}: {name} is {out is None} vs {ref is None}"
        if ref is not None:
            assert_bytes_equal(out, ref, f"{label}: {name}")


# ---------------------------------------------------------------------------------------
# Interpreter / any device: tiny shapes


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_equals_unfused(activation, with_probs):
    check_act(UNEVEN, activation, with_probs, f"act {UNEVEN} {activation} probs={with_probs}")


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])  # the tiling does not depend on f
def test_act_small_groups(activation):
    check_act(SMALL, activation, True, f"act {SMALL} {activation}")


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_act_follows_the_bf16_k_order(activation):
    """Inputs whose bits depend on the K order: the fused C equals grouped_gemm_via_bf16's,
    which differs from that of the same GEMM in another K order (so the comparison can fail)."""
    check_act(CANCEL, activation, True, f"act {CANCEL} {activation}")
    args, _ = fc1_inputs(CANCEL, activation, True, f"act {CANCEL} {activation}")
    assert_k_order_visible(args)


def test_act_other_tiles():
    """16x16 tiles, BK 32, 3 programs: one run per tile, tiles of a group on different programs."""
    with config.override(act=Bf16GemmConfig(16, 16, 32, 4, 1, 3)):
        check_act(SMALL, "swiglu", True, "act 16x16 tiles swiglu")


def test_act_refuses_want_amax():
    """D's amaxes come from group_hadamard_amax on the Triton target (no fused_amax); asking
    the fc1 kernel for them is a clear error, not amaxes of zero."""
    args, probs = fc1_inputs(SMALL, "srelu", True, "want amax")
    with pytest.raises(ValueError, match="grouped_gemm_act: want_amax=True.*group_hadamard_amax"):
        grouped_gemm_act(*args, probs, "srelu", None, 0xD7E8, want_amax=True)


@pytest.mark.parametrize("regenerate", [True, False], ids=["regen", "no_regen"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dact_equals_unfused(activation, with_probs, regenerate):
    check_dact(UNEVEN, activation, with_probs, regenerate,
               f"dact {UNEVEN} {activation} probs={with_probs} regen={regenerate}")


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_dact_small_groups(activation):
    check_dact(SMALL, activation, True, True, f"dact {SMALL} {activation}")


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_dact_follows_the_bf16_k_order(activation):
    check_dact(CANCEL, activation, True, True, f"dact {CANCEL} {activation}")
    args, _, _ = dgrad_inputs(CANCEL, activation, True, f"dact {CANCEL} {activation}")
    assert_k_order_visible(args)


def test_dact_other_tiles():
    with config.override(dact=Bf16GemmConfig(16, 16, 32, 4, 1, 3)):
        check_dact(SMALL, "swiglu", True, True, "dact 16x16 tiles swiglu")


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_dact_split_epilogue(activation, split):
    """The epilogue on the tile's column halves / quarters in turn (64-column tiles: slices of
    32 and 16): F = 80, a whole tile and one of 16 columns; F = 48 (K order visible), the
    last slice empty. The same bits."""
    with config.override(dact=Bf16GemmConfig(16, 64, 32, 4, 1, 3, epilogue_split=split)):
        check_dact(WIDE, activation, True, True, f"dact split {split} {activation}")
        check_dact(CANCEL, activation, True, True, f"dact split {split} {activation} cancelling")


@pytest.mark.parametrize("band", [2, 3])
def test_tile_bands_change_no_bit(band):
    """The fprop, act and dact kernels walking a group's tiles in bands of `band` M tiles
    (``Bf16GemmConfig.band_m``; 16x16 tiles: up to 3 M and 6 N tiles a group, so band 2
    leaves a short last band) write the bytes of the whole-group order, every tile once."""
    tiles = {kind: Bf16GemmConfig(16, 16, 32, 4, 1, 3) for kind in ("fprop", "act", "dact")}
    _assert_configs_agree("swiglu", {k: dataclasses.replace(v, band_m=band) for k, v in tiles.items()}, tiles,
                          f"band {band}", cases=(UNEVEN, WIDE))


def test_zero_tokens_and_errors():
    empty = Case("zero_tokens", (0, 0), 32, 32)
    args, probs = fc1_inputs(empty, "srelu", True, "zero")
    c, d, pre, post = grouped_gemm_act(*args, probs, "srelu", None, 0xD7E8)
    assert c.shape == (0, 32) and d.shape == (0, 32) and pre is None and post is None
    dargs, cc, dprobs = dgrad_inputs(empty, "swiglu", True, "zero")
    dc, dp, dd = grouped_gemm_dact(*dargs, cc, dprobs, "swiglu", regenerate=True)
    assert dc.shape == (0, 64) and dp.shape == (0,) and dd.shape == (0, 32)
    args, probs = fc1_inputs(SMALL, "srelu", True, "errors")
    with pytest.raises(ValueError, match="tanh_clamp_scale"):
        grouped_gemm_act(*args, probs, "tanh_srelu", None, 0)
    with pytest.raises(ValueError, match="epilogues need block_n"):
        with config.override(act=Bf16GemmConfig(32, 24, 32, 4, 1, 2)):
            grouped_gemm_act(*args, probs, "srelu", None, 0)
    dargs, cc, dprobs = dgrad_inputs(SMALL, "srelu", True, "split")
    with pytest.raises(ValueError, match="block_n / epilogue_split"):
        with config.override(dact=Bf16GemmConfig(32, 32, 32, 4, 1, 2, epilogue_split=4)):
            grouped_gemm_dact(*dargs, cc, dprobs, "srelu")
    with pytest.raises(ValueError, match="epilogue_split must be 1, 2 or 4"):
        with config.override(dact=Bf16GemmConfig(32, 96, 32, 4, 1, 2, epilogue_split=3)):
            grouped_gemm_dact(*dargs, cc, dprobs, "srelu")
    dargs, cc, dprobs = dgrad_inputs(SMALL, "srelu", True, "f24")
    w2_col = dargs[1]
    f24 = (dargs[0], Operand(w2_col.data[:, :24], w2_col.scale[:, :24], w2_col.amax), dargs[2])  # F = 24
    with pytest.raises(ValueError, match="multiple of 16"):
        grouped_gemm_dact(*f24, cc[:, :24], dprobs, "srelu")
    with pytest.raises(ValueError, match="c must be"):
        grouped_gemm_dact(*dargs, cc[:, :16], None, "srelu")


def _run_fused_ops(target, plan_flags, x, w1, w2, sizes, probs, dy, activation):
    """compiler/fused.py's forward op, then its backward, on `target` with the plan's
    (fused_fc1, fused_amax, fused_dgrad) flags; recompute on, SR off, default sign mask."""
    from nvfp4_inductor.compiler import fused
    from nvfp4_inductor.lowerings import Plan
    from nvfp4_inductor.program import SiteOptions
    from nvfp4_inductor.recipe import Recipe
    from nvfp4_inductor.saved import SavedForBackward

    fused_fc1, fused_amax, fused_dgrad = plan_flags
    options = SiteOptions(activation, None, Recipe(sign_mask=0xD7E8, stochastic_rounding=False),
                          Plan(target, fused_fc1, fused_amax, fused_dgrad, ""), recompute=True)
    fwd = fused.grouped_mlp_fwd(x, w1, w2, sizes, probs, **fused.schema_kwargs(options))
    bwd = fused.grouped_mlp_bwd(dy, SavedForBackward.unflatten(fwd[1:]), probs, sizes, options)
    return fwd, bwd


def test_fused_ops_use_the_epilogues_bitwise(use_steps):
    """compiler/fused.py on the Triton steps: the plan with the fused kernels == the plan
    without them, byte for byte; both take D's amaxes from one amax pass over D."""
    import dataclasses

    from nvfp4_inductor.lowerings.triton import STEPS as TRITON

    calls = []
    spy = lambda *a: calls.append("amax") or TRITON.group_hadamard_amax(*a)  # noqa: E731
    target = use_steps(dataclasses.replace(TRITON, group_hadamard_amax=spy), like="triton").name
    gen = torch.Generator().manual_seed(1)
    sizes, (t, h, f) = torch.tensor([3, 0, 17, 12]), (32, 16, 16)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    w1 = (torch.randn(4, 2 * f, h, generator=gen) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(4, h, f, generator=gen) * 0.2).to(torch.bfloat16)
    probs, dy = torch.rand(t, generator=gen), torch.randn(t, h, generator=gen).to(torch.bfloat16)
    x, w1, w2, sizes, probs, dy = (v.to(DEVICE) for v in (x, w1, w2, sizes, probs, dy))
    fwd, bwd = _run_fused_ops(target, (True, False, True), x, w1, w2, sizes, probs, dy, "swiglu")
    assert calls == ["amax"], f"the fused plan must run one amax pass over D: {calls}"
    unfused = _run_fused_ops(target, (False, False, False), x, w1, w2, sizes, probs, dy, "swiglu")
    assert calls == ["amax", "amax"], f"the unfused plan must run one amax pass over D: {calls}"
    for i, (a, b) in enumerate(zip(fwd + bwd, unfused[0] + unfused[1])):
        assert_bytes_equal(a, b, f"fused ops output {i}: epilogues vs unfused steps")


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_fused_backward_frees_before_the_largest_gemm(use_steps, activation, monkeypatch):
    """The backward's memory order (compiler/fused.py, benchmarks/memory_model.py): the bf16
    dC and the regenerated D (rebuilt after the dgrad: Steps.d_after_dgrad) are gone when
    the wgrads run (dC is quantized before fc2's wgrad), and dX is computed last. With
    SReLU the Triton target makes D inside its cast (Steps.activation_quantize): never
    stored, so there is no D to free."""
    import dataclasses
    import weakref

    from nvfp4_inductor.lowerings import triton as triton_lowering
    from nvfp4_inductor.lowerings.triton import STEPS as TRITON

    refs, events = {}, []

    def dgrad_act(*args, **kwargs):
        dc, dp, d = TRITON.fc2_dgrad_act(*args, **kwargs)
        assert d is None  # D is not made beside the dgrad's operand copies
        refs["dC"] = weakref.ref(dc)
        return dc, dp, d

    def activation_forward(*args, **kwargs):
        d = TRITON.activation_forward(*args, **kwargs)
        refs["D"] = weakref.ref(d)
        return d

    def wgrad(*args):
        events.append(("wgrad", {name: ref() is not None for name, ref in refs.items()}))
        return TRITON.grouped_gemm_wgrad(*args)

    def gemm(*args):
        events.append(("gemm", None))
        return TRITON.grouped_gemm(*args)

    # (the target's activation_quantize runs the activation step itself where D is not made in the cast)
    monkeypatch.setattr(triton_lowering, "activation_forward", activation_forward)
    target = use_steps(dataclasses.replace(TRITON, fc2_dgrad_act=dgrad_act, activation_forward=activation_forward,
                                           grouped_gemm_wgrad=wgrad, grouped_gemm=gemm), like="triton").name
    gen = torch.Generator().manual_seed(2)
    sizes, (t, h, f) = torch.tensor([3, 0, 17, 12]), (32, 16, 16)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    w1 = (torch.randn(4, f, h, generator=gen) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(4, h, f, generator=gen) * 0.2).to(torch.bfloat16)
    probs, dy = torch.rand(t, generator=gen), torch.randn(t, h, generator=gen).to(torch.bfloat16)
    x, w1, w2, sizes, probs, dy = (v.to(DEVICE) for v in (x, w1, w2, sizes, probs, dy))
    from nvfp4_inductor.compiler import fused
    from nvfp4_inductor.lowerings import Plan
    from nvfp4_inductor.program import SiteOptions
    from nvfp4_inductor.recipe import Recipe
    from nvfp4_inductor.saved import SavedForBackward

    if activation == "swiglu":
        w1 = torch.cat([w1, w1.flip(1)], dim=1)  # (G, 2F, H): gate and up
    options = SiteOptions(activation, None, Recipe(sign_mask=0xD7E8, stochastic_rounding=False),
                          Plan(target, True, False, True, ""), recompute=True)
    fwd = fused.grouped_mlp_fwd(x, w1, w2, sizes, probs, **fused.schema_kwargs(options))
    events.clear()
    fused.grouped_mlp_bwd(dy, SavedForBackward.unflatten(fwd[1:]), probs, sizes, options)
    alive = {"dC": False, "D": False} if activation == "swiglu" else {"dC": False}  # SReLU: D never made
    assert events == [("wgrad", alive), ("wgrad", alive), ("gemm", None)], events


def check_dact_slices(case, activation, label):
    """W2's bf16 copy made a slice of its F rows at a time (grouped_gemm_bf16.slice_rows):
    dC, dp (partials of runs that end at slice edges) and D equal the whole copy's."""
    args, c, probs = dgrad_inputs(case, activation, True, label)
    (a, sa, aa), (b, sb, ba), sizes = args
    tiles = epilogue_config("dact", _act_code(activation), a.device)
    assert slice_rows(a.shape[0], b.shape[0], b.shape[1], tiles) < b.shape[1], f"{label}: slices"
    sliced = grouped_gemm_dact(*args, c, probs, activation, regenerate=True)
    a16, b16 = dequantize_bf16_pair(a, sa, b, sb)
    whole = _grouped_gemm_dact_op(a16, aa.float(), b16, ba.float(), sizes, c, probs, _act_code(activation),
                                  kernel_clamp(activation, None), True)
    for name, out, ref in zip(("dC", "dp", "D"), sliced, whole):
        assert_bytes_equal(out, ref, f"{label}: {name}")


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_dact_slices_change_no_bit(activation):
    """F = 80 in 32-column tiles, the epilogue on their halves: slices of 32, 32 and 16 rows
    (a last slice narrower than its tile)."""
    with config.override(dact=Bf16GemmConfig(16, 32, 32, 4, 1, 3, epilogue_split=2, min_slice_rows=16)):
        check_dact_slices(WIDE, activation, f"dact slices {activation}")


# ---------------------------------------------------------------------------------------
# GPU: bigger shapes with the H200 tile config (pytest -m gpu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_act_and_dact_equal_unfused(activation):
    check_act(GPU_CASE, activation, True, f"gpu act {activation}")
    check_dact(GPU_CASE, activation, True, True, f"gpu dact {activation}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_no_probs():
    check_act(GPU_CASE, "srelu", False, "gpu act srelu no probs")
    check_dact(GPU_CASE, "srelu", False, False, "gpu dact srelu no probs")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tiles", [Bf16GemmConfig(128, 128, 64, 8, 4, epilogue_split=2),
                                   Bf16GemmConfig(128, 256, 64, 8, 3, epilogue_split=4)], ids=["128x128/2", "128x256/4"])
@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_gpu_dact_split_epilogue(activation, tiles):
    """The H200's candidate split-epilogue tiles (no register spills in their sm_90a code):
    the same bits as the unfused chain, F = 640 not a multiple of the tile."""
    with config.override(dact=tiles):
        check_dact(GPU_CASE, activation, True, True, f"gpu dact {activation} {tiles}")
        check_dact(GPU_CANCEL, activation, True, True, f"gpu dact {activation} {tiles} cancelling F=640")
    with config.override(dact=dataclasses.replace(tiles, min_slice_rows=128)):
        check_dact_slices(GPU_SLICES, activation, f"gpu dact slices {activation} {tiles}")


def _default_gemm_configs(activation: str) -> dict:
    """The fprop, act and dact kernels' default configs on the GPU."""
    dev = torch.device(DEVICE)
    return {kind: epilogue_config(kind, _act_code(activation), dev) if kind != "fprop"
            else config.bf16_gemm_config(kind, dev) for kind in ("fprop", "act", "dact")}


def _assert_configs_agree(activation: str, configs: dict, others: dict, label: str,
                          cases: tuple = (GPU_CANCEL, GPU_SLICES)) -> None:
    """Every output of the plain fprop and of the fused kernels, on the whole weight copy
    (cases[0]) and in slices of 128 columns where cases[1]'s copy is large enough, is the
    same byte for byte under `configs` and `others`. The GPU cases: K order visible, F = 640
    not a multiple of the tiles, empty groups, a group of one token and groups of 8 to 32 M
    tiles of 128 rows."""
    fc1, probs = fc1_inputs(cases[0], activation, True, label)
    dgrad, c, dprobs = dgrad_inputs(cases[0], activation, True, label)
    slices, sc, sprobs = dgrad_inputs(cases[1], activation, True, label)

    def outputs(pinned):
        with config.override(**{k: dataclasses.replace(v, min_slice_rows=128) for k, v in pinned.items()}):
            out = {"fprop": grouped_gemm_via_bf16(*fc1),
                   "fprop slices": grouped_gemm_via_bf16(*slices),
                   "act": grouped_gemm_act(*fc1, probs, activation, None, 0xD7E8)[:2],
                   "dact": grouped_gemm_dact(*dgrad, c, dprobs, activation, None, regenerate=True),
                   "dact slices": grouped_gemm_dact(*slices, sc, sprobs, activation, None, regenerate=True)}
        return {name: o if isinstance(o, tuple) else (o,) for name, o in out.items()}

    expected = outputs(others)
    for name, out in outputs(configs).items():
        for i, (t, e) in enumerate(zip(out, expected[name], strict=True)):
            assert_bytes_equal(t, e, f"{label}: {name} output {i}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_gpu_tma_loads_equal_pointer_loads(activation):
    """The default configs load with TMA (zero-fill past a group's last row, past N and past
    K) where the pointer variant clamps rows: the same bytes."""
    tma = _default_gemm_configs(activation)
    assert all(cfg.tma for cfg in tma.values()), tma
    _assert_configs_agree(activation, tma, {k: dataclasses.replace(v, tma=False) for k, v in tma.items()},
                          f"gpu tma {activation}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_gpu_bands_equal_whole_group_order(activation):
    """The default configs walk a group's tiles in bands of 8 M tiles (the 2900-row group:
    bands of 8, 8 and 7); the whole-group order gives the same bytes."""
    banded = _default_gemm_configs(activation)
    assert all(cfg.band_m == 8 for cfg in banded.values()), banded
    _assert_configs_agree(activation, banded, {k: dataclasses.replace(v, band_m=0) for k, v in banded.items()},
                          f"gpu bands {activation}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_k_order_and_unaligned_f():
    """K order visible and F % BN != 0: C's up columns at other tile positions in the fused
    SwiGLU kernel than in the unfused GEMM; bitwise equal only if the MMA's result for an
    element does not depend on its column in the tile."""
    check_act(GPU_CANCEL, "swiglu", True, "gpu act swiglu cancelling F=640")
    check_dact(GPU_CANCEL, "swiglu", True, True, "gpu dact swiglu cancelling F=640")
    args, _ = fc1_inputs(GPU_CANCEL, "swiglu", True, "gpu act swiglu cancelling F=640")
    assert_k_order_visible(args)


@pytest.mark.parametrize("recipe", [dict(), dict(rht=False, stochastic_rounding=False, block_2d=False),
                                    dict(sign_mask=0)], ids=["default", "plain", "mask0"])
@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_eager_chain_on_the_triton_plan_equals_its_unfused_chain(use_steps, activation, recipe):
    """The eager GroupedMLP runs the Triton plan's fused steps (``nvfp4::fc1_act_amax``,
    ``nvfp4::fc2_dgrad_act``) where it fuses them: forward and every gradient equal the same
    target's unfused chain byte for byte, SR included (both draw their seeds in the same
    order), so eager numbers on CUDA did not move; and no op returns an alias (torch rejects one on CUDA and CPU alike; a GPU run found such a
    bug that only the GPU had exercised)."""
    import nvfp4_inductor as nv
    from nvfp4_inductor import lowerings
    from nvfp4_inductor.lowerings.triton import STEPS as TRITON

    recipe = nv.Recipe(**recipe)
    use_steps(TRITON, like="triton")
    gen = torch.Generator().manual_seed(3)
    sizes, (t, h, f) = torch.tensor([3, 0, 17, 12]), (32, 16, 16)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    probs, dy = torch.rand(t, generator=gen), torch.randn(t, h, generator=gen).to(torch.bfloat16)

    def run():
        torch.manual_seed(0)
        mlp = nv.GroupedMLP(4, h, f, activation, recipe=recipe, device=DEVICE)
        xi, pi = x.to(DEVICE).requires_grad_(), probs.to(DEVICE).requires_grad_()
        y = mlp(xi, sizes.to(DEVICE), pi)
        grads = torch.autograd.grad(y, (xi, mlp.fc1_weight, mlp.fc2_weight, pi), dy.to(DEVICE))
        return (y,) + grads

    plan = lowerings.choose_plan(lowerings.SiteSpec.on(DEVICE, activation, hidden=h, ffn=f), recipe)
    assert plan.target.endswith("_under_test") and plan.fused_fc1 and plan.fused_dgrad, plan
    fused_chain = run()
    # the same Triton steps, planned without fused kernels (the reference's capabilities)
    use_steps(dataclasses.replace(TRITON, fc1_act_amax=None, fc2_dgrad_act=None), like="reference")
    plan = lowerings.choose_plan(lowerings.SiteSpec.on(DEVICE, activation, hidden=h, ffn=f), recipe)
    assert not (plan.fused_fc1 or plan.fused_dgrad), plan
    unfused_chain = run()
    for name, a, b in zip(("Y", "dX", "dW1", "dW2", "dprobs"), fused_chain, unfused_chain):
        assert_bytes_equal(a, b, f"eager chain {name}: Triton plan with vs without its fused kernels")


# The Triton launches of one compiled training step of a SwiGLU grouped MLP with router
# probs, default recipe (RHT, SR, 2D weight blocks, recompute), every fused kernel planned
# (the H200's plan). Without CUDA graphs such a step is host-bound on the H200
# (docs/decisions.md, "Host time"), so a change that adds a launch must change these numbers. The
# forward's casts: x (row-wise copy as deq() values + column-wise: two launches,
# config.cast_launches), the weight stacks (one each), D (row only); the backward's: dY and
# dC (SR, row + column: two launches each) and D's column-wise copy (recompute).
STEP_LAUNCHES_FORWARD = {"_group_amax_kernel": 4, "_group_cast_kernel": 5,  # the casts write the GEMMs' deq() operands
                         "_grouped_gemm_act_kernel": 1, "_grouped_gemm_bf16_kernel": 1}
STEP_LAUNCHES_BACKWARD = {"_group_amax_kernel": 2, "_group_cast_kernel": 5, "_dequantize_kernel": 4,
                          "_grouped_gemm_dact_kernel": 1, "_dp_sum_kernel": 1,
                          "_act_fwd_kernel": 1,  # D rebuilt after the dgrad (Steps.d_after_dgrad)
                          "_grouped_gemm_wgrad_bf16_kernel": 2, "_grouped_gemm_bf16_kernel": 1}


def test_compiled_training_step_launch_counts(use_steps, replace_launches):
    """The Triton launches of one compiled step, forward and backward apart, counted at every
    kernel module's ``launch`` (each imports it by name) and run for real; the step after
    the one that compiles, so tracing's fake launches are not counted."""
    import collections

    from torch._dynamo.utils import counters

    import nvfp4_inductor as nv
    from nvfp4_inductor.lowerings.triton import STEPS as TRITON

    counts = collections.Counter()

    def counting(real):
        def launch(kernel, grid, **kwargs):
            counts[kernel.__name__] += 1
            real(kernel, grid, **kwargs)
        return launch

    replace_launches(counting)
    use_steps(TRITON, like="triton")
    gen = torch.Generator().manual_seed(5)
    sizes, (t, h, f) = torch.tensor([3, 0, 17, 12]), (32, 16, 16)
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(4, h, f, "swiglu", device=DEVICE)
    # earlier tests' entries for GroupedMLP.forward could reach Dynamo's recompile limit,
    # which would run this step eagerly (other launches): start from an empty cache
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))

    def run():
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(DEVICE).requires_grad_()
        probs = torch.rand(t, generator=gen).to(DEVICE).requires_grad_()
        counts.clear()
        y = step(x, sizes.to(DEVICE), probs)
        forward = dict(counts)
        counts.clear()
        y.backward(torch.randn(t, h, generator=gen).to(torch.bfloat16).to(DEVICE))
        return forward, dict(counts)

    try:
        run()  # compiles
        assert counters["nvfp4"]["sites_rewritten"] == 1, dict(counters["nvfp4"])  # the fused ops run
        forward, backward = run()
    finally:  # this step's cache entries were planned on the test's target: later tests start afresh
        torch._dynamo.reset()
    assert forward == STEP_LAUNCHES_FORWARD, forward
    assert backward == STEP_LAUNCHES_BACKWARD, backward
