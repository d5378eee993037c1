"""The real model libraries' MoE code (the installed transformers; torchtitan re-created in
moe_models.py), tiny configs on the CPU: every experts class found or rejected with its
reason according to the function it computes, compiled training steps (forward and
backward) bitwise equal to the eager NVFP4 chain, whole one-layer models in eval and in
training, fp32 master weights under bf16 autocast, near-misses listed by ``explain``.

Cost: the recognition scan traces each experts class once (~0.3 s each); the compiled
comparisons run with ``compiler="aot_eager"`` on one class per distinct experts form (the
other classes of a form run the same ``grouped_mm_experts_forward`` on the same activation
module; the scan checks each of them is recognised).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

import library_models as lib  # noqa: E402
import moe_models as mm  # noqa: E402
import nvfp4_inductor as nv  # noqa: E402
from nvfp4_inductor.compiler.rewrite import find_sites  # noqa: E402

CASES = lib.transformers_experts()


def _capture(model, args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*args)
    return graphs


def test_the_scan_finds_the_families_named_in_the_issue():
    families = {c.family for c in CASES}
    assert {"qwen3_moe", "mixtral", "olmoe", "nemotron_h", "gpt_oss", "deepseek_v3"} <= families, sorted(families)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_transformers_experts_follow_the_function(case):
    """Every grouped_mm experts class: one site when its activation computes SwiGLU or
    SReLU (found by evaluating it), else rejections that say why; never silence."""
    experts = lib.build_experts(case)
    expected = lib.expected_activation(experts)
    block = mm.SparseMoeBlock(experts)
    graphs = _capture(block, (mm._x(0, 32, mm.H),))
    found = [find_sites(gm) for gm in graphs]
    sites = [s for f in found for s in f[0]]
    rejections = [r for f in found for r in f[1]]
    if not case.grouped_mm:  # an eager loop over the hit experts: Dynamo breaks the graph
        assert sites == [] and len(graphs) > 1
    elif expected is not None:
        assert [s.activation for s in sites] == [expected] and rejections == [], rejections
        assert f"modeling_{case.family}.py" in sites[0].location or "moe_models.py" in sites[0].location
    else:
        assert sites == [] and rejections and all(r.reason for r in rejections)


def _forms():
    """One experts class per distinct form among the recognised ones."""
    forms = {}
    for case in CASES:
        try:
            experts = lib.build_experts(case)
        except RuntimeError:  # test_transformers_experts_follow_the_function reports it
            continue
        if lib.expected_activation(experts) is None or not case.grouped_mm:
            continue
        act = getattr(experts, "act_fn", None)
        key = (type(act).__name__ if isinstance(act, torch.nn.Module) else getattr(act, "__name__", None),
               getattr(experts, "has_gate", True), getattr(experts, "is_transposed", False),
               getattr(experts, "has_bias", False), getattr(experts, "has_post_expert_norm", False),
               type(experts)._apply_gate.__qualname__)
        forms.setdefault(key, case)
    return list(forms.values())


@pytest.mark.parametrize("case", _forms(), ids=str)
def test_transformers_experts_forms_compiled_equal_eager(case):
    experts = lib.build_experts(case)
    block = mm.SparseMoeBlock(experts)
    x = mm._x(0, 32, mm.H).requires_grad_()
    report = nv.compare(block, backend=nv.backend(compiler="aot_eager"))(x)
    assert report.bitwise, str(report)


FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_training_step(family):
    """One site per MoE layer, located in the model's file; forward + backward of the
    whole model bitwise equal to the eager NVFP4 chain (every parameter's gradient)."""
    model = lib.Logits(lib.tiny_causal_lm(family)).train()
    ids = lib.input_ids()
    report = nv.explain(model)(ids)
    assert [(s.spelling, s.activation) for s in report.sites] == [("token_permutation", "swiglu")], str(report)
    assert f"modeling_{family}.py:" in report.sites[0].location and report.rejected == []
    compared = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(ids)
    assert compared.bitwise and len(compared.rows) > 10, str(compared)


# The families whose whole CausalLM (a vision-language family's text decoder) any_tiny_causal_lm
# builds and runs (transformers 5.25.0: 70 of the 71 families with grouped_mm experts; inkling
# has no config in the mapping and keeps the experts-class tests above), eleven of them with
# experts that compute another activation.
WHOLE_MODELS = ("afmoe", "aria", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_ocr2",
                "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "dots3_note", "ernie4_5_moe", "ernie4_5_vl_moe",
                "exaone_moe", "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm_moe_dsa",
                "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3",
                "jamba", "kimi_linear", "kolibri1", "kolibri1_1", "laguna", "lara_mini", "lfm2_moe", "longcat_flash",
                "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2", "mistral4", "mistral_large4",
                "mixtral", "muse_spark", "nemotron_h", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe",
                "qwen3_next", "qwen3_omni_moe", "qwen3_vl_moe", "qwen4_exp", "solar_open", "step3p7", "unlimited_ocr",
                "zaya")
OTHER_ACTIVATION = ("deepseek_v4", "diffusion_gemma", "gemma4", "glm5_next", "gpt_oss", "hy_v4", "hy_v4_vl", "inkling2",
                    "inkling2_loop", "minimax_m3_vl", "openai_privacy_filter")
_MROPE = dict(rope_type="default", rope_theta=10000.0)  # multimodal rotary sections that fit head_dim 16
SETTINGS = {
    **dict.fromkeys(("axk2", "deepseek_v32", "glm_moe_dsa", "hy_v4", "hy_v4_vl", "mistral_large4"),
                    {"num_key_value_heads": 2}),  # their indexers
    "deepseek_ocr2": dict(mlp_layer_types=["sparse", "sparse"]),  # its default is None, not a list
    # hyper-connections' Sinkhorn normalisation: 2 of its 20 default iterations (each one unrolled by
    # Dynamo, a minute of tracing in all; the loop and the experts are unchanged)
    "deepseek_v4": dict(hc_sinkhorn_iters=2),
    "glm5_next": dict(num_key_value_heads=2, hc_sinkhorn_iters=2),
    # sizes kept per layer (the config made anew, library_models._remade): the kwargs that fill them in
    **dict.fromkeys(("diffusion_gemma", "gemma4"), dict(global_head_dim=16, enable_moe_block=True, top_k_experts=2,
                                                       hidden_size_per_layer_input=16, vocab_size_per_layer_input=64)),
    "dots3_note": dict(num_key_value_heads=2, swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=16,
                       swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=12, swa_v_head_dim=16, index_topk=8,
                       index_head_dim=16, index_n_heads=2, shared_experts_intermediate_size=32),
    "ernie4_5_vl_moe": dict(rope_parameters=dict(_MROPE, mrope_section=[3, 3, 2])),
    "glm4v_moe": dict(rope_parameters=dict(_MROPE, partial_rotary_factor=0.5, mrope_section=[2, 1, 1])),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=4, mamba_d_head=16),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["full_attention", "conv"]),
    "longcat_flash": dict(num_layers=2, qk_head_dim=16),  # its own layer count; MLA's q head: nope + rope
    "mistral4": dict(head_dim=16, qk_head_dim=16),  # MLA with half the head rotated: head_dim twice the rope's
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                      indexer_compress_ratio=4, linear_num_key_heads=2, linear_num_value_heads=2,
                      linear_key_head_dim=16, linear_value_head_dim=16),
    "step3p7": dict(sliding_window=8),
}


@pytest.mark.parametrize("family", WHOLE_MODELS + OTHER_ACTIVATION)
def test_every_moe_layer_of_a_whole_model_is_rewritten_or_rejected(family):
    """Whole two-layer models of every family the generic tiny config fits (their routers,
    shared experts, attention kinds as the family has them): explain finds one site per
    MoE layer the forward runs, or, where the experts compute another activation, one
    rejection with the activation found; never a layer left unreported."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    model = lib.any_tiny_causal_lm(family, **SETTINGS.get(family, {})).train()
    layers = lib.experts_called(model, lib.input_ids())
    report = nv.explain(lib.Logits(model))(lib.input_ids())
    assert layers >= 1, "no experts layer built"  # 1 where the family's first layer stays dense
    if family in OTHER_ACTIVATION:
        assert report.sites == [] and len(report.rejected) == layers, str(report)
        assert all("is not srelu, tanh_srelu or swiglu" in reason for *_, reason in report.rejected), str(report)
    else:
        assert len(report.sites) == layers and report.rejected == [], str(report)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next", "nemotron_h", "qwen3_vl_moe", "lfm2_moe"])
def test_whole_model_of_another_design_is_bitwise(family):
    """Whole models of five other designs, compared: DeepSeek-V3 (sigmoid group-limited
    router, shared experts, MLA), Qwen3-Next (linear attention layers, a gated shared
    expert), Nemotron-H (Mamba layers, SReLU experts), Qwen3-VL-MoE's text decoder
    (multimodal rotary sections) and LFM2-MoE (short-convolution layers, an expert bias in
    the router): every output and gradient bitwise equal to the eager NVFP4 chain."""
    model = lib.Logits(lib.any_tiny_causal_lm(family, **SETTINGS.get(family, {})).train())
    compared = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(lib.input_ids())
    assert compared.bitwise and compared.sites == lib.experts_layers(model), str(compared)


@pytest.mark.parametrize("family", FAMILIES[:1])
def test_whole_model_eval(family):
    model = lib.Logits(lib.tiny_causal_lm(family)).eval()
    ids = lib.input_ids()
    with torch.no_grad():
        assert len(nv.explain(model)(ids).sites) == 1
        compared = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(ids)
    assert compared.bitwise and len(compared.rows) == 1, str(compared)


def test_gradient_checkpointing():
    """``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable()``, its
    deprecated name, where the installed transformers lacks it): each decoder layer runs under
    torch.utils.checkpoint, and the site is rewritten inside the checkpointed region. Where
    the layer changes Python state outside it (transformers' hub-kernel decorators set a
    context variable), Dynamo leaves the region out of the graph: explain lists that break
    with the fix, and with the fix the site is rewritten, bitwise the eager NVFP4 chain."""
    model = lib.tiny_causal_lm("qwen3_moe").train()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.config.use_cache = False  # else a warning is logged at every step: a graph break
    model, ids = lib.Logits(model), lib.input_ids()
    report = nv.explain(model)(ids)
    if not report.sites:
        assert any("skip_fwd_side_effects_in_bwd_under_checkpoint" in b.fix for b in report.graph_breaks), str(report)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        report = nv.explain(model)(ids)
        compared = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(ids)
    assert [s.checkpointed for s in report.sites] == [True], str(report)
    assert compared.bitwise and compared.sites == 1, str(compared)


def test_fp32_master_weights_under_bf16_autocast():
    """fp32 parameters, bf16 autocast around the step (the usual mixed precision): the
    experts run through transformers' own fallback op in fp32; the site is rewritten on
    bf16 casts, and the fp32 weights get fp32 gradients through the casts."""
    model = lib.Logits(lib.tiny_causal_lm("qwen3_moe", dtype=torch.float32)).train()
    ids = lib.input_ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = nv.explain(model)(ids)
        compared = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(ids)
    assert [s.activation for s in report.sites] == ["swiglu"] and report.rejected == [], str(report)
    assert compared.bitwise, str(compared)
    experts = model.model.model.layers[0].mlp.experts
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(model, backend=nv.backend(compiler="aot_eager"))(ids).float().pow(2).mean().backward()
    assert experts.gate_up_proj.grad.dtype == torch.float32 and experts.gate_up_proj.grad.abs().sum() > 0


def test_autocast_inside_the_compiled_function():
    """``with torch.autocast`` inside the compiled code: Dynamo records it as graph nodes."""
    model = lib.tiny_causal_lm("mixtral", dtype=torch.float32).train()

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(input_ids=ids).logits

    ids = lib.input_ids()
    assert len(nv.explain(Step())(ids).sites) == 1
    compared = nv.compare(Step(), backend=nv.backend(compiler="aot_eager"))(ids)
    assert compared.bitwise, str(compared)


def test_fp32_model_lists_every_skipped_candidate_with_its_reason():
    """No autocast, fp32 weights: transformers routes the experts through its own op; the
    candidate is listed with the rule and the value, at the model file's line."""
    model = lib.Logits(lib.tiny_causal_lm("qwen3_moe", dtype=torch.float32))
    report = nv.explain(model)(lib.input_ids())
    assert report.sites == [] and len(report.rejected) == 1, str(report)
    location, spelling, reason = report.rejected[0]
    assert "x is torch.float32" in reason and "no torch.autocast is in force" in reason
    assert "modeling_qwen3_moe.py:" in location and "functional.py" not in location


def test_gpt_oss_is_a_near_miss_with_its_reason():
    model = lib.Logits(lib.tiny_causal_lm("gpt_oss"))
    report = nv.explain(model)(lib.input_ids())
    assert report.sites == [] and report.rejected, str(report)
    assert any("modeling_gpt_oss.py" in loc and "is not srelu, tanh_srelu or swiglu" in reason
               for loc, _, reason in report.rejected), str(report)


def test_eager_experts_loop_is_reported_not_crashed():
    """``experts_implementation="eager"``: a loop over the hit experts (data-dependent):
    Dynamo breaks the graph; explain says so."""
    model = lib.Logits(lib.tiny_causal_lm("olmoe", experts_implementation="eager"))
    report = nv.explain(model)(lib.input_ids())
    assert report.sites == [] and report.graph_breaks, str(report)


def test_batched_mm_is_rejected_with_its_reason():
    model = lib.Logits(lib.tiny_causal_lm("qwen3_moe", experts_implementation="batched_mm"))
    report = nv.explain(model)(lib.input_ids())
    assert report.sites == [] and any("per-token" in reason for *_, reason in report.rejected), str(report)


def test_fp32_master_weights_under_bf16_autocast_with_inductor():
    """The same step with Inductor's code generation on both sides (the ops around the
    expert block compiled by stock Inductor in the eager-semantics run too)."""
    model = lib.Logits(lib.tiny_causal_lm("qwen3_moe", dtype=torch.float32)).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compared = nv.compare(model)(lib.input_ids())  # scope="blocks", compiler="inductor": the defaults
    assert compared.bitwise, str(compared)
