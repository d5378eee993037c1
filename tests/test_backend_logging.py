"""What the nvfp4 backend says (compiler/backend.py): each site's decision and the compile
progress under ``TORCH_LOGS="nvfp4_inductor"`` (torch's switch for a package's loggers),
detail under ``"+nvfp4_inductor"``, nothing without it; and one warning for a compiled
graph where a grouped MLP was left as written, none for a model without one, none from
the inspection tools (they report rejections themselves)."""

import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import nvfp4_inductor as nv
from moe_models import ExpertLoop, GroupedMM, SwiGLUMLP

ROOT = pathlib.Path(__file__).resolve().parent.parent

# One srelu grouped MLP (rewritten) and one gelu one (left as written: no NVFP4 rule)
SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.nn as nn
    import nvfp4_inductor as nv
    from moe_models import GroupedMM

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = GroupedMM("srelu_pow"), GroupedMM("gelu")

        def forward(self, x, offs):
            return self.first(x, offs), self.second(x, offs)

    torch.manual_seed(0)
    model = Two()
    x, offs, _ = model.first.inputs(0)
    compiled = torch.compile(model, backend=nv.backend(compiler="aot_eager"))
    sum(y.float().sum() for y in compiled(x.requires_grad_(), offs)).backward()
    print("done")
""")


def _run(torch_logs):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    env.pop("TORCH_LOGS", None)
    if torch_logs is not None:
        env["TORCH_LOGS"] = torch_logs
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def _lines(text, mark="nvfp4: "):
    return [line.split(mark, 1)[1] for line in text.splitlines() if mark in line]


def test_torch_logs_prints_each_sites_decision_and_the_compile():
    out, err = _run("nvfp4_inductor")
    assert out == "done\n"
    logged = _lines(err)
    rewrote = [line for line in logged if line.startswith("rewrote grouped_mm at ")]
    left = [line for line in logged if line.startswith("left grouped_mm at ")]
    assert len(rewrote) == 1 and "(srelu, 4 experts, H=32, F=32): target reference" in rewrote[0], logged
    assert len(left) == 1 and left[0].endswith("as written: activation {gelu} is not srelu, tanh_srelu or swiglu")
    assert "1 of 2 grouped MLP(s) in this graph rewritten to NVFP4" in logged
    assert "compiling 1 grouped MLP(s) through AOTAutograd and aot_eager" in logged
    assert any(line.startswith("AOTAutograd traced the graph in ") for line in logged), logged
    assert not any(line.startswith(("backend options", "the rewritten graph")) for line in logged)  # DEBUG only


def test_plus_torch_logs_adds_the_options_plans_and_rewritten_graph():
    _, err = _run("+nvfp4_inductor")
    logged = _lines(err)
    assert any(line.startswith("backend options BackendOptions(") for line in logged), logged
    assert any(line.startswith("plan for ") and "reference on cpu" in line for line in logged), logged
    assert "the rewritten graph:" in logged and "fused_grouped_mlp" in err


def test_without_torch_logs_only_the_rejection_warning_is_printed():
    out, err = _run(None)
    assert out == "done\n"
    lines = err.splitlines()
    said = [i for i, line in enumerate(lines) if "nvfp4" in line]  # torch may warn of its own things
    assert len(said) == 1 and "UserWarning: nvfp4 backend: 1 of 2 grouped MLP(s)" in lines[said[0]], err
    assert not _lines(err)


def _nvfp4_warnings(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("nvfp4 backend: ")]


def _compile_and_run(model, *args):
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend=nv.backend(compiler="aot_eager"))(*args)
    return _nvfp4_warnings(caught)


class _Two(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x, offs):
        return self.first(x, offs), self.second(x, offs)


def test_one_warning_names_the_count_and_the_first_reason():
    model = _Two(GroupedMM("srelu_pow"), GroupedMM("gelu"))
    x, offs, _ = model.first.inputs(0)
    (message,) = _compile_and_run(model, x, offs)
    assert message.startswith("nvfp4 backend: 1 of 2 grouped MLP(s) in a compiled graph rewritten to NVFP4; "
                              "the other 1 run as written. grouped_mm at ")
    assert "activation {gelu} is not srelu, tanh_srelu or swiglu" in message and "nvfp4_inductor.explain" in message


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_grouped_mlps_in_fp16_or_fp32_without_autocast_warn_once(dtype):
    model = _Two(ExpertLoop(dtype=dtype), ExpertLoop(dtype=dtype))
    x, counts, _ = model.first.inputs(0)
    (message,) = _compile_and_run(model, x, counts)
    assert "0 of 2 grouped MLP(s)" in message and f"x is {dtype}; the fused grouped MLP takes" in message


def test_no_warning_for_a_model_without_grouped_mlps_nor_for_one_fully_rewritten():
    assert _compile_and_run(SwiGLUMLP(), torch.randn(8, 32, dtype=torch.bfloat16)) == []
    model = GroupedMM("srelu_pow")
    assert _compile_and_run(model, *model.inputs(0)[:2]) == []


def test_explain_and_compare_report_rejections_without_the_warning():
    model = GroupedMM("gelu")
    args = model.inputs(0)[:2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = nv.explain(model)(*args)
        verdict = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(*args)
    assert report.rejected and "NO VERDICT" in str(verdict)
    assert _nvfp4_warnings(caught) == []


def test_traced_kernels_counts_launches_and_distinct_kernels():
    """What the Inductor compile's progress line counts, on a graph of traced launches as
    AOTAutograd gives it to Inductor (the CPU traces none: built by hand)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional

    from nvfp4_inductor.compiler.backend import traced_kernels
    from nvfp4_inductor.kernels import activation, dequantize

    graph = torch.fx.Graph()
    for kernel in (activation._act_fwd_kernel, dequantize._dequantize_kernel, activation._act_fwd_kernel):
        graph.call_function(triton_kernel_wrapper_functional,
                            kwargs={"kernel_idx": kernel_side_table.add_kernel(kernel), "constant_args_idx": 0,
                                    "grid": [(1, 1, 1)], "tma_descriptor_metadata": {}, "kwargs": {},
                                    "tensors_to_clone": []})
    graph.output(None)
    assert traced_kernels(torch.fx.GraphModule(torch.nn.Module(), graph)) == (
        3, {"_act_fwd_kernel", "_dequantize_kernel"})


@pytest.mark.parametrize("family, warned", [("qwen3_moe", False), ("gpt_oss", True)])
def test_a_transformers_model_warns_only_where_its_experts_are_left(family, warned):
    """Qwen3-MoE's experts are rewritten: no warning. GPT-OSS's clamped SwiGLU has no NVFP4
    rule: its model trains as written, and says so once."""
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    import library_models as lib

    model = lib.Logits(lib.tiny_causal_lm(family)).train()
    messages = _compile_and_run(model, lib.input_ids())
    if warned:
        (message,) = messages
        assert message.startswith("nvfp4 backend: 0 of 1 grouped MLP(s)") and "modeling_gpt_oss.py" in message
        assert "is not srelu, tanh_srelu or swiglu" in message
    else:
        assert messages == []
