"""nvfp4_inductor.inspection as a user meets it: ``compare``'s verdicts on tiny transformers
MoE models and our own spellings, no verdict when nothing was rewritten, graph breaks
grouped with their fix, ulps across zero, ``dump_code``'s folder and keyword arguments,
the model's arguments kept apart from the tools' options, reports that print their
summary and collapse what repeats, ``dump_code``'s files the same whatever the caches
hold, and no global side effects (code compiled before still runs without recompiling).

Everything compiles with ``compiler="aot_eager"`` (the same rewrite and partition as
Inductor without its code generation); tests/test_backend.py holds the Inductor cases.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import nvfp4_inductor as nv
from compile_caches import with_graph_caches
from moe_models import G, H, HFGroupedMMExperts, MixtralEagerExperts, SparseMoeBlock
from nvfp4_inductor.compiler.options import BackendOptions
from nvfp4_inductor.inspection import CompareReport, CompareRow, _compare_tensors, ulps

FAST = dict(backend=nv.backend(compiler="aot_eager"))
COMMON = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128)
# transformers 5.24 families whose experts run as grouped_mm (config class, model class, MoE fields)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                        num_experts_per_tok=2, layer_types=["full_attention"])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                      first_k_dense_replace=0, n_group=1, topk_group=1)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(moe_intermediate_size=32, moe_num_experts=4, moe_k=2, moe_layer_start_index=0)),
    # not in the test matrix, compared BITWISE EQUAL by hand with transformers 5.24 on 2026-12-01:
    # dots1 (as deepseek_v3), olmoe (as qwen3_moe)
    # GPT-OSS: clamped SwiGLU with alpha and (up + 1), not one of ours -> rejected, 0 sites
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16)),
}
REJECTED = {"gpt_oss"}


def tiny_model(family: str, experts: str = "grouped_mm"):
    """A one-layer bf16 transformers model of `family` built from its config (no download),
    its experts run as `experts` ("grouped_mm" or "eager"), and a batch of token ids."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (the test extra)")
    config_class, model_class, moe = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **moe)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(torch.bfloat16)
    model.set_experts_implementation(experts)
    return model, torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------
# compare: the default answers "are the rewritten blocks exactly the eager NVFP4 chain?"


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - REJECTED))
def test_default_compare_is_bitwise_equal_on_transformers_models(family):
    model, ids = tiny_model(family)
    report = nv.compare(model, **FAST)(ids)
    assert report.sites == 1 and report.bitwise is True, str(report)
    assert str(report).startswith("nvfp4 compare, scope='blocks': 1 grouped MLP block(s)")
    assert any("experts" in r.name for r in report.rows)  # the experts' weights got gradients and were compared


@pytest.mark.parametrize("family", sorted(REJECTED))
def test_compare_gives_no_verdict_when_nothing_was_rewritten(family):
    model, ids = tiny_model(family)
    report = nv.compare(model, **FAST)(ids)
    assert report.sites == 0 and report.rejected == 1 and report.bitwise is None and report.rows == []
    assert "NO VERDICT" in str(report) and "EQUAL" not in str(report) and "DIFFERENT" not in str(report)
    assert "1 grouped-MLP candidate(s) rejected" in str(report) and "candidate was seen" not in str(report)


def test_no_candidate_is_said_plainly_by_compare_and_explain():
    report = nv.compare(lambda t: (t * 2).sin(), **FAST)(torch.randn(8, requires_grad=True))
    assert report.bitwise is None and report.verdict == "NO VERDICT" and report.graphs == 1
    assert "no grouped-MLP candidate was seen in the 1 graph(s)" in str(report), str(report)
    explained = str(nv.explain(lambda t: (t * 2).sin())(torch.randn(8)))
    assert "no grouped-MLP candidate was seen in the 1 graph(s)" in explained.splitlines()[1], explained


def test_program_scope_says_what_it_compared():
    mlp = nv.GroupedMLP(4, 32, 48, "srelu")
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    report = nv.compare(mlp, scope="program", **FAST)(x, torch.tensor([10, 0, 31, 23]))
    assert report.bitwise is True, str(report)
    assert str(report).startswith("nvfp4 compare, scope='program': eager PyTorch (the eager NVFP4 chain in "
                                  "1 grouped MLP block(s)) vs torch.compile(backend=nvfp4, compiler='aot_eager')")
    with pytest.raises(ValueError, match="scope"):
        nv.compare(mlp, scope="surroundings", **FAST)(x, torch.tensor([10, 0, 31, 23]))


def test_different_report_explains_its_columns():
    row = _compare_tensors("grad arg0", torch.tensor([1.0, 0.002], dtype=torch.bfloat16),
                           torch.tensor([1.0, -0.0024], dtype=torch.bfloat16))
    text = str(CompareReport([row], "program", "inductor", sites=1, rejected=0, graphs=1))
    assert ": DIFFERENT\n" in text and "1/2" in text
    assert "ulps: |compiled - eager| in steps of the dtype" in text and "scope='blocks'" in text


# ---------------------------------------------------------------------------------------
# the model's arguments apart from the tools' options


class ToolNamedKeywords(torch.nn.Module):
    """A model whose forward takes keywords named as the tools' own options."""

    def __init__(self):
        super().__init__()
        self.mlp = nv.GroupedMLP(4, 32, 48, "swiglu")

    def forward(self, x, *, seed, scope, backend, path, deterministic):
        assert (seed, scope, path, deterministic) == (7, "experts", "mine", "yes")  # constants to Dynamo
        return self.mlp(x, backend)  # backend: the group sizes


def test_model_keywords_named_as_tool_options_reach_the_model(tmp_path):
    model = ToolNamedKeywords()
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    kwargs = dict(seed=7, scope="experts", backend=torch.tensor([10, 0, 31, 23]), path="mine", deterministic="yes")
    assert len(nv.explain(model, **FAST)(x, **kwargs).sites) == 1
    report = nv.compare(model, scope="program", seed=3, **FAST)(x, **kwargs)
    assert report.sites == 1 and report.bitwise and report.scope == "program", str(report)
    files = nv.dump_code(model, path=tmp_path / "dump", **FAST)(x, **kwargs)
    assert "fused_grouped_mlp" in (tmp_path / "dump" / "INDEX.txt").read_text() and len(files) > 1


@pytest.mark.parametrize("backend", ["inductor", nv.Recipe(), None])
def test_backend_must_be_nvfp4_or_a_configured_backend(backend):
    mlp = nv.GroupedMLP(4, 32, 48, "swiglu")
    for tool in (nv.explain, nv.compare, lambda fn, **kw: nv.dump_code(fn, path="unused", **kw)):
        with pytest.raises(ValueError, match='^backend must be "nvfp4" or what nvfp4_inductor.backend'):
            tool(mlp, backend=backend)


def test_backend_options_reach_the_tools():
    from nvfp4_inductor.inspection import backend_options

    assert backend_options("nvfp4") == BackendOptions()
    configured = nv.backend(recompute=False, compiler="aot_eager", reuse_weight_casts=True)
    assert backend_options(configured) == BackendOptions(recompute=False, compiler="aot_eager",
                                                         reuse_weight_casts=True)


# ---------------------------------------------------------------------------------------
# reports: the summary first, what repeats collapsed, everything on request


class Stack(torch.nn.Module):
    def __init__(self, layers: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(nv.GroupedMLP(4, 32, 32, "swiglu") for _ in range(layers))

    def forward(self, x, sizes):
        for layer in self.layers:
            x = layer(x, sizes)
        return x


def test_explain_collapses_sites_with_the_same_plan():
    torch.manual_seed(0)
    report = nv.explain(Stack())(torch.randn(64, 32, dtype=torch.bfloat16), torch.tensor([10, 0, 31, 23]))
    text, full = str(report), report.text(full=True)
    assert len(report.sites) == 3 and text.startswith("nvfp4 explain: 1 graph(s), 3 grouped MLP(s) rewritten")
    assert "\nsites 0-2 (same plan): " in text and text.count("forward step") == 1, text
    assert full.count("forward step") == 3 and all(f"\nsite {i}: " in full for i in range(3)), full
    assert text.index("sites 0-2") > text.index("saved for bwd")  # the table of sites before the details


def test_compare_summarises_the_equal_parameter_gradients():
    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    report = nv.compare(Stack(), **FAST)(x, torch.tensor([10, 0, 31, 23]))
    assert report.bitwise and len(report.rows) == 2 + 6, str(report)
    text, full = str(report), report.text(full=True)
    assert "grad param: 6 parameters  yes      0/36864" in text and "layers.0" not in text, text
    assert all(f"grad param layers.{i}.fc{j}_weight" in full for i in range(3) for j in (1, 2)), full
    assert "report.text(full=True) lists each" in text and "lists each" not in full


def test_compare_lists_each_parameter_gradient_that_differs():
    a, b = _bf16(1.0, 2.0), _bf16(1.0, 3.0)
    rows = [_compare_tensors("output 0", a, a), _compare_tensors("grad param w1", a, a),
            _compare_tensors("grad param w2", a, b), _compare_tensors("grad param w3", a, a)]
    text = str(CompareReport(rows, "blocks", "aot_eager", sites=1, rejected=0, graphs=1))
    rows = {line[:24].strip(): line[24:].split() for line in text.splitlines()[3:7]}
    assert text.splitlines()[0].endswith(": DIFFERENT") and rows["grad param w2"][:2] == ["NO", "1/2"], text
    assert rows["grad param: 2 parameters"][:2] == ["yes", "0/4"] and "w1" not in text, text


# ---------------------------------------------------------------------------------------
# ulps, max |diff| and relative difference


def _bf16(*values):
    return torch.tensor(values, dtype=torch.float64).to(torch.bfloat16)


def test_ulps_across_zero_is_the_difference_in_steps_of_the_larger_value():
    a, b = _bf16(0.002), _bf16(-0.0024)
    larger = b.double().abs()  # in [2**-9, 2**-8): bf16 steps of 2**-16 there
    expected = float((a.double() - b.double()).abs() / 2**-16)
    assert 2**-9 <= float(larger) < 2**-8 and float(ulps(a, b)) == expected and 280 < expected < 300
    # the representable values between them number ~30,000: the old "ulps"
    def ordered(t):
        i = int(t.view(torch.int16))
        return i if i >= 0 else -(i + 2**15)

    assert abs(ordered(a) - ordered(b)) > 30_000


@pytest.mark.parametrize("a, b, expected", [
    (1.0, 1.0 + 2**-7, 1.0),  # neighbours in bf16
    (1.0, 1.0 + 2**-6, 2.0),
    (-3.0, -3.0, 0.0),
    (0.0, -0.0, 0.0),  # bits differ, values do not
    (1.0, float("inf"), math.inf),
    (float("nan"), 1.0, math.inf),
], ids=["neighbours", "two-steps", "equal", "signed-zeros", "inf", "nan"])
def test_ulps_table(a, b, expected):
    assert float(ulps(_bf16(a), _bf16(b))) == expected


def test_ulps_below_the_smallest_normal_count_subnormal_steps():
    tiny = torch.finfo(torch.float32).tiny
    step = tiny * torch.finfo(torch.float32).eps  # the subnormal spacing
    a, b = torch.tensor([tiny / 4]), torch.tensor([tiny / 4 + 3 * step])
    assert float(ulps(a, b)) == 3.0


def test_compare_row_counts_differing_elements_and_relative_difference():
    a, b = _bf16(1.0, 2.0, 0.0, 4.0), _bf16(1.0, 2.0, -0.0, 3.0)
    row = _compare_tensors("t", a, b)
    assert (row.bitwise, row.differ, row.numel, row.max_abs) == (False, 2, 4, 1.0)
    assert row.rel == pytest.approx(1.0 / math.sqrt(1 + 4 + 16)) and row.max_ulps == 32.0  # 1 / 2**-5 at 4.0
    mismatch = _compare_tensors("t", a, a.float())
    assert not mismatch.bitwise and "bfloat16" in mismatch.note and "float32" in mismatch.note
    assert CompareRow("t", True, 0, 4, 0.0, 0.0, 0.0) == _compare_tensors("t", a, a.clone())


@pytest.mark.parametrize("deterministic", [True, False])
def test_compare_runs_both_sides_under_deterministic_algorithms_and_restores_the_mode(monkeypatch, deterministic):
    """On CUDA a scatter_add combine adds with atomics, so two runs of one program differ
    (seen on the H200); compare runs both sides in deterministic mode unless told not to,
    and leaves the caller's mode as it was."""
    from nvfp4_inductor import inspection

    modes, run = [], inspection._run

    def spy(*args, **kwargs):
        modes.append((torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled()))
        return run(*args, **kwargs)

    monkeypatch.setattr(inspection, "_run", spy)
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(G, H, H)
    x = torch.randn(48, H, dtype=torch.bfloat16, requires_grad=True)
    report = nv.compare(mlp, deterministic=deterministic, **FAST)(x, torch.tensor([10, 0, 22, 16]))
    assert report.bitwise, str(report)
    assert modes == [(deterministic, deterministic)] * 2
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(ValueError, match="^deterministic must be a bool"):
        nv.compare(mlp, deterministic="yes", **FAST)(x, torch.tensor([10, 0, 22, 16]))


# ---------------------------------------------------------------------------------------
# graph breaks: grouped, counted, with the fix where one is known


def test_graph_breaks_of_transformers_eager_experts_are_grouped_with_the_fix():
    model, ids = tiny_model("qwen3_moe", experts="eager")
    report = nv.explain(model)(ids)
    assert report.sites == [] and report.graph_breaks
    places = [(b.location, b.what) for b in report.graph_breaks]
    assert len(places) == len(set(places)), f"graph breaks not grouped: {places}"
    nonzero = next(b for b in report.graph_breaks if "nonzero" in b.what)
    assert nonzero.location.startswith("modeling_qwen3_moe.py:") and nonzero.times >= 1
    assert 'set_experts_implementation("grouped_mm")' in nonzero.fix
    text = str(report)
    assert "not recorded" not in text and 'set_experts_implementation("grouped_mm")' in text
    assert f"{sum(b.times for b in report.graph_breaks)} graph break(s) at {len(report.graph_breaks)} place(s)" in text


def test_several_graphs_without_a_recorded_break_are_not_passed_over():
    from nvfp4_inductor.inspection import ExplainReport

    assert "2 graphs, but Dynamo logged no graph break" in str(ExplainReport([], [], [], graphs=2))
    assert "logged no graph break" not in str(ExplainReport([], [], [], graphs=1))


def test_graph_break_on_bincount_suggests_histc():
    model = SparseMoeBlock(HFGroupedMMExperts("swiglu_chunk", counts="bincount"))
    report = nv.explain(model)(*model.inputs(0))
    bincount = [b for b in report.graph_breaks if "bincount" in b.what]
    assert bincount and "torch.histc" in bincount[0].fix, str(report)


# ---------------------------------------------------------------------------------------
# no global side effects: what the caller compiled stays compiled


class _CountingBackend:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _runs_without_recompiling(step, counting: _CountingBackend) -> bool:
    before, unique = counting.graphs, torch._dynamo.utils.counters["stats"]["unique_graphs"]
    step()
    return counting.graphs == before and torch._dynamo.utils.counters["stats"]["unique_graphs"] == unique


def test_inspection_keeps_the_callers_compiled_code(tmp_path):
    mlp = nv.GroupedMLP(4, 32, 48, "swiglu")
    args = (torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True), torch.tensor([10, 0, 31, 23]))
    counting = _CountingBackend()
    compiled = torch.compile(mlp, backend=counting)
    compiled(*args)
    assert counting.graphs == 1
    assert len(nv.explain(mlp)(*args).sites) == 1  # compiled afresh: the caller's entry did not answer
    assert _runs_without_recompiling(lambda: compiled(*args), counting)
    assert nv.compare(mlp, **FAST)(*args).bitwise
    assert nv.compare(compiled, **FAST)(*args).sites == 1  # a compiled module is unwrapped, not run as compiled
    nv.dump_code(mlp, path=tmp_path / "dump", **FAST)(*args)
    assert _runs_without_recompiling(lambda: compiled(*args), counting)


def test_inspection_keeps_compiled_code_after_graph_breaks():
    """Code after a graph break runs as frames of its own, on the caller's code objects."""
    model = MixtralEagerExperts()
    args = (torch.randn(32, H, dtype=torch.bfloat16), torch.randint(0, G, (32, 2)),
            torch.rand(32, 2, dtype=torch.bfloat16))
    counting = _CountingBackend()
    compiled = torch.compile(model, backend=counting)
    compiled(*args)
    assert counting.graphs > 1
    assert nv.explain(model)(*args).graph_breaks
    assert nv.compare(model, **FAST)(*args).bitwise is None
    assert _runs_without_recompiling(lambda: compiled(*args), counting)


def test_explain_sees_the_sites_after_the_caller_compiled_with_nvfp4():
    model, ids = tiny_model("mixtral")
    torch.compile(model, **FAST)(ids)
    report = nv.explain(model)(ids)
    assert len(report.sites) == 1 and report.sites[0].spelling == "token_permutation"
    # on the CPU the reference runs: its ops stay whole in the compiled graph, and explain says so
    assert not report.sites[0].traced
    assert "launches: one call per fused op (reference's steps are not traced here)" in str(report)


# ---------------------------------------------------------------------------------------
# dump_code: keyword arguments, a reused folder holds only the new dump, named op options


def _mlp_inputs():
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(4, 32, 48, "swiglu")
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    return mlp, x, torch.tensor([10, 0, 31, 23]), torch.rand(64, requires_grad=True)


def test_dump_code_reuses_its_folder_with_only_the_new_files(tmp_path):
    mlp, x, sizes, probs = _mlp_inputs()
    path = tmp_path / "dump"
    first = nv.dump_code(mlp, path=path, **FAST)(x, sizes, probs=probs)  # probs= reaches the model
    assert any("Backward_graph" in f.name for f in first)
    with torch.no_grad():  # no backward this time: the first dump's backward files must go
        second = nv.dump_code(mlp, path=path, **FAST)(x, sizes, probs=probs)
    on_disk = sorted(p for p in path.rglob("*") if p.is_file() and p.name != ".nvfp4_dump_code")
    assert on_disk == second and not any("Backward_graph" in f.name for f in second)


def test_dump_code_and_compare_leave_the_callers_gradients(tmp_path):
    """Both run a backward; neither adds to a gradient the caller has (mid-accumulation,
    say) nor leaves one where there was none, keyword arguments included."""
    mlp, x, sizes, probs = _mlp_inputs()
    mine = torch.full_like(mlp.fc1_weight, 0.5)
    mlp.fc1_weight.grad = mine
    nv.dump_code(mlp, path=tmp_path / "dump", **FAST)(x, sizes, probs=probs)
    report = nv.compare(mlp, **FAST)(x, sizes, probs=probs)
    assert report.bitwise and "grad arg probs" in [r.name for r in report.rows], str(report)  # keywords too
    assert mlp.fc1_weight.grad is mine and bool((mine == 0.5).all())
    assert mlp.fc2_weight.grad is None and x.grad is None and probs.grad is None


def test_dump_code_refuses_a_folder_it_did_not_write(tmp_path):
    mlp, x, sizes, probs = _mlp_inputs()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="did not write"):
        nv.dump_code(mlp, path=tmp_path, **FAST)(x, sizes, probs)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_dumped_graphs_name_the_fused_ops_options(tmp_path):
    mlp, x, sizes, probs = _mlp_inputs()
    files = nv.dump_code(mlp, path=tmp_path, **FAST)(x, sizes, probs)
    text = "\n".join(f.read_text(errors="replace") for f in files if f.suffix == ".py")
    for op in ("grouped_mlp_fwd", "grouped_mlp_bwd_fc2"):
        call = next(line for line in text.splitlines() if f"nvfp4.{op}.default(" in line)
        for option in ("activation = 'swiglu'", "tanh_clamp_scale = None", "rht = True", "sign_mask = 55272",
                       "stochastic_rounding = True", "recompute = True", "target = 'reference'", "fused_dgrad = False"):
            assert option in call, f"{option} not in {call}"


_DUMPS = """
import json, sys
import torch
import nvfp4_inductor as nv

torch.manual_seed(0)
mlp = nv.GroupedMLP(4, 32, 48, "swiglu")
x, sizes = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True), torch.tensor([10, 0, 31, 23])
if sys.argv[1] == "warm":  # fill Inductor's and AOTAutograd's caches with this program
    torch.compile(mlp, backend="nvfp4")(x, sizes).sum().backward()
names = []
for path in sys.argv[2:]:
    names.append([str(f.relative_to(path)) for f in nv.dump_code(mlp, path=path)(x, sizes)])
print(json.dumps(names))
"""


def test_dump_code_writes_the_same_files_whatever_the_caches_hold(tmp_path):
    """With warm caches, Inductor's and AOTAutograd's cache hits used to skip the steps whose
    graphs depyf writes (the rewritten graph, the AOT forward and backward): dump_code turns
    the caches off while it compiles. Once in a process that warmed the caches and then
    dumped twice, once in a new process on those caches (both with the caches the suite
    turns off on: compile_caches.py), with Dynamo's graph names renumbered."""
    env = with_graph_caches(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "cache")

    def dumps(*args):
        out = subprocess.run([sys.executable, "-c", _DUMPS, *args], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.splitlines()[-1])

    first, second = dumps("warm", str(tmp_path / "a"), str(tmp_path / "b"))
    [third] = dumps("cold", str(tmp_path / "c"))
    assert first == second == third, (first, second, third)
    for name in ("INDEX.txt", "__compiled_fn_1.nvfp4_rewritten.0.py", "__compiled_fn_1.Forward_graph.0.py",
                 "__compiled_fn_1.Backward_graph.0.py", "__compiled_fn_1.kernel_0.py"):
        assert name in first, first
    index = (tmp_path / "c" / "INDEX.txt").read_text()
    rewritten = (tmp_path / "c" / "__compiled_fn_1.nvfp4_rewritten.0.py").read_text().splitlines()
    line = next(int(entry.split(":")[1].split()[0]) for entry in index.splitlines()
                if entry.startswith("__compiled_fn_1.nvfp4_rewritten.0.py:"))
    assert "fused_grouped_mlp(" in rewritten[line - 1], (index, rewritten)
    for op in ("nvfp4::grouped_mlp_fwd", "nvfp4::grouped_mlp_bwd_fc2"):
        assert any(entry.startswith("__compiled_fn_1.kernel_") and entry.rstrip().endswith(op)
                   for entry in index.splitlines()), index
