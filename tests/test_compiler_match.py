"""Recognition and rewrite of grouped MLPs in Dynamo graphs (compiler/match_*.py, rewrite.py).

Each case captures the Dynamo graph of a tiny bf16 CPU model (tests/moe_models.py),
checks the Sites / Rejections found, rewrites the sites to a plain-PyTorch reference call
and checks the rewritten graph against the original graph on the same inputs; a subset
also runs forward + backward through AOTAutograd and checks that changing the routing
does not recompile.
"""

import dataclasses
import functools
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.debugging import aot_eager

import moe_models as mm
from nvfp4_inductor.compiler.rewrite import find_sites, rewrite_sites



def assert_bf16_close(got, expected):
    """Equal up to bf16 rounding of intermediates, relative to the tensor's largest value."""
    scale = expected.detach().float().abs().max().clamp_min(1.0)
    torch.testing.assert_close(got.detach().float() / scale, expected.detach().float() / scale,
                               atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- helpers


def reference_make_call(x, fc1_weight, fc2_weight, group_sizes, probs, *, activation, tanh_clamp_scale):
    """The canonical call in plain PyTorch: GEMM outputs in bf16, activation and prob in fp32."""
    offs = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    c = torch._grouped_mm(x, fc1_weight.transpose(-2, -1), offs=offs).float()
    if activation == "srelu":
        d = F.relu(c) ** 2
    elif activation == "tanh_srelu":
        d = (tanh_clamp_scale * torch.tanh(F.relu(c) / tanh_clamp_scale)) ** 2
    else:
        gate, up = c.chunk(2, dim=-1)
        d = F.silu(gate) * up
    if probs is not None:
        d = d * probs.float()[:, None]
    return torch._grouped_mm(d.bfloat16(), fc2_weight.transpose(-2, -1), offs=offs)


@dataclasses.dataclass
class Captured:
    gm: torch.fx.GraphModule
    inputs: list


def capture(model, args, fullgraph=True) -> list:
    """The Dynamo graphs of ``model(*args)`` and their real inputs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(Captured(gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=fullgraph)(*args)
    return graphs


def calls_of(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def check_rewrite(captured: Captured, exact: bool):
    """Rewrite every site; the rewritten graph must reproduce the original outputs."""
    gm, inputs = captured.gm, captured.inputs
    expected = gm(*inputs)
    sites, _ = find_sites(gm)
    before = set(gm.graph.nodes)
    rewrite_sites(gm, sites, make_call=reference_make_call)
    assert calls_of(gm, reference_make_call) == len(sites)
    for node in set(gm.graph.nodes) - before:
        assert isinstance(node.meta.get("val"), (torch.Tensor, torch.SymInt, int)), node.format_node()
    got = gm(*inputs)
    for g, e in zip(got, expected):
        if exact:
            torch.testing.assert_close(g, e, atol=0, rtol=0)
        else:
            assert_bf16_close(g, e)
    return sites


def rewriting_backend(records: list):
    """A backend: find + rewrite with the reference call, then AOTAutograd (eager kernels)."""

    def backend(gm, example_inputs):
        sites, rejections = find_sites(gm)
        records.append((sites, rejections))
        rewrite_sites(gm, sites, make_call=reference_make_call)
        return aot_eager(gm, example_inputs)

    return backend


def check_forward_backward(model, args):
    """Compiled-with-rewrite forward and gradients match eager."""
    records = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rewriting_backend(records), fullgraph=True)
    float_args = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    grads = {}
    for run in ("eager", "compiled"):
        model.zero_grad()
        leaves = [a.detach().clone().requires_grad_() for a in float_args]
        it = iter(leaves)
        call_args = [next(it) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        out = (model if run == "eager" else compiled)(*call_args)
        out.backward(torch.ones_like(out))
        grads[run] = (out.detach(), [leaf.grad for leaf in leaves] + [p.grad for p in model.parameters()])
    assert sum(len(s) for s, _ in records) >= 1
    (out_e, g_e), (out_c, g_c) = grads["eager"], grads["compiled"]
    assert_bf16_close(out_c, out_e)
    for a, b in zip(g_c, g_e):
        if b is None:
            assert a is None
        else:
            assert_bf16_close(a, b)
    return records


@pytest.fixture(autouse=True)
def _dynamo_config():
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: object          # () -> model
    spelling: str
    activation: str
    probs: bool
    exact: bool = False   # the user's model does the same math in the same order

    def __str__(self):
        return self.name


PROBS = (None, "act", "out")


def _spelling_cases():
    cases = []
    for act, (_, activation, _) in mm.ACTIVATIONS.items():
        for prob in PROBS:
            # exact: srelu without a prob rounds once, like the reference; swiglu and the
            # prob products round the user's intermediate bf16 values as well
            exact = prob is None and activation == "srelu"
            cases.append(Case(f"grouped_mm-{act}-{prob}", functools.partial(mm.GroupedMM, act, prob),
                              "grouped_mm", activation, prob is not None, exact))
            cases.append(Case(f"expert_loop-{act}-{prob}", functools.partial(mm.ExpertLoop, act, prob),
                              "expert_loop", activation, prob is not None))
            cases.append(Case(f"bmm-{act}-{prob}", functools.partial(mm.BMM, act, prob),
                              "bmm", activation, prob is not None))
    for layout in ("out_in", "in_out"):
        cases.append(Case(f"grouped_mm-functional-{layout}",
                          functools.partial(mm.GroupedMM, "swiglu_chunk", "act", layout, True),
                          "grouped_mm", "swiglu", True))
    for weights in ("modulelist", "matmul_t", "matmul"):
        for act in ("srelu_pow", "swiglu_slice"):
            cases.append(Case(f"expert_loop-{weights}-{act}",
                              functools.partial(mm.ExpertLoop, act, "out", weights),
                              "expert_loop", mm.ACTIVATIONS[act][1], True))
    cases.append(Case("expert_loop-tolist", functools.partial(mm.ExpertLoop, "tanh_srelu", "act", sizes="tolist"),
                      "expert_loop", "tanh_srelu", True))
    for act in ("srelu_square_method", "tanh_srelu", "swiglu_split"):
        cases.append(Case(f"token_permutation-hf-{act}", lambda act=act: mm.SparseMoeBlock(mm.HFGroupedMMExperts(act)),
                          "token_permutation", mm.ACTIVATIONS[act][1], True))
    cases.append(Case("token_permutation-hf-bincount",
                      lambda: mm.SparseMoeBlock(mm.HFGroupedMMExperts("swiglu_chunk", counts="bincount")),
                      "token_permutation", "swiglu", True))
    cases.append(Case("real-qwen3_moe-grouped_mm", lambda: mm.SparseMoeBlock(mm.HFGroupedMMExperts(), shared=True),
                      "token_permutation", "swiglu", True))
    cases.append(Case("real-torchtitan-moe", mm.TitanMoE, "token_permutation", "swiglu", True))
    cases.append(Case("real-llama4-text-experts", mm.Llama4TextExperts, "bmm", "swiglu", False))
    return cases


SPELLING_CASES = _spelling_cases()


@pytest.mark.parametrize("case", SPELLING_CASES, ids=str)
def test_recognised_and_rewritten(case):
    torch.manual_seed(0)
    model = case.make()
    graphs = capture(model, model.inputs(0))
    assert len(graphs) == 1
    sites, rejections = find_sites(graphs[0].gm)
    assert rejections == []
    assert [(s.spelling, s.activation, s.probs is not None) for s in sites] == \
        [(case.spelling, case.activation, case.probs)]
    assert sites[0].location
    check_rewrite(graphs[0], case.exact)


def test_site_operands_torchtitan():
    """Separate gate (w1) and up (w3) GEMMs become one fc1 weight; gathered x, histc offsets."""
    model = mm.TitanMoE()
    (captured,) = capture(model, model.inputs(0))
    (site,), _ = find_sites(captured.gm)
    assert site.fc1_up_weight is not None and site.group_sizes.kind == "offsets"
    assert site.fc1_weight.layout == site.fc2_weight.layout == "out_in"
    assert "experts" in site.location


def test_two_moe_layers_with_shared_expert_and_attention():
    model = mm.TwoLayerModel()
    (captured,) = capture(model, model.inputs(0))
    before = {n.target for n in captured.gm.graph.nodes if n.op == "call_function"}
    sites = check_rewrite(captured, exact=False)
    assert [(s.spelling, s.activation) for s in sites] == [("token_permutation", "swiglu"),
                                                           ("token_permutation", "srelu")]
    assert [s.location.split()[0] for s in sites] == ["L['self'].moe1.experts", "L['self'].moe2.experts"]
    after = {n.target for n in captured.gm.graph.nodes if n.op == "call_function"}
    # the grouped GEMMs and activations went into the two calls; attention, norms,
    # the router, the shared expert and the un-permute stay
    assert before - after == {torch._grouped_mm, torch.nn.functional.relu, operator.pow}
    assert {torch._C._nn.linear, torch.nn.functional.silu, torch.histc, torch.argsort} <= after


def test_rewrite_keeps_unrelated_ops():
    """Exactly the grouped-GEMM region is replaced: routing and un-permute nodes remain."""
    model = mm.SparseMoeBlock(mm.HFGroupedMMExperts(), shared=True)
    (captured,) = capture(model, model.inputs(0))
    routing = (torch.argsort, torch.histc, torch.cumsum, torch.topk, torch.softmax, F.softmax)
    kept_before = [n.name for n in captured.gm.graph.nodes if n.op == "call_function" and n.target in routing]
    check_rewrite(captured, exact=False)
    kept_after = [n.name for n in captured.gm.graph.nodes if n.op == "call_function" and n.target in routing]
    assert kept_after == kept_before
    methods = {n.target for n in captured.gm.graph.nodes if n.op == "call_method"}
    assert "index_add_" in methods and calls_of(captured.gm, torch._C._nn.linear) == 4  # router + shared


# ----------------------------------------------------------------------------- rejections


class ScaledInputLoop(mm.ExpertLoop):
    """The prob multiplied on the expert input rows before the loop."""

    def forward(self, x, counts, probs):
        return super().forward(x * probs[:, None], counts)

    def inputs(self, seed):
        x, counts, _ = super().inputs(seed)
        return x, counts, mm._probs(seed, mm.T)


REJECTIONS = [
    ("gelu", lambda: mm.GroupedMM("gelu"), "activation {gelu} is not srelu, tanh_srelu or swiglu"),
    ("gpt_oss_clamped_swiglu", lambda: mm.SparseMoeBlock(mm.GptOssExperts()), "fc1 output has a bias added"),
    ("prob_on_input_torchtitan", lambda: mm.TitanMoE(score_before_experts=True),
     "router prob multiplied on the expert input"),
    ("prob_on_input_loop", lambda: ScaledInputLoop("srelu_pow"), "router prob multiplied on the expert input"),
    ("fp32_loop", lambda: mm.ExpertLoop(dtype=torch.float32), "x is torch.float32; the fused grouped MLP takes torch.bfloat16"),
    ("fp32_bmm", lambda: mm.BMM().float(), "x is torch.float32"),
    ("H_not_multiple_of_16", lambda: mm.GroupedMM(hidden=40), "H = 40 is not a multiple of 16"),
    ("F_not_multiple_of_16", lambda: mm.ExpertLoop(ffn=24), "F = 24 is not a multiple of 16"),
    ("mismatched_experts", lambda: mm.ExpertLoop(fc2_experts=8), "fc2 weight stacks 8 experts but the loop runs over 4"),
    ("fc2_bias_loop", lambda: mm.ExpertLoop(weights="modulelist", fc2_bias=True), "expert 0: fc2 `y` has a bias"),
]


@pytest.mark.parametrize("name,make,reason", REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_rejected_with_reason(name, make, reason):
    torch.manual_seed(0)
    model = make()
    args = model.inputs(0)
    if name == "fp32_bmm":
        args = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
    (captured,) = capture(model, args)
    code_before = captured.gm.code
    sites, rejections = find_sites(captured.gm)
    assert sites == []
    assert len(rejections) == 1 and reason in rejections[0].reason, rejections
    assert rejections[0].location
    rewrite_sites(captured.gm, sites, make_call=reference_make_call)
    assert captured.gm.code == code_before


def test_grouped_mm_fc2_bias_rejected():
    model = mm.SparseMoeBlock(mm.HFGroupedMMExperts("srelu_pow", bias=True))
    (captured,) = capture(model, model.inputs(0))
    sites, rejections = find_sites(captured.gm)
    assert sites == [] and [r.reason for r in rejections] == ["fc1 output has a bias added (`gate_up_1`)"]


def test_hf_batched_mm_rejected():
    """Hugging Face's per-token ``batched_mm`` experts: each token is its own bmm group."""

    class BatchedMM(mm.HFGroupedMMExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            expert_ids = top_k_index.reshape(-1)
            token_idx = torch.arange(hidden_states.size(0)).unsqueeze(1).expand(-1, top_k_index.size(-1)).reshape(-1)
            current = hidden_states[token_idx]
            gate_up = torch.bmm(self.gate_up_proj[expert_ids], current.unsqueeze(-1)).squeeze(-1)
            out = torch.bmm(self.down_proj[expert_ids], self.act(gate_up).unsqueeze(-1)).squeeze(-1)
            out = out * top_k_weights.reshape(-1).unsqueeze(-1)
            return torch.zeros_like(hidden_states).index_add(0, token_idx, out)

    model = mm.SparseMoeBlock(BatchedMM())
    (captured,) = capture(model, model.inputs(0))
    sites, rejections = find_sites(captured.gm)
    assert sites == [] and len(rejections) == 1 and "per-token" in rejections[0].reason


def test_graph_breaking_expert_loop_does_not_crash():
    """Mixtral's eager experts pick tokens with torch.where: Dynamo splits the graph."""
    model = mm.SparseMoeBlock(mm.MixtralEagerExperts())
    graphs = capture(model, model.inputs(0), fullgraph=False)
    assert len(graphs) > 1
    for captured in graphs:
        sites, rejections = find_sites(captured.gm)
        assert sites == []
        check_rewrite(captured, exact=True)


def test_a_concatenation_of_projections_is_no_candidate():
    """An attention's query input (DeepSeek-style MLA, transformers' axk2): one projection
    and its normalised copy concatenated along the last dim; not an expert loop, so not a
    rejection either."""

    class QueryInput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(mm.H, 16, bias=False, dtype=torch.bfloat16)
            self.norm = torch.nn.RMSNorm(16, dtype=torch.bfloat16)
            self.gate = torch.nn.Linear(32, mm.H, bias=False, dtype=torch.bfloat16)

        def forward(self, x):
            q = self.proj(self.gate(torch.cat([x, x], dim=-1)[:, :32]))
            return self.gate(torch.cat([self.norm(q), q], dim=-1))

    (captured,) = capture(QueryInput(), (torch.randn(16, mm.H, dtype=torch.bfloat16),))
    assert find_sites(captured.gm) == ([], [])


def test_an_expert_loop_concatenated_along_columns_is_rejected():
    """The same loop with every expert's output concatenated along dim -1: still a
    candidate, rejected with the reason."""

    class ColumnLoop(torch.nn.Module):
        def __init__(self, experts=2, f=32):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(experts, f, mm.H, dtype=torch.bfloat16))
            self.w2 = torch.nn.Parameter(torch.randn(experts, mm.H, f, dtype=torch.bfloat16))

        def forward(self, x):
            parts = torch.split(x, [8, 8])
            return torch.cat([F.linear(F.relu(F.linear(p, self.w1[e])) ** 2, self.w2[e]) for e, p in enumerate(parts)],
                             dim=-1)

    (captured,) = capture(ColumnLoop(), (torch.randn(16, mm.H, dtype=torch.bfloat16),))
    sites, rejections = find_sites(captured.gm)
    assert sites == [] and [r.reason for r in rejections] == ["experts concatenated along dim -1, expected dim 0"]


class Chained(torch.nn.Module):
    """Two grouped MLPs of one spelling, the first one's output the second one's input with
    no op between (its fc2 GEMM's output read by the second one's fc1 GEMM)."""

    def __init__(self, make):
        super().__init__()
        self.first, self.second = make(), make()

    def forward(self, x, *rest):
        return self.second(self.first(x, *rest), *rest)

    def inputs(self, seed):
        return self.first.inputs(seed)


CHAINED = [
    Case("grouped_mm", functools.partial(mm.GroupedMM, "srelu_pow"), "grouped_mm", "srelu", False, exact=True),
    Case("grouped_mm-swiglu-prob_on_act", functools.partial(mm.GroupedMM, "swiglu_chunk", "act"), "grouped_mm",
         "swiglu", True),
    Case("bmm", functools.partial(mm.BMM, "srelu_pow"), "bmm", "srelu", False),
]


@pytest.mark.parametrize("case", CHAINED, ids=str)
def test_chained_grouped_mlps_are_two_sites_and_no_candidate_between(case):
    """The first MLP's fc2 and the second's fc1 have no op between them for an activation, so
    that pair is no candidate (it was rejected as "activation {} is not srelu, ..."): two
    sites, no rejection, and the rewritten graph computes the original's outputs."""
    torch.manual_seed(0)
    model = Chained(case.make)
    (captured,) = capture(model, model.inputs(0))
    sites, rejections = find_sites(captured.gm)
    assert rejections == []
    assert [(s.spelling, s.activation, s.probs is not None, s.location.split()[0]) for s in sites] == [
        (case.spelling, case.activation, case.probs, f"L['self'].{name}") for name in ("first", "second")]
    check_rewrite(captured, case.exact)


class ThreeGemms(torch.nn.Module):
    """Three grouped GEMMs with a squared ReLU between each: the middle GEMM is both the
    fc2 of (first, middle) and the fc1 of (middle, last)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = (mm._param(mm.G, mm.H, mm.H) for _ in range(3))

    def forward(self, x, offs, probs=None):
        for w in (self.w1, self.w2):
            x = F.relu(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)) ** 2
        return torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)


def test_a_gemm_in_two_matches_is_rewritten_into_the_first_site_only():
    """Rewriting both overlapping matches made a graph that used a node before defining it
    (the backend crashed in ``graph.lint``); the first in graph order is kept, the other
    rejected with the reason, and the rewritten graph computes the original's output."""
    torch.manual_seed(0)
    model = ThreeGemms()
    (captured,) = capture(model, mm.GroupedMM().inputs(0))
    sites, rejections = find_sites(captured.gm)
    assert [(s.spelling, s.activation) for s in sites] == [("grouped_mm", "srelu")]
    assert [r.spelling for r in rejections] == ["grouped_mm"]
    assert "shares its GEMM" in rejections[0].reason and "which is rewritten instead" in rejections[0].reason
    check_rewrite(captured, exact=True)


def test_no_moe_no_sites():
    model = mm.SwiGLUMLP()
    (captured,) = capture(model, (torch.randn(16, mm.H, dtype=torch.bfloat16),))
    assert find_sites(captured.gm) == ([], [])


# ----------------------------------------------------------------------------- forward + backward, recompiles

FWD_BWD = [
    Case("grouped_mm-srelu-act", functools.partial(mm.GroupedMM, "srelu_pow", "act"), "grouped_mm", "srelu", True),
    Case("grouped_mm-swiglu-in_out-out", functools.partial(mm.GroupedMM, "swiglu_gate_second", "out", "in_out"),
         "grouped_mm", "swiglu", True),
    Case("expert_loop-modulelist", functools.partial(mm.ExpertLoop, "swiglu_chunk", "act", "modulelist"),
         "expert_loop", "swiglu", True),
    Case("expert_loop-tolist", functools.partial(mm.ExpertLoop, "srelu_mul", "out", sizes="tolist"),
         "expert_loop", "srelu", True),
    Case("bmm-tanh", functools.partial(mm.BMM, "tanh_srelu", "act"), "bmm", "tanh_srelu", True),
    Case("hf-qwen3-token_permutation", lambda: mm.SparseMoeBlock(mm.HFGroupedMMExperts(), shared=True),
         "token_permutation", "swiglu", True),
    Case("torchtitan", mm.TitanMoE, "token_permutation", "swiglu", True),
    Case("llama4-bmm", mm.Llama4TextExperts, "bmm", "swiglu", False),
]


@pytest.mark.parametrize("case", FWD_BWD, ids=str)
def test_forward_backward_through_rewrite(case):
    torch.manual_seed(0)
    model = case.make()
    records = check_forward_backward(model, model.inputs(0))
    assert [(s.spelling, s.activation) for s in records[0][0]] == [(case.spelling, case.activation)]


@pytest.mark.parametrize("case", [
    Case("grouped_mm", functools.partial(mm.GroupedMM, "swiglu_chunk", "act"), "grouped_mm", "swiglu", True),
    Case("token_permutation", lambda: mm.SparseMoeBlock(mm.HFGroupedMMExperts("srelu_pow")),
         "token_permutation", "srelu", True),
    Case("bmm", functools.partial(mm.BMM, "srelu_pow", "out"), "bmm", "srelu", True),
], ids=str)
def test_routing_change_does_not_recompile(case):
    torch.manual_seed(0)
    model = case.make()
    records = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rewriting_backend(records), fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            args = model.inputs(seed)
            assert_bf16_close(compiled(*args), model(*args))
    assert len(records) == 1 and len(records[0][0]) == 1


# ----------------------------------------------------------------------------- this package's op


def test_grouped_mlp_module_contract():
    """The node contract of nvfp4_inductor.nn.grouped_mlp_call: one call_function node with args
    (x, fc1_weight, fc2_weight, group_sizes, probs) and keyword activation /
    tanh_clamp_scale / recipe; built by hand, fake values from FakeTensorProp."""
    import nvfp4_inductor.nn as nv_nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    graph = torch.fx.Graph()
    x, w1, w2, sizes, probs = (graph.placeholder(n) for n in ("x", "w1", "w2", "sizes", "probs"))
    y = graph.call_function(nv_nn.grouped_mlp_call, (x, w1, w2, sizes, probs),
                            {"activation": "tanh_srelu", "tanh_clamp_scale": mm.TANH_S, "recipe": None})
    graph.output(graph.call_function(operator.add, (y, x)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = (mm._x(0, mm.T, mm.H), mm._param(mm.G, mm.FF, mm.H).data, mm._param(mm.G, mm.H, mm.FF).data,
              mm._sizes(0), mm._probs(0, mm.T))
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    sites, rejections = find_sites(gm)
    assert rejections == []
    assert [(s.spelling, s.activation, s.tanh_clamp_scale, s.probs is not None) for s in sites] == \
        [("grouped_mlp_module", "tanh_srelu", mm.TANH_S, True)]
    rewrite_sites(gm, sites, make_call=reference_make_call)
    assert calls_of(gm, nv_nn.grouped_mlp_call) == 0 and calls_of(gm, reference_make_call) == 1
    assert_bf16_close(gm(*inputs), reference_make_call(*inputs, activation="tanh_srelu",
                                                       tanh_clamp_scale=mm.TANH_S) + inputs[0])


def test_grouped_mlp_module_in_dynamo_graph():
    import nvfp4_inductor.nn as nv_nn

    module = nv_nn.GroupedMLP(mm.G, mm.H, mm.FF, activation="srelu")
    graphs = capture(module, (mm._x(0, mm.T, mm.H), mm._sizes(0)), fullgraph=True)
    assert sum(calls_of(c.gm, nv_nn.grouped_mlp_call) for c in graphs) == 1
    sites = [s for c in graphs for s in find_sites(c.gm)[0]]
    assert [(s.spelling, s.activation) for s in sites] == [("grouped_mlp_module", "srelu")]


def test_expert_loop_split_sizes_become_symbolic():
    """Python-list sizes: constants first, SymInt inputs after a recompile (automatic
    dynamic shapes); the rewrite builds group sizes from them with torch.tensor."""
    torch.manual_seed(0)
    model = mm.ExpertLoop("swiglu_chunk", "out", "modulelist")
    records = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rewriting_backend(records), fullgraph=True)
    for seed in range(3):
        args = model.inputs(seed)
        assert_bf16_close(compiled(*args), model(*args))
    kinds = [sites[0].group_sizes.kind for sites, _ in records]
    assert kinds[0] == "split" and all(k == "split" for k in kinds)
    assert any(isinstance(s, torch.fx.Node) for s in records[-1][0][0].group_sizes.source)


# ----------------------------------------------------------------------------- every transformers 5.x spelling

# non-gated experts exist from 5.4 on, expert-parallel sentinels from 5.6 on
RELEASE_CASES = [(r, act, ep) for r in mm.HF_RELEASES for act in ("silu", "relu2") for ep in (False, True)
                 if not (act == "relu2" and r in ("5.0", "5.2")) and not (ep and r in ("5.0", "5.2", "5.4"))]
# masks: (5.6, 5.8: after the prob; 5.17 and 5.18+ under EP: after fc1 and fc2)
RELEASE_MASKS = {"5.6": 1, "5.8": 1, "5.17": 2}


def _release_block(release, act, ep):
    experts = mm.HFExpertsRelease(release, act, ep=ep)
    return (mm.SentinelMoeBlock if ep else mm.SparseMoeBlock)(experts)


@pytest.mark.parametrize("release,act,ep", RELEASE_CASES, ids=[f"{r}-{a}-{'ep' if e else 'noep'}"
                                                              for r, a, e in RELEASE_CASES])
def test_every_transformers_release_spelling(release, act, ep):
    """One site per block whichever release's spelling; the sentinel masks are folded into
    the prob (the rewritten graph reproduces the original, sentinel rows included)."""
    torch.manual_seed(0)
    model = _release_block(release, act, ep)
    (captured,) = capture(model, model.inputs(0))
    sites, rejections = find_sites(captured.gm)
    assert rejections == []
    assert [(s.spelling, s.activation) for s in sites] == [("token_permutation", "swiglu" if act == "silu" else "srelu")]
    masks = RELEASE_MASKS.get(release, 2 if ep and release in ("5.18", "5.20") else 0)
    assert len(sites[0].row_masks) == masks
    check_rewrite(captured, exact=False)


# ----------------------------------------------------------------------------- row masks

MASK_CASES = [(w, f) for w in ("fc1", "d", "fc2", "out") for f in ("masked_fill", "where", "keep_where", "mul")] + [
    ("out_inplace", "masked_fill"), ("x", "masked_fill")]


@pytest.mark.parametrize("where,form", MASK_CASES, ids=[f"{w}-{f}" for w, f in MASK_CASES])
def test_row_masks_fold_into_the_prob(where, form):
    torch.manual_seed(0)
    model = mm.MaskedGroupedMM(where, form)
    (captured,) = capture(model, model.inputs(0))
    (site,), rejections = find_sites(captured.gm)
    assert rejections == [] and site.probs is not None
    assert len(site.row_masks) == (0 if where == "x" else 1)  # a mask on x stays in the graph
    rewritten = check_rewrite(captured, exact=False)
    assert calls_of(captured.gm, reference_make_call) == 1 and rewritten


@pytest.mark.parametrize("where", ["fc1", "out_inplace"])
def test_masked_rows_get_no_prob_gradient(where):
    """dprob of a masked row is 0 after the fold, as in the original graph; the other
    rows' gradients match it up to bf16 rounding."""
    torch.manual_seed(0)
    model = mm.MaskedGroupedMM(where, act="swiglu_chunk")
    x, offs, probs, mask = model.inputs(0)
    grads = []
    for backend in ("eager", rewriting_backend([])):
        p = probs.clone().requires_grad_()
        torch._dynamo.reset()
        fn = model if backend == "eager" else torch.compile(model, backend=backend)
        fn(x, offs, p, mask).float().pow(2).sum().backward()
        grads.append(p.grad)
    assert torch.equal(grads[1][mask], torch.zeros_like(grads[1][mask]))
    assert_bf16_close(grads[1], grads[0])


MASK_NEAR_MISSES = [
    ("fill_one", dict(where="fc1", form="fill_one"),
     "activation input `h_1` (masked_fill; it fills 1.0, a row mask fills 0) is not the output of the fc1"),
    ("clamp", dict(where="fc1", extra="clamp"), "activation input `h_1` (clamp) is not the output of the fc1"),
]


@pytest.mark.parametrize("name,kwargs,reason", MASK_NEAR_MISSES, ids=[m[0] for m in MASK_NEAR_MISSES])
def test_forms_that_are_not_row_masks_are_rejected(name, kwargs, reason):
    model = mm.MaskedGroupedMM(**kwargs)
    (captured,) = capture(model, model.inputs(0))
    sites, rejections = find_sites(captured.gm)
    assert sites == [] and len(rejections) == 1 and reason in rejections[0].reason, rejections


def test_post_expert_norm_ends_the_block():
    """A norm between fc2 and the prob (transformers' has_post_expert_norm) is not folded:
    the site ends at fc2's output (no prob; its mask becomes the prob), the norm and the
    prob stay in the graph, which computes the same function."""
    model = mm.MaskedGroupedMM("fc2", extra="norm")
    (captured,) = capture(model, model.inputs(0))
    (site,), rejections = find_sites(captured.gm)
    assert rejections == [] and len(site.row_masks) == 1 and site.probs is None
    check_rewrite(captured, exact=False)
    assert any(n.target == "rsqrt" or "rsqrt" in str(n.target) or "rms_norm" in str(n.target)
               for n in captured.gm.graph.nodes)


# ----------------------------------------------------------------------------- library ops


@torch.library.custom_op("nvfp4_test::moe_experts", mutates_args=())
def _opaque_moe_experts(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offs)


@_opaque_moe_experts.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


def test_library_op_hiding_experts_is_listed_with_reason():
    class Opaque(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mm._param(mm.G, mm.H, mm.H)

        def forward(self, x, offs):
            return torch.ops.nvfp4_test.moe_experts(x, self.w, offs)

    model = Opaque()
    x, offs, _ = mm.GroupedMM().inputs(0)
    (captured,) = capture(model, (x, offs))
    sites, rejections = find_sites(captured.gm)
    assert sites == [] and [(r.spelling, "`nvfp4_test::moe_experts` is a library's own op" in r.reason)
                            for r in rejections] == [("library_op", True)]
    assert "moe_models" not in rejections[0].location and "test_compiler_match.py" in rejections[0].location


# ----------------------------------------------------------------------------- torchtitan 0.3.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32_master_weights"])
def test_torchtitan_030_moe(dtype):
    """torchtitan 0.3.0: w1/w3 as two grouped GEMMs, scores in the combine; fp32 parameters
    are cast to bf16 by its own ``.bfloat16()`` calls, which stay in the graph."""
    torch.manual_seed(0)
    model = mm.TitanMoE030(dtype)
    (captured,) = capture(model, model.inputs(0))
    (site,), rejections = find_sites(captured.gm)
    assert rejections == [] and (site.spelling, site.activation) == ("token_permutation", "swiglu")
    assert site.fc1_up_weight is not None and site.probs is not None
    check_rewrite(captured, exact=False)
