"""The activation registry (activations.py): an activation added from outside the package,
the registry's errors, row masks against whether an activation is 0 at 0, and the
built-in entries' reference math bit for bit.

* Plain ReLU (f = relu(c), f' = (c > 0); not gated, no scale, 0 at 0, no Triton code,
  pattern relu(H)), registered from this file alone by the steps of docs/architecture.md
  "Adding an activation", is recognised in a token-permutation MoE block (explain shows
  the site), and compiled with the nvfp4 backend it equals eager NVFP4 bit for bit in the
  output and every gradient, with the router prob on the activation or on the fc2 output;
  the same through ``GroupedMLP(activation="relu")``.
* Unknown names, duplicate names and Triton codes, patterns that do not fit the entry, a
  Triton code the kernels have no branch for (or whose branch computes another function),
  and a zero_at_zero its forward contradicts raise ValueErrors that name what is wrong.
* Row masks, with the activation and prob in fp32 as the contract computes them, and the
  site rewritten with the contract's plain-PyTorch call: ReLU (0 at 0) folds a mask on
  fc1's output into the prob; a made-up activation with f(0) = 1 (tanh(s / h**2)) folds
  masks on D and on fc2's output, and leaves a block with a mask on fc1's output as
  written, with the reason. Each rewritten block equals eager bit for bit, output and
  every gradient.
* Each built-in entry's forward / backward, and activation_forward / activation_backward
  through them, give the bytes of the formulas written out below (the code before the
  registry), on bf16 inputs with negatives, +-0, tiny and huge values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moe_models as mm
import nvfp4_inductor as nv
from _assertions import assert_bytes_equal
from nvfp4_inductor.activations import (
    GATE,
    PATTERN_OPS,
    S,
    TRITON_BRANCHES,
    UP,
    Activation,
    H,
    activation_backward,
    activation_forward,
    activation_names,
    get_activation,
    op,
    register_activation,
    unregister_activation,
)

# ---------------------------------------------------------------------------------------
# ReLU, added by the steps of docs/architecture.md "Adding an activation"


# Step 1: the reference math in fp32, in the operation order every target must follow.
def _relu_forward(c, scale):
    return torch.relu(c)


def _relu_backward(gp, c, scale):
    return gp * (c > 0).to(c.dtype), torch.relu(c)


# Step 2: the pattern, over PATTERN_OPS. Step 3: relu(0) = 0, so zero_at_zero=True (a row
# mask on fc1's output may fold into the prob). Step 4: no Triton kernel branch computes
# relu, so no triton_code: the Triton target runs the reference math in its unfused steps.
RELU = Activation("relu", gated=False, takes_scale=False, forward=_relu_forward, backward=_relu_backward,
                  pattern=op("relu", H), zero_at_zero=True)


@pytest.fixture
def relu_registered():
    # Step 5: register it; every matcher, check and target reads the registry from now on.
    register_activation(RELU)
    yield RELU
    unregister_activation("relu")


class ReluMoE(nn.Module):
    """A token-permutation MoE block: router, tokens sorted by expert, fc1 and fc2 as two
    ``torch._grouped_mm`` sharing the offsets, relu between them, the router prob multiplied
    on the activation ("act") or on the fc2 output ("out"), un-permute."""

    def __init__(self, prob: str):
        super().__init__()
        self.router, self.prob = mm.Router(), prob
        self.fc1, self.fc2 = mm._param(mm.G, mm.FF, mm.H), mm._param(mm.G, mm.H, mm.FF)

    def forward(self, x):
        weights, ids = self.router(x)
        expert_ids = ids.reshape(-1)
        perm = torch.argsort(expert_ids, stable=True)
        token = torch.arange(x.shape[0]).unsqueeze(1).expand(-1, ids.shape[1]).reshape(-1)[perm]
        p = weights.reshape(-1)[perm]
        counts = torch.histc(expert_ids.float(), bins=mm.G, min=0, max=mm.G - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        d = torch.relu(torch._grouped_mm(x[token], self.fc1.transpose(-2, -1), offs=offs))
        if self.prob == "act":
            d = d * p.unsqueeze(-1)
        y = torch._grouped_mm(d, self.fc2.transpose(-2, -1), offs=offs)
        if self.prob == "out":
            y = y * p.unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, y)

    def inputs(self, seed):
        return (mm._x(seed, mm.T // mm.TOP_K, mm.H).requires_grad_(),)


# ---------------------------------------------------------------------------------------
# An activation registered from outside the package


@pytest.mark.parametrize("prob", ["act", "out"])
def test_registered_relu_is_recognised_and_compiled_bitwise(relu_registered, prob):
    torch.manual_seed(0)
    model = ReluMoE(prob)
    report = nv.explain(model)(*model.inputs(0))
    assert [(s.spelling, s.activation) for s in report.sites] == [("token_permutation", "relu")], str(report)
    assert report.rejected == []
    compared = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(*model.inputs(1))
    assert compared.bitwise, str(compared)
    assert len(compared.rows) == 1 + 4  # output; grads of x, router, fc1, fc2


def test_registered_relu_grouped_mlp_module_compiled_bitwise(relu_registered):
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(4, 32, 48, "relu")
    assert mlp.fc1_weight.shape == (4, 48, 32)  # not gated: F1 = F
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(64, requires_grad=True)
    compared = nv.compare(mlp, backend=nv.backend(compiler="aot_eager"))(x, torch.tensor([10, 0, 31, 23]), probs)
    assert compared.bitwise, str(compared)


def test_registered_relu_runs_the_reference_on_the_triton_target(relu_registered):
    """No triton_code: the Triton lowering's activation steps run the entry's formulas."""
    from nvfp4_inductor.lowerings import triton as triton_lowering

    gen = torch.Generator().manual_seed(0)
    c = torch.randn(32, 48, generator=gen).bfloat16()
    g = torch.randn(32, 48, generator=gen).bfloat16()
    probs = torch.rand(32, generator=gen)
    d = triton_lowering.activation_forward(c, probs, "relu")
    assert_bytes_equal(d, (torch.relu(c.float()) * probs[:, None]).bfloat16(), "relu D")
    dc, dp, d_regen = triton_lowering.activation_backward(g, c, probs, "relu", regenerate=True)
    assert_bytes_equal(dc, ((g.float() * probs[:, None]) * (c > 0).float()).bfloat16(), "relu dC")
    assert_bytes_equal(dp, activation_backward(g, c, probs, "relu")[1], "relu dp")
    assert_bytes_equal(d_regen, d, "relu regenerated D")


def test_unregistered_name_is_unknown_again(relu_registered):
    assert activation_names() == ("srelu", "tanh_srelu", "swiglu", "relu")
    unregister_activation("relu")
    try:
        assert activation_names() == ("srelu", "tanh_srelu", "swiglu")
        with pytest.raises(ValueError, match="^activation must be one of"):
            nv.GroupedMLP(4, 32, 48, "relu")
    finally:
        register_activation(RELU)  # for the fixture's unregister


# ---------------------------------------------------------------------------------------
# Errors


def test_unknown_name_names_the_argument_and_the_known_names():
    with pytest.raises(ValueError, match=r"^activation must be one of \('srelu', 'tanh_srelu', 'swiglu'\); "
                                         r"got 'gelu'$"):
        get_activation("gelu")
    with pytest.raises(ValueError, match=r"^Site\.activation must be one of"):
        get_activation("gelu", "Site.activation")
    with pytest.raises(ValueError, match="^activation must be one of"):
        unregister_activation("gelu")


def test_duplicate_registration_raises(relu_registered):
    with pytest.raises(ValueError, match="'relu' is already registered"):
        register_activation(RELU)
    srelu = get_activation("srelu")
    with pytest.raises(ValueError, match="triton_code 0 of 'srelu2' is 'srelu'"):
        register_activation(Activation("srelu2", False, False, srelu.forward, srelu.backward, srelu.pattern,
                                       True, triton_code=0))
    assert activation_names() == ("srelu", "tanh_srelu", "swiglu", "relu")


def test_a_triton_code_without_a_kernel_branch_is_refused():
    """The kernels compute only their branches' activations: any other code would run one
    of them silently, so an entry cannot claim it."""
    assert sorted(b.code for b in TRITON_BRANCHES.values()) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"^Activation\.triton_code of 'relu' must be None or the code of a Triton "
                                         r"kernel branch, one of 0 \(srelu\), 1 \(tanh_srelu\), 2 \(swiglu\); "
                                         r"got 3\. .*its entry in activations\.TRITON_BRANCHES first$"):
        register_activation(Activation("relu", False, False, _relu_forward, _relu_backward, op("relu", H), True,
                                       triton_code=3))
    with pytest.raises(ValueError, match=r"^Activation\.triton_code 0 of 'relu' is the Triton kernels' srelu "
                                         r"branch, which computes square\(relu\(H\)\); the entry's pattern is "
                                         r"relu\(H\)$"):
        register_activation(Activation("relu", False, False, _relu_forward, _relu_backward, op("relu", H), True,
                                       triton_code=0))
    assert "relu" not in activation_names()


def test_each_builtin_is_its_kernel_branch():
    for name, branch in TRITON_BRANCHES.items():
        entry = get_activation(name)
        assert (entry.triton_code, entry.pattern, entry.zero_at_zero) == (branch.code, branch.pattern, True)


@pytest.mark.parametrize("name,gated,takes_scale,forward,pattern,claim,says", [
    ("shifted", False, True, lambda c, s: torch.tanh(s / c.square()), op("tanh", op("div", S, op("square", H))), True,
     r"is True, but its forward gives \[1\.0, .*\] where 0 at scale 0\.5$"),
    ("relu", False, False, _relu_forward, op("relu", H), False, "is False, but its forward gives 0 on every zero row$"),
    ("gated_sum", True, False, lambda c, s: torch.relu(c.chunk(2, -1)[0]) + c.chunk(2, -1)[1],
     op("mul", op("relu", GATE), UP), True, r"is True, but its forward gives \[-10000\.0, .*\] where gate = 0$"),
])
def test_zero_at_zero_must_be_what_the_forward_computes(name, gated, takes_scale, forward, pattern, claim, says):
    """Exactly at 0 (+0 and -0); for a gated activation also a zero gate (up) row beside
    nonzero up (gate) values, as a row mask on one of two separate fc1 GEMMs makes."""
    with pytest.raises(ValueError, match=rf"^Activation\.zero_at_zero of '{name}' {says}"):
        register_activation(Activation(name, gated, takes_scale, forward, None, pattern, claim))
    assert name not in activation_names()


@pytest.mark.parametrize("gated,takes_scale,pattern,match", [
    (True, False, op("relu", H), r"must use exactly \['GATE', 'UP'\]"),
    (False, True, op("relu", H), r"must use exactly \['H', 'S'\]"),
    (False, False, H, "must be an Op"),
])
def test_pattern_must_fit_the_entry(gated, takes_scale, pattern, match):
    with pytest.raises(ValueError, match=match):
        Activation("bad", gated, takes_scale, _relu_forward, _relu_backward, pattern, True)


def test_pattern_ops_are_checked():
    with pytest.raises(ValueError, match="^Op must be one of"):
        op("gelu", H)
    with pytest.raises(ValueError, match="^Op must be one of"):
        op("mul", H)


def test_matcher_spells_every_pattern_op():
    """compiler/match_activation.py knows a spelling of every op a pattern may use."""
    from nvfp4_inductor.compiler.match_activation import _spellings

    node = torch.fx.Graph().placeholder("x")
    for name in PATTERN_OPS:
        assert _spellings(name, node) == []  # no AssertionError: the op is known


# ---------------------------------------------------------------------------------------
# The built-ins' reference math, bit for bit against the formulas written out


def _formula_forward(c, activation, s):
    if activation == "srelu":
        r = torch.relu(c)
        return r * r
    if activation == "tanh_srelu":
        b = s * torch.tanh(torch.relu(c) / s)
        return b * b
    a, u = c.chunk(2, dim=-1)
    return (a * torch.sigmoid(a)) * u


def _formula_backward(gp, c, activation, s):
    """(dc, f) from gp = G * p and c, in fp32."""
    if activation == "swiglu":
        a, u = c.chunk(2, dim=-1)
        sg = torch.sigmoid(a)
        si = a * sg
        return torch.cat((gp * (u * (sg * (1 + a * (1 - sg)))), gp * si), dim=-1), si * u
    if activation == "srelu":
        r = torch.relu(c)
        return gp * (2 * r), r * r
    t = torch.tanh(torch.relu(c) / s)
    b = s * t
    return gp * ((2 * b) * (1 - t * t)), b * b


def _bf16_values(seed, t, n):
    """Random bf16 (t, n) with negatives, +-0, tiny and huge values planted in every row."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(t, n, generator=gen) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=gen)]
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e4, -3e4, 1e30, -1e30])
    v[:, :len(special)] = special
    return v.bfloat16()


BUILTINS = [("srelu", None), ("tanh_srelu", 3.0), ("tanh_srelu", 0.5), ("swiglu", None)]


@pytest.mark.parametrize("activation,s", BUILTINS, ids=[f"{a}-{s}" for a, s in BUILTINS])
def test_builtin_entry_math_is_the_written_out_formula(activation, s):
    entry = get_activation(activation)
    f = 48
    c = _bf16_values(10, 64, 2 * f if entry.gated else f).float()
    gp = _bf16_values(11, 64, f).float() * torch.rand(64, 1, generator=torch.Generator().manual_seed(12))
    assert_bytes_equal(entry.forward(c, s), _formula_forward(c, activation, s), f"{activation} forward")
    for got, want, name in zip(entry.backward(gp, c, s), _formula_backward(gp, c, activation, s), ("dc", "f")):
        assert_bytes_equal(got, want, f"{activation} backward {name}")


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("activation,s", BUILTINS, ids=[f"{a}-{s}" for a, s in BUILTINS])
def test_builtin_chain_is_the_written_out_formula(activation, s, with_probs):
    """activation_forward / activation_backward: D, dC, dp and the regenerated D."""
    f = 48
    gated = get_activation(activation).gated
    c, g = _bf16_values(20, 64, 2 * f if gated else f), _bf16_values(21, 64, f)
    probs = torch.rand(64, generator=torch.Generator().manual_seed(22)) if with_probs else None
    p = probs.unsqueeze(1) if with_probs else None
    f_ = _formula_forward(c.float(), activation, s)
    d = (f_ * p if with_probs else f_).bfloat16()
    assert_bytes_equal(activation_forward(c, probs, activation, s), d, "D")
    gp = g.float() * p if with_probs else g.float()
    dc, f_ = _formula_backward(gp, c.float(), activation, s)
    got_dc, got_dp, got_d = activation_backward(g, c, probs, activation, s, regenerate=True)
    assert_bytes_equal(got_dc, dc.bfloat16(), "dC")
    assert_bytes_equal(got_d, d, "regenerated D")
    if with_probs:
        from nvfp4_inductor.activations import row_sum

        assert_bytes_equal(got_dp, row_sum(g.float() * f_), "dp")
    else:
        assert got_dp is None


def test_triton_target_fuses_only_activations_with_triton_code(relu_registered):
    """An activation without Triton code is planned on the Triton target with its unfused
    steps (whose activation wrappers run the reference formulas), never its fused kernels."""
    from nvfp4_inductor.lowerings import SiteSpec, get_target
    from nvfp4_inductor.lowerings.policy import plan_with

    caps = get_target("triton").probe(torch.device("cpu"))  # the interpreter runs the kernels here
    if isinstance(caps, str):
        pytest.skip(caps)
    assert {"srelu", "tanh_srelu", "swiglu"} <= caps.fused_activations and "relu" not in caps.fused_activations
    plan, why = plan_with("triton", caps, SiteSpec("relu", torch.device("cuda"), (9, 0)), nv.Recipe())
    assert (plan.fused_fc1, plan.fused_amax, plan.fused_dgrad) == (False, False, False)
    assert "no fused kernel for relu" in why


# ---------------------------------------------------------------------------------------
# Row masks and zero_at_zero: the fold into the prob against the model's own function


def _shifted_forward(c, s):
    return torch.tanh(s / c.square())  # f(0) = tanh(inf) = 1


def _shifted_backward(gp, c, s):
    t = torch.tanh(s / c.square())
    return gp * ((1 - t * t) * (-2 * s / (c * c.square()))), t


# A made-up activation that is not 0 at 0 (pattern ops have no add: a nonzero f(0) comes
# from a division by something 0 at 0).
SHIFTED = Activation("shifted", gated=False, takes_scale=True, forward=_shifted_forward, backward=_shifted_backward,
                     pattern=op("tanh", op("div", S, op("square", H))), zero_at_zero=False)
_SHIFT_S = 0.5


@pytest.fixture
def shifted_registered():
    register_activation(SHIFTED)
    yield SHIFTED
    unregister_activation("shifted")


class MaskedFp32Block(nn.Module):
    """A grouped_mm block computing D = bf16(f(float(C)) * p) as the contract does, with a
    bool row mask (masked_fill) on fc1's output C ("c"), on D ("d") or on fc2's output ("y")."""

    def __init__(self, activation: str, where: str):
        super().__init__()
        self.activation, self.where = activation, where
        self.w1, self.w2 = mm._param(mm.G, mm.FF, mm.H), mm._param(mm.G, mm.H, mm.FF)

    def act(self, h):
        return torch.relu(h) if self.activation == "relu" else torch.tanh(_SHIFT_S / h.square())

    def forward(self, x, offs, probs, mask):
        m = mask.unsqueeze(-1)
        h = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)
        if self.where == "c":
            h = h.masked_fill(m, 0.0)
        d = self.act(h.float()) * probs.unsqueeze(-1)
        if self.where == "d":
            d = d.masked_fill(m, 0.0)
        y = torch._grouped_mm(d.bfloat16(), self.w2.transpose(-2, -1), offs=offs)
        if self.where == "y":
            y = y.masked_fill(m, 0.0)
        return y

    def inputs(self, seed):
        offs = torch.cumsum(mm._sizes(seed), 0, dtype=torch.int32)
        gen = torch.Generator().manual_seed(seed)
        mask = torch.rand(mm.T, generator=gen) < 0.3
        return mm._x(seed, mm.T, mm.H).requires_grad_(), offs, torch.rand(mm.T, generator=gen).requires_grad_(), mask


def _contract_call(x, fc1_weight, fc2_weight, group_sizes, probs, *, activation, tanh_clamp_scale):
    """The canonical call in plain PyTorch, D made by the registry's activation_forward."""
    offs = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    c = torch._grouped_mm(x, fc1_weight.transpose(-2, -1), offs=offs)
    d = activation_forward(c, probs, activation, tanh_clamp_scale)
    return torch._grouped_mm(d, fc2_weight.transpose(-2, -1), offs=offs)


def _run_rewritten_and_eager(model):
    """(sites and rejections of the one graph, then for eager and for the graph rewritten
    with ``_contract_call``: the output and the gradients of x, probs, W1 and W2)."""
    from torch._dynamo.backends.debugging import aot_eager

    from nvfp4_inductor.compiler.rewrite import find_sites, rewrite_sites

    found = []

    def backend(gm, example_inputs):
        sites, rejections = find_sites(gm)
        found.append((sites, rejections))
        rewrite_sites(gm, sites, make_call=_contract_call)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    results = []
    for fn in (model, torch.compile(model, backend=backend, fullgraph=True)):
        model.zero_grad()
        x, offs, probs, mask = model.inputs(1)
        y = fn(x, offs, probs, mask)
        y.backward(mm._x(2, *y.shape))
        results.append([y, x.grad, probs.grad, model.w1.grad, model.w2.grad])
    (found_one,) = found
    return found_one, results


def _assert_bitwise(results, label):
    for name, want, got in zip(("y", "dx", "dprobs", "dW1", "dW2"), *results):
        assert_bytes_equal(got, want, f"{label} {name}")


def test_relu_is_zero_at_zero_and_folds_a_mask_on_fc1s_output(relu_registered):
    model = MaskedFp32Block("relu", "c")
    (sites, rejections), results = _run_rewritten_and_eager(model)
    assert rejections == [] and [(s.activation, len(s.row_masks)) for s in sites] == [("relu", 1)]
    _assert_bitwise(results, "relu, mask on C")


@pytest.mark.parametrize("where", ["d", "y"])
def test_not_zero_at_zero_still_folds_masks_on_d_and_y(shifted_registered, where):
    """A masked row of D or Y is 0 whatever f(0) is: the fold is the model's function."""
    model = MaskedFp32Block("shifted", where)
    (sites, rejections), results = _run_rewritten_and_eager(model)
    assert rejections == [] and [(s.activation, s.tanh_clamp_scale, len(s.row_masks)) for s in sites] == [
        ("shifted", _SHIFT_S, 1)]
    _assert_bitwise(results, f"f(0) = 1, mask on {where}")


def test_not_zero_at_zero_leaves_a_mask_on_fc1s_output_unrewritten(shifted_registered):
    """Masked rows of C give D = f(0) * p = p there, not the 0 a zeroed prob gives: the
    block runs as written, and explain says why."""
    model = MaskedFp32Block("shifted", "c")
    (sites, rejections), results = _run_rewritten_and_eager(model)
    assert sites == [] and len(rejections) == 1
    assert rejections[0].reason == (
        "row mask `h_1` on the fc1 output: shifted is not 0 at 0 (Activation.zero_at_zero), so the masked "
        "rows' D = f(0) * p is not 0 and the mask cannot fold into the router prob"), rejections[0].reason
    _assert_bitwise(results, "f(0) = 1, mask on C, as written")
    report = nv.explain(model)(*model.inputs(0))
    assert report.sites == [] and "shifted is not 0 at 0" in str(report), str(report)
