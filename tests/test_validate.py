"""nvfp4_inductor/validate.py through the public API: every bad input raises ValueError
whose message names the argument.

Each case is data: (what is wrong, the call, a regex naming the argument). The calls go
through ``nvfp4_inductor.quantize``, ``group_quantize``, ``grouped_mlp`` and ``GroupedMLP``
(for the module, construction and first forward together: the module validates when it
runs, as ``grouped_mlp`` does). Group-size values are checked on the host when the sizes
live there (these CPU tests); on a GPU they become device-side asserts, not covered here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch

import nvfp4_inductor as nv

G, H, F, T = 4, 32, 48, 80
SIZES = (20, 0, 37, 23)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=_gen(seed)).to(torch.bfloat16)


def _mlp_inputs(activation="srelu", seed=0):
    f1 = 2 * F if activation == "swiglu" else F
    return dict(
        x=_bf16(T, H, seed=seed),
        fc1_weight=_bf16(G, f1, H, seed=seed + 1) * 0.1,
        fc2_weight=_bf16(G, H, F, seed=seed + 2) * 0.1,
        group_sizes=torch.tensor(SIZES),
        probs=torch.rand(T, generator=_gen(seed + 3)),
    )


def _grouped_mlp(activation="srelu", tanh_clamp_scale=None, **override):
    kw = _mlp_inputs(activation)
    kw.update(override)
    x, w1, w2, gs, p = (kw.pop(k) for k in ("x", "fc1_weight", "fc2_weight", "group_sizes", "probs"))
    return nv.grouped_mlp(x, w1, w2, gs, p, activation=activation, tanh_clamp_scale=tanh_clamp_scale)


def _module(hidden=H, ffn=F, activation="srelu", tanh_clamp_scale=None, x=None, group_sizes=None, probs=None,
            dtype=torch.bfloat16):
    m = nv.GroupedMLP(G, hidden, ffn, activation, tanh_clamp_scale, dtype=dtype)
    x = _bf16(T, hidden) if x is None else x
    return m(x, torch.tensor(SIZES) if group_sizes is None else group_sizes, probs)


@dataclasses.dataclass(frozen=True)
class Bad:
    name: str
    call: Callable[[], object]
    match: str


CASES = [
    # --- quantize (one (M, K) tensor)
    Bad("quantize: fp64 x", lambda: nv.quantize(torch.randn(32, 32, dtype=torch.float64)), r"^x must have dtype"),
    Bad("quantize: int x", lambda: nv.quantize(torch.ones(32, 32, dtype=torch.int32)), r"^x must have dtype"),
    Bad("quantize: 3-D x", lambda: nv.quantize(_bf16(2, 32, 32)), r"^x must be 2-D"),
    Bad("quantize: K not a multiple of 16", lambda: nv.quantize(_bf16(32, 40)), r"x\.shape\[1\] \(K\)"),
    Bad("quantize: column-wise with M not a multiple of 16",
        lambda: nv.quantize(_bf16(40, 32), columnwise=True), r"x\.shape\[0\] \(M\) for a column-wise"),
    Bad("quantize: block_2d with M not a multiple of 16",
        lambda: nv.quantize(_bf16(40, 32), block_2d=True), r"x\.shape\[0\] \(M\) with block_2d"),
    Bad("quantize: rht on fp32 x",
        lambda: nv.quantize(torch.randn(32, 32), columnwise=True, rht=True), r"^rht needs a bfloat16 x"),
    Bad("quantize: rht on fp16 x",
        lambda: nv.quantize(_bf16(32, 32).half(), columnwise=True, rht=True), r"^rht needs a bfloat16 x"),
    Bad("quantize: no copy asked for", lambda: nv.quantize(_bf16(32, 32), rowwise=False), r"rowwise / columnwise"),
    Bad("quantize: sign_mask out of range",
        lambda: nv.quantize(_bf16(32, 32), columnwise=True, rht=True, sign_mask=0x10000), r"^sign_mask"),
    Bad("quantize: bf16 amax",
        lambda: nv.quantize(_bf16(32, 32), rowwise_amax=torch.tensor(1.0, dtype=torch.bfloat16)),
        r"^rowwise_amax must have dtype float32"),
    Bad("quantize: amax of wrong size",
        lambda: nv.quantize(_bf16(32, 32), columnwise=True, columnwise_amax=torch.ones(2)), r"^columnwise_amax"),
    # --- group_quantize
    Bad("group_quantize: fp64 x",
        lambda: nv.group_quantize(torch.randn(T, 32, dtype=torch.float64), torch.tensor(SIZES)), r"^x must"),
    Bad("group_quantize: K not a multiple of 16",
        lambda: nv.group_quantize(_bf16(T, 24), torch.tensor(SIZES)), r"x\.shape\[1\] \(K\)"),
    Bad("group_quantize: negative group size",
        lambda: nv.group_quantize(_bf16(T, 32), torch.tensor([40, -3, 20, 23])), r"^group_sizes must be non-negative"),
    Bad("group_quantize: sizes not summing to T",
        lambda: nv.group_quantize(_bf16(T, 32), torch.tensor([20, 0, 37, 22])), r"^group_sizes must sum"),
    Bad("group_quantize: float group sizes",
        lambda: nv.group_quantize(_bf16(T, 32), torch.tensor([20.0, 0.0, 37.0, 23.0])), r"^group_sizes must be an int"),
    Bad("group_quantize: 2-D group sizes",
        lambda: nv.group_quantize(_bf16(T, 32), torch.tensor([[20, 0], [37, 23]])), r"^group_sizes must be 1-D"),
    Bad("group_quantize: rht on fp32 x",
        lambda: nv.group_quantize(torch.randn(T, 32), torch.tensor(SIZES), columnwise=True, rht=True),
        r"^rht needs a bfloat16 x"),
    Bad("group_quantize: block_2d",
        lambda: nv.group_quantize(_bf16(T, 32), torch.tensor(SIZES), block_2d=True), r"^block_2d"),
    Bad("group_quantize: amax per group of wrong size",
        lambda: nv.group_quantize(_bf16(T, 32), torch.tensor(SIZES), rowwise_amax=torch.ones(3)), r"^rowwise_amax"),
    # --- grouped_mlp
    Bad("grouped_mlp: fp32 x", lambda: _grouped_mlp(x=torch.randn(T, H)), r"^x must have dtype bfloat16"),
    Bad("grouped_mlp: fp32 fc1_weight",
        lambda: _grouped_mlp(fc1_weight=torch.randn(G, F, H)), r"^fc1_weight must have dtype bfloat16"),
    Bad("grouped_mlp: fp32 fc2_weight",
        lambda: _grouped_mlp(fc2_weight=torch.randn(G, H, F)), r"^fc2_weight must have dtype bfloat16"),
    Bad("grouped_mlp: H not a multiple of 16",
        lambda: _grouped_mlp(x=_bf16(T, 40), fc1_weight=_bf16(G, F, 40), fc2_weight=_bf16(G, 40, F)),
        r"^H \(hidden\) must be a multiple of 16"),
    Bad("grouped_mlp: F not a multiple of 16",
        lambda: _grouped_mlp(fc1_weight=_bf16(G, 40, H), fc2_weight=_bf16(G, H, 40)),
        r"^F \(ffn\) must be a multiple of 16"),
    Bad("grouped_mlp: negative group size",
        lambda: _grouped_mlp(group_sizes=torch.tensor([40, -3, 20, 23])), r"^group_sizes must be non-negative"),
    Bad("grouped_mlp: sizes not summing to T",
        lambda: _grouped_mlp(group_sizes=torch.tensor([20, 0, 37, 24])), r"^group_sizes must sum"),
    Bad("grouped_mlp: float group sizes",
        lambda: _grouped_mlp(group_sizes=torch.tensor([20.0, 0.0, 37.0, 23.0])), r"^group_sizes must be an int"),
    Bad("grouped_mlp: fc1/fc2 expert counts differ",
        lambda: _grouped_mlp(fc2_weight=_bf16(G + 1, H, F)), r"fc2_weight has 5.*mismatched expert counts"),
    Bad("grouped_mlp: group_sizes count differs from the weights'",
        lambda: _grouped_mlp(group_sizes=torch.tensor([20, 37, 23])), r"^group_sizes has 3 entries.*4 experts"),
    Bad("grouped_mlp: x hidden size differs from fc1's",
        lambda: _grouped_mlp(x=_bf16(T, 48)), r"^x\.shape\[1\] \(48\) must equal fc1_weight"),
    Bad("grouped_mlp: fc2 hidden size differs",
        lambda: _grouped_mlp(fc2_weight=_bf16(G, 48, F)), r"^fc2_weight\.shape\[1\]"),
    Bad("grouped_mlp: swiglu with F1 = F", lambda: _grouped_mlp("swiglu", fc1_weight=_bf16(G, F, H)),
        r"^fc2_weight\.shape\[2\] \(48\) must equal F = 24"),
    Bad("grouped_mlp: bad activation name", lambda: _grouped_mlp("gelu"), r"^activation must be one of"),
    Bad("grouped_mlp: tanh_srelu without clamp", lambda: _grouped_mlp("tanh_srelu"),
        r"^tanh_clamp_scale must be a positive float"),
    Bad("grouped_mlp: tanh_srelu with clamp 0", lambda: _grouped_mlp("tanh_srelu", 0.0), r"^tanh_clamp_scale"),
    Bad("grouped_mlp: clamp with srelu", lambda: _grouped_mlp("srelu", 2.0), r"^tanh_clamp_scale applies"),
    Bad("grouped_mlp: probs of wrong length", lambda: _grouped_mlp(probs=torch.rand(T - 1)), r"^probs must be \(T,\)"),
    Bad("grouped_mlp: probs 2-D", lambda: _grouped_mlp(probs=torch.rand(T, 1)), r"^probs must be \(T,\)"),
    Bad("grouped_mlp: fp64 probs", lambda: _grouped_mlp(probs=torch.rand(T, dtype=torch.float64)),
        r"^probs must have dtype"),
    Bad("grouped_mlp: 3-D x", lambda: _grouped_mlp(x=_bf16(2, T // 2, H)), r"^x must be 2-D"),
    # another device: "meta" stands in for a GPU on this CPU-only suite
    Bad("grouped_mlp: group_sizes on another device", lambda: _grouped_mlp(group_sizes=torch.tensor(SIZES).to("meta")),
        r"^group_sizes must be on x's device \(cpu\); got meta"),
    Bad("grouped_mlp: probs on another device", lambda: _grouped_mlp(probs=torch.rand(T).to("meta")),
        r"^probs must be on x's device"),
    Bad("grouped_mlp: fc2_weight on another device", lambda: _grouped_mlp(fc2_weight=_bf16(G, H, F).to("meta")),
        r"^fc2_weight must be on x's device"),
    Bad("group_quantize: group_sizes on another device",
        lambda: nv.group_quantize(_bf16(T, 32), torch.tensor(SIZES).to("meta")), r"^group_sizes must be on x's device"),
    Bad("quantize: amax on another device",
        lambda: nv.quantize(_bf16(32, 32), rowwise_amax=torch.ones(1).to("meta")),
        r"^rowwise_amax must be on x's device"),
    # --- GroupedMLP (construct + forward)
    Bad("GroupedMLP: fp32 parameters", lambda: _module(dtype=torch.float32), r"^fc1_weight must have dtype bfloat16"),
    Bad("GroupedMLP: fp16 dtype, refused at construction", lambda: nv.GroupedMLP(G, H, F, dtype=torch.float16),
        r"^GroupedMLP: dtype must be torch.bfloat16 .*; got torch.float16$"),
    Bad("GroupedMLP: fp32 x", lambda: _module(x=torch.randn(T, H)), r"^x must have dtype bfloat16"),
    Bad("GroupedMLP: H not a multiple of 16", lambda: _module(hidden=40), r"^H \(hidden\)"),
    Bad("GroupedMLP: F not a multiple of 16", lambda: _module(ffn=40), r"^F \(ffn\)"),
    Bad("GroupedMLP: bad activation name", lambda: _module(activation="relu"), r"^activation must be one of"),
    Bad("GroupedMLP: tanh_srelu without clamp", lambda: _module(activation="tanh_srelu"), r"^tanh_clamp_scale"),
    Bad("GroupedMLP: sizes not summing to T",
        lambda: _module(group_sizes=torch.tensor([1, 2, 3, 4])), r"^group_sizes must sum"),
    Bad("GroupedMLP: negative group size",
        lambda: _module(group_sizes=torch.tensor([40, -3, 20, 23])), r"^group_sizes must be non-negative"),
    Bad("GroupedMLP: float group sizes",
        lambda: _module(group_sizes=torch.tensor([20.0, 0.0, 37.0, 23.0])), r"^group_sizes must be an int"),
    Bad("GroupedMLP: group_sizes count differs", lambda: _module(group_sizes=torch.tensor([40, 40])),
        r"^group_sizes has 2 entries"),
    Bad("GroupedMLP: probs of wrong shape", lambda: _module(probs=torch.rand(T + 1)), r"^probs must be \(T,\)"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_input_raises_value_error_naming_the_argument(case: Bad):
    with pytest.raises(ValueError, match=case.match):
        case.call()


@pytest.mark.parametrize(
    "field,value",
    [("rht", 1), ("block_2d", "yes"), ("stochastic_rounding", None), ("sign_mask", -1), ("sign_mask", 0x10000),
     ("sign_mask", 1.0)],
)
def test_recipe_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=rf"^Recipe\.{field}"):
        nv.Recipe(**{field: value})


def test_good_inputs_pass():
    """The baseline every bad case perturbs is itself valid (so each case fails for its reason)."""
    assert _grouped_mlp().shape == (T, H)
    assert _grouped_mlp("tanh_srelu", 3.0).shape == (T, H)
    assert _grouped_mlp("swiglu", fc1_weight=_bf16(G, 2 * F, H)).shape == (T, H)
    assert _module().shape == (T, H)
    nv.quantize(_bf16(40, 32))  # row-wise only: M need not be a multiple of 16
    nv.group_quantize(_bf16(T, 32), torch.tensor(SIZES, dtype=torch.int32), columnwise=True, rht=True)
