"""The precision policy (``nv.Precision``): which grouped-MLP sites train in NVFP4, and with
which recipe, on tiny transformers models (Qwen3-MoE, Mixtral), a torchtitan-style model and
``GroupedMLP``; kept sites compile as stock torch.compile does, bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import nvfp4_inductor as nv
from nvfp4_inductor.compiler import backend as backend_mod
from nvfp4_inductor.compiler.precision import bf16_grouped_mlp

from library_models import any_tiny_causal_lm, input_ids
from moe_models import TitanMoE

pytest.importorskip("transformers")


class TitanLayers(nn.Module):
    """torchtitan's layout: ``layers`` a ModuleDict of blocks, each with its ``moe``."""

    def __init__(self, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): nn.ModuleDict({"moe": TitanMoE()}) for i in range(n)})

    def forward(self, x):
        for block in self.layers.values():
            x = x + block["moe"](x)
        return x


def _titan():
    model = TitanLayers(3)
    return model, model.layers["0"]["moe"].inputs(0), "layers.{}.moe.experts"


def _records(model, inputs, precision):
    """What the backend decided for each graph of one compiled forward and backward."""
    records = []
    original = backend_mod.rewrite_graph

    def spy(gm, options, site_call=None):
        records.append(original(gm, options, site_call))
        return records[-1]

    torch._dynamo.reset()
    backend_mod.rewrite_graph = spy
    try:
        out = torch.compile(model, backend=nv.backend(compiler="aot_eager", precision=precision))(*inputs)
    finally:
        backend_mod.rewrite_graph = original
    return records, out


def _paths(records):
    rewritten = [nv.compiler.precision.module_path(s) for r in records for s, _ in r.sites]
    kept = {nv.compiler.precision.module_path(s): d.rule for r in records for s, d in r.kept}
    return rewritten, kept


MODELS = {
    "qwen3_moe": lambda: (any_tiny_causal_lm("qwen3_moe", num_hidden_layers=3), (input_ids(),), "model.layers.{}.mlp.experts"),
    "mixtral": lambda: (any_tiny_causal_lm("mixtral", num_hidden_layers=3), (input_ids(),), "model.layers.{}.mlp.experts"),
    "torchtitan": lambda: _titan(),
}


RULES = {
    "none": (nv.Precision(), []),
    "last1": (nv.Precision(last_moe_layers_bf16=1), [2]),
    "first2": (nv.Precision(first_moe_layers_bf16=2), [0, 1]),
    "glob": (nv.Precision(bf16=("*layers.1.*",)), [1]),
    "predicate": (nv.Precision(keep_bf16=lambda site: site.layer == 0 or site.moe_layer == site.moe_layers - 1),
                  [0, 2]),
}


# every rule on the torchtitan-style model; on the transformers models (slower to compile)
# the two rules that read their module paths differently: a count from the end and a glob
@pytest.mark.parametrize("family, rule", [("torchtitan", rule) for rule in RULES]
                         + [(family, rule) for family in ("qwen3_moe", "mixtral") for rule in ("last1", "glob")])
def test_each_rule_keeps_the_expected_sites(family, rule):
    rule, kept_layers = RULES[rule]
    model, inputs, path = MODELS[family]()
    records, _ = _records(model, inputs, rule)
    rewritten, kept = _paths(records)
    assert sorted(kept) == [path.format(i) for i in kept_layers]
    assert sorted(rewritten) == [path.format(i) for i in range(3) if i not in kept_layers]


def test_moe_layers_counts_from_the_end_of_the_model_not_the_graph():
    model, inputs, path = MODELS["torchtitan"]()
    records, _ = _records(model, inputs, nv.Precision(last_moe_layers_bf16=1, moe_layers=4))
    assert _paths(records)[1] == {}  # layer 3 of 4 is not in this model: nothing kept
    records, _ = _records(model, inputs, nv.Precision(last_moe_layers_bf16=2, moe_layers=4))
    assert list(_paths(records)[1]) == [path.format(2)]


def test_a_rule_that_selects_nothing_warns_at_compile():
    model, inputs, _ = MODELS["torchtitan"]()
    for rule, words in [(nv.Precision(bf16=("model.layers.7.*",)), "glob 'model.layers.7.*'"),
                        (nv.Precision(recipes={"nowhere": nv.Recipe()}), "glob 'nowhere'"),
                        (nv.Precision(last_moe_layers_bf16=5), "last_moe_layers_bf16=5 (the graph has 3 MoE layers)")]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _records(model, inputs, rule)
        assert any(words in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.parametrize("bad, words", [
    (dict(bf16="model.*"), "Precision.bf16"),
    (dict(last_moe_layers_bf16=-1), "Precision.last_moe_layers_bf16"),
    (dict(recipes={"*": "no recipe"}), "Precision.recipes"),
    (dict(keep_bf16=3), "Precision.keep_bf16"),
])
def test_bad_policies_are_refused_naming_the_field(bad, words):
    with pytest.raises(ValueError, match=words):
        nv.Precision(**bad)
    with pytest.raises(ValueError, match="option 'precision'"):
        nv.backend(precision="last")


def _grads(model, inputs, fn):
    torch.manual_seed(1)
    out = fn(*inputs)
    loss = out.logits.float().square().mean() if hasattr(out, "logits") else out.float().square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    return [out.logits if hasattr(out, "logits") else out, *torch.autograd.grad(loss, params)]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_kept_sites_compile_as_stock_inductor_bit_for_bit():
    """Every site kept in BF16: the model's outputs and gradients are stock Inductor's bits."""
    model, inputs, _ = MODELS["torchtitan"]()
    torch._dynamo.reset()
    stock = _grads(model, inputs, torch.compile(model, backend="inductor"))
    torch._dynamo.reset()
    ours = _grads(model, inputs, torch.compile(model, backend=nv.backend(precision=nv.Precision(bf16=("*",)))))
    assert _same(stock, ours)
    assert counters["nvfp4"]["sites_kept_bf16"] >= 3


def test_a_recipe_override_is_the_one_the_site_runs():
    """Layer 1 without stochastic rounding: the forward is unchanged (it rounds to nearest),
    layer 1's expert weight gradients change, and the other layers' call the default recipe."""
    model, inputs, _ = MODELS["torchtitan"]()

    def run(precision):
        torch._dynamo.reset()
        fn = torch.compile(model, backend=nv.backend(compiler="aot_eager", precision=precision))
        return dict(zip(["out"] + [n for n, p in model.named_parameters()], _grads(model, inputs, fn)))

    default = run(nv.Precision())
    override = run(nv.Precision(recipes={"layers.1.*": nv.Recipe(stochastic_rounding=False)}))
    assert torch.equal(default["out"], override["out"])
    assert not torch.equal(default["layers.1.moe.experts.w2"], override["layers.1.moe.experts.w2"])
    records, _ = _records(model, inputs, nv.Precision(recipes={"layers.1.*": nv.Recipe(stochastic_rounding=False)}))
    rules = [d.rule for r in records for d in r.decisions]
    assert rules == ["default", "recipes glob 'layers.1.*'", "default"]


def test_a_kept_grouped_mlp_runs_its_block_in_bf16():
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(4, 32, 32, "swiglu")
    x = torch.randn(40, 32, dtype=torch.bfloat16)
    sizes = torch.tensor([10, 0, 20, 10])
    probs = torch.rand(40)
    expected = bf16_grouped_mlp(x, mlp.fc1_weight, mlp.fc2_weight, sizes, probs, activation="swiglu",
                                tanh_clamp_scale=None)
    records, out = _records(mlp, (x, sizes, probs), nv.Precision(bf16=("*",)))
    assert torch.equal(out, expected)
    assert len(records[0].kept) == 1 and records[0].sites == []


def test_the_final_phase_is_one_recompile_of_the_same_module():
    """Late in training, whole sites move to BF16: ``model.compile`` again with the new
    policy; the training loop keeps calling ``model(...)`` and recompiles once."""
    model, inputs, _ = MODELS["torchtitan"]()
    torch._dynamo.reset()
    model.compile(backend=nv.backend(compiler="aot_eager"))
    model(*inputs)
    model(*inputs)
    frames = counters["stats"]["unique_graphs"]
    model.compile(backend=nv.backend(compiler="aot_eager", precision=nv.Precision(bf16=("*",))))
    kept = counters["nvfp4"]["sites_kept_bf16"]
    model(*inputs)
    model(*inputs)
    assert counters["stats"]["unique_graphs"] == frames + 1
    assert counters["nvfp4"]["sites_kept_bf16"] == kept + 3


def test_explain_lists_kept_sites_and_each_sites_rule():
    model, inputs, _ = MODELS["torchtitan"]()
    policy = nv.Precision(last_moe_layers_bf16=1, recipes={"layers.0.*": nv.Recipe(stochastic_rounding=False)})
    report = nv.explain(model, backend=nv.backend(compiler="aot_eager", precision=policy))(*inputs)
    assert len(report.sites) == 2 and [(path, rule) for _, path, rule in report.kept] == [
        ("layers.2.moe.experts", "last_moe_layers_bf16=1")]
    assert [site.policy for site in report.sites] == ["recipes glob 'layers.0.*'", "default"]
    text = str(report)
    assert "2 grouped MLP(s) rewritten, 1 kept in BF16" in text and "kept in BF16 by the precision policy" in text
    assert "NVFP4 with the recipe of recipes glob 'layers.0.*'" in text
    assert "SR" not in report.sites[0].backward_steps[0][0] and "SR" in report.sites[1].backward_steps[0][0]
