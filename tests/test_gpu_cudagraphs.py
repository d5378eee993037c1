"""CUDA graphs draw fresh stochastic-rounding bits on every replay (`pytest -m gpu`).

The SR seeds are device tensors drawn by torch's CUDA generator (``numerics.draw_seed``),
so a captured step records the draw, not its value: each replay advances the generator's
Philox offset on the device. Checked here for a graph captured by hand around a compiled
step and for Inductor's cudagraph trees (``mode="reduce-overhead"``):

* a replay is bit-identical to the same step run without graphs from the same generator
  state (``torch.cuda.manual_seed`` before each);
* two replays on identical inputs round differently (dX, dW1 and dW2 all read SR-rounded
  gradients), as two uncaptured steps do.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import nvfp4_inductor as nv

from _assertions import assert_bytes_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXPERTS, HIDDEN, FFN, TOKENS = 8, 256, 256, 2048


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles GroupedMLP.forward several times (graphs on and off). On torch
    2.11 those cache entries would count towards Dynamo's per-frame recompile limit in every
    later test of the session (explain and compare open a recompile region only on torch
    >= 2.13), so each test leaves Dynamo's cache as it found it."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
LABELS = ("dX", "dW1", "dW2", "dprobs")


def _setup(activation):
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(EXPERTS, HIDDEN, FFN, activation, device="cuda")  # default recipe: SR on
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16().requires_grad_()
    sizes = torch.bincount(torch.randint(0, EXPERTS, (TOKENS,), device="cuda", generator=gen), minlength=EXPERTS)
    probs = torch.rand(TOKENS, device="cuda", generator=gen).requires_grad_()
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    return mlp, (x, sizes, probs, dy)


def _step(fn, mlp, x, sizes, probs, dy):
    y = fn(x, sizes, probs)
    return torch.autograd.grad(y, (x, mlp.fc1_weight, mlp.fc2_weight, probs), dy)


def _clone(tensors):
    return [t.clone() for t in tensors]


def _assert_bitwise(got, want, what):
    for label, g, w in zip(LABELS, got, want):
        assert_bytes_equal(g, w, f"{what}: {label}")


def _assert_fresh_bits(first, second, what):
    for label, a, b in zip(LABELS[:3], first, second):
        assert not torch.equal(a, b), f"{what}: {label} identical in two steps: the rounding bits were frozen"


def _uncaptured(fn, mlp, args, seed):
    """Two steps without graphs from generator state `seed`."""
    torch.cuda.manual_seed(seed)
    return _clone(_step(fn, mlp, *args)), _clone(_step(fn, mlp, *args))


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_graph_captured_by_hand_replays_fresh_bits(activation):
    mlp, args = _setup(activation)
    fn = torch.compile(mlp, backend="nvfp4")
    counters.clear()
    want = _uncaptured(fn, mlp, args, seed=7)
    assert counters["nvfp4"]["sites_rewritten"] >= 1, dict(counters["nvfp4"])  # the fused ops run
    _assert_fresh_bits(*want, "uncaptured steps")

    side = torch.cuda.Stream()  # warm-up off the capture stream, as torch.cuda.graph requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(fn, mlp, *args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(fn, mlp, *args)

    torch.cuda.manual_seed(7)
    graph.replay()
    first = _clone(out)
    graph.replay()
    second = _clone(out)
    _assert_bitwise(first, want[0], "first replay vs first uncaptured step")
    _assert_bitwise(second, want[1], "second replay vs second uncaptured step")
    _assert_fresh_bits(first, second, "two replays")


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_cudagraph_trees_replay_fresh_bits(activation):
    mlp, args = _setup(activation)
    want = _uncaptured(torch.compile(mlp, backend="nvfp4"), mlp, args, seed=11)
    counters.clear()
    graphed = torch.compile(mlp, backend="nvfp4", mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, first replay
        torch.compiler.cudagraph_mark_step_begin()
        _step(graphed, mlp, *args)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert counters["nvfp4"]["sites_rewritten"] >= 1, dict(counters["nvfp4"])

    torch.cuda.manual_seed(11)
    got = []
    for _ in range(2):
        torch.compiler.cudagraph_mark_step_begin()
        got.append(_clone(_step(graphed, mlp, *args)))
    _assert_bitwise(got[0], want[0], "first replay vs first uncaptured step")
    _assert_bitwise(got[1], want[1], "second replay vs second uncaptured step")
    _assert_fresh_bits(*got, "two replays")
