"""compiler/launch_analysis.py: torch's analysis of a traced launch, once per distinct launch.

The key is checked against what torch's analysis reads (dtypes, not shapes; values of the
other arguments; symbolic sizes as one placeholder; a one-config Autotuner as its
function with the config's arguments); the block is checked to restore torch's function;
and a child process traces two stacked fused layers on fake CUDA tensors (as
test_traced_launches.py, Triton's front end with a stand-in SM90 driver) with and without
the block: the same launches with the same tensors copied for them, from one analysis per
distinct launch instead of several per launch per layer.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters
from torch._higher_order_ops import triton_kernel_wrap
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from nvfp4_inductor.compiler import launch_analysis
from nvfp4_inductor.compiler.launch_analysis import launch_key, launches_analysed_once

from test_traced_launches import ROOT, SM90_DRIVER

triton = pytest.importorskip("triton")


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: triton.language.constexpr):
    offsets = triton.language.arange(0, BLOCK)
    triton.language.store(y_ptr + offsets, triton.language.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


def _fake(*shape, dtype=torch.bfloat16):
    with FakeTensorMode():
        return torch.empty(*shape, dtype=dtype, device="cpu")


def test_the_key_holds_dtypes_constants_and_integer_specialisations_not_shapes():
    base = launch_key(_copy, dict(x_ptr=_fake(8), y_ptr=_fake(8), n=8, BLOCK=16), {})
    assert base == launch_key(_copy, dict(x_ptr=_fake(64, 2), y_ptr=_fake(3), n=8, BLOCK=16), {})
    from triton.runtime.jit import JITFunction

    jit = _copy if hasattr(_copy, "params") else JITFunction(_copy.fn)  # (the suite may run the interpreter)
    sized = launch_key(jit, dict(x_ptr=_fake(8), y_ptr=_fake(8), n=8, BLOCK=16), {})
    assert sized == launch_key(jit, dict(x_ptr=_fake(8), y_ptr=_fake(8), n=7, BLOCK=16), {})  # a size: not in the IR
    for n, why in ((32, "divisible by 16"), (1, "a constant"), (2**31, "i64"), (2**63, "u64")):
        assert sized != launch_key(jit, dict(x_ptr=_fake(8), y_ptr=_fake(8), n=n, BLOCK=16), {}), why
    assert sized != launch_key(jit, dict(x_ptr=_fake(8), y_ptr=_fake(8), n=8, BLOCK=32), {})  # a constexpr's value
    assert base != launch_key(_copy, dict(x_ptr=_fake(8, dtype=torch.float32), y_ptr=_fake(8), n=8, BLOCK=16), {})
    assert base != launch_key(_copy, dict(x_ptr=_fake(8), y_ptr=_fake(8), n=1, BLOCK=16), {})  # Triton specializes 1
    assert base != launch_key(_copy, dict(x_ptr=_fake(8), y_ptr=_fake(8), n=8, BLOCK=32), {})
    assert base != launch_key(_copy, dict(x_ptr=_fake(8), y_ptr=_fake(8), n=True, BLOCK=16), {})  # a bool, not 1


def test_symbolic_sizes_share_a_key_and_unknown_launches_have_none():
    env = ShapeEnv()
    s0, s1 = env.create_unbacked_symint(), env.create_unbacked_symint()
    args = dict(x_ptr=_fake(8), y_ptr=_fake(8), BLOCK=16)
    assert launch_key(_copy, {**args, "n": s0}, {}) == launch_key(_copy, {**args, "n": s1}, {})
    assert launch_key(_copy, {**args, "n": s0}, {}) != launch_key(_copy, {**args, "n": 8}, {})
    assert launch_key(_copy, {**args, "n": 8, "x_ptr": torch.empty(8)}, {}) is None  # a real tensor
    assert launch_key(_copy, {**args, "n": 8}, {"x_ptr": ("stable", ([8],))}) is None  # a TMA descriptor
    assert launch_key(_copy, {**args, "n": [8]}, {}) is None  # unhashable


def test_a_one_config_autotuner_is_its_function_with_the_configs_arguments():
    tuner = triton.autotune([triton.Config({"BLOCK": 16}, num_warps=2)], key=[])(_copy)
    args = dict(x_ptr=_fake(8), y_ptr=_fake(8), n=8)
    assert launch_key(tuner, args, {}) == launch_key(_copy, {**args, "BLOCK": 16}, {})


def test_torchs_function_is_memoized_only_inside_the_block():
    name = next(n for n in launch_analysis._ANALYSIS_NAMES if hasattr(triton_kernel_wrap, n))
    torchs = getattr(triton_kernel_wrap, name)
    calls = []

    def analyse(kernel, kwargs, tma):
        calls.append(kwargs["n"])
        return [f"written {len(calls)}"]

    setattr(triton_kernel_wrap, name, analyse)
    launch_analysis.forget()
    counters["nvfp4"].clear()
    try:
        args = dict(x_ptr=_fake(8), y_ptr=_fake(8), BLOCK=16)
        with launches_analysed_once():
            with launches_analysed_once():  # re-entrant: Inductor's inner compile inside the backend's
                first = getattr(triton_kernel_wrap, name)(_copy, {**args, "n": 8}, {})
            again = getattr(triton_kernel_wrap, name)(_copy, {**args, "n": 8}, {})
            other = getattr(triton_kernel_wrap, name)(_copy, {**args, "n": 9}, {})
            assert getattr(triton_kernel_wrap, name) is not analyse
        assert getattr(triton_kernel_wrap, name) is analyse
        outside = analyse(_copy, {**args, "n": 8}, {})
    finally:
        setattr(triton_kernel_wrap, name, torchs)
    assert (first, again, other, outside) == (["written 1"], ["written 1"], ["written 2"], ["written 3"])
    assert calls == [8, 9, 8]
    assert (counters["nvfp4"]["launch_analyses"], counters["nvfp4"]["launch_analyses_reused"]) == (2, 1)
    first.append("changed by a caller")
    assert launch_analysis._analysed[launch_key(_copy, {**args, "n": 8}, {})] == ["written 1"]


STACKED = SM90_DRIVER + textwrap.dedent("""
    import contextlib, json, sys
    from unittest import mock

    from torch._functorch.aot_autograd import aot_function
    from torch._higher_order_ops import triton_kernel_wrap
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nvfp4_inductor.compiler import fused
    from nvfp4_inductor.constants import RHT_DEFAULT_SIGN_MASK
    from nvfp4_inductor.kernels import api
    from nvfp4_inductor.compiler import launch_analysis

    name = next(n for n in launch_analysis._ANALYSIS_NAMES if hasattr(triton_kernel_wrap, n))
    torchs, analyses = getattr(triton_kernel_wrap, name), []

    def counted(*args):
        analyses.append(1)
        return torchs(*args)

    setattr(triton_kernel_wrap, name, counted)
    props = mock.Mock(multi_processor_count=132)  # as test_traced_launches.TRACE: an H200's answers
    mock.patch("torch.cuda.get_device_properties", return_value=props).start()
    mock.patch.object(api, "available", lambda device: torch.device(device).type == "cuda").start()

    class Traced(Exception):
        pass

    def forward(x, w1, w2, sizes, probs):  # two layers of one shape, each keeping what it saves
        saved = []
        for _ in range(2):
            x, *kept = fused.grouped_mlp_fwd(
                x, w1, w2, sizes, probs, activation="srelu", tanh_clamp_scale=None, rht=True,
                sign_mask=RHT_DEFAULT_SIGN_MASK, stochastic_rounding=True, recompute=True, target="triton",
                fused_dgrad=True, block_2d=True, fused_fc1=True, fused_amax=False, sr_per_rank=True)
            saved += kept  # as a training step's forward: no launch is dead code
        return x, *saved

    result = {}
    for cached in (False, True):
        graphs, analyses[:] = [], []

        def compiler(gm, example_inputs):
            graphs.append(gm)
            raise Traced

        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        with FakeTensorMode(), (launch_analysis.launches_analysed_once() if cached else contextlib.nullcontext()):
            args = (torch.empty(128, 64, **bf16), torch.empty(4, 32, 64, **bf16), torch.empty(4, 64, 32, **bf16),
                    torch.empty(4, device="cuda", dtype=torch.int64), torch.empty(128, device="cuda"))
            try:
                aot_function(forward, fw_compiler=compiler)(*args)
            except Traced:
                pass
        launches = [[getattr(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]), "fn", None).__name__,
                     sorted(n.kwargs["tensors_to_clone"])]
                    for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
        result[str(cached)] = dict(launches=launches, analyses=len(analyses))
    json.dump(result, open(sys.argv[1], "w"))
""")


def test_two_stacked_layers_are_traced_alike_from_one_analysis_per_distinct_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, "-c", STACKED, str(tmp_path / "out.json")], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "out.json").read_text())
    plain, cached = result["False"], result["True"]
    assert cached["launches"] == plain["launches"]  # the same launches, the same tensors copied for them
    per_layer = len(plain["launches"]) // 2
    assert per_layer >= 10 and plain["launches"][:per_layer] == plain["launches"][per_layer:]
    # torch analyses every launch of both layers, once per AOTAutograd pass; with the block,
    # at most one layer's launches are analysed, once each (the two layers' launches are alike)
    assert plain["analyses"] >= 2 * len(plain["launches"])
    assert 0 < cached["analyses"] <= per_layer, (cached, per_layer)
