"""``reuse_weight_casts``: the weights' NVFP4 copies made once per optimizer step (weight_cache.py).

Every check is bitwise against the same micro-batches run with the weights cast on every
forward, from the same generator state (stochastic rounding on: the weights' casts draw no
random bits, so reusing them must not move any draw of the gradients' casts)."""

import contextlib
import warnings

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor import weight_cache

MICRO_BATCHES = 3


def _model_and_batches(activation="srelu"):
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(4, 32, 48, activation)
    xs = [torch.randn(64, 32, dtype=torch.bfloat16) for _ in range(MICRO_BATCHES)]
    return mlp, xs, torch.tensor([10, 0, 31, 23]), torch.rand(64)


def _accumulate(mlp, model, xs, sizes, probs, block, between=None):
    """Outputs of each micro-batch and the accumulated gradients; `between(i)` runs after
    micro-batch i."""
    mlp.zero_grad()
    torch.manual_seed(1)
    outputs = []
    with block() if block else contextlib.nullcontext():
        for i, x in enumerate(xs):
            y = model(x, sizes, probs)
            y.float().square().sum().backward()
            outputs.append(y.detach())
            if between:
                between(i)
    return outputs + [p.grad.clone() for p in mlp.parameters()]


def _equal(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"tensor {i} differs"


def _counted_block(counts):
    @contextlib.contextmanager
    def block():
        with nv.reuse_weight_casts() as reuse:
            yield reuse
        counts.append((reuse.casts, reuse.reuses))

    return block


@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_eager_micro_batches_cast_each_weight_once_and_equal_casting_every_time(activation):
    mlp, xs, sizes, probs = _model_and_batches(activation)
    fresh = _accumulate(mlp, mlp, xs, sizes, probs, None)
    counts = []
    _equal(_accumulate(mlp, mlp, xs, sizes, probs, _counted_block(counts)), fresh)
    assert counts == [(2, 2 * (MICRO_BATCHES - 1))]  # W1 and W2, each cast once


def test_compiled_micro_batches_with_the_option_equal_casting_every_time():
    """aot_eager, the fused ops whole (the reference target; where they are traced as their
    bodies, the weights' casts stay one opaque op: tests/test_traced_launches.py)."""
    mlp, xs, sizes, probs = _model_and_batches()
    fresh = _accumulate(mlp, mlp, xs, sizes, probs, None)
    torch._dynamo.reset()
    counts = []
    compiled = torch.compile(mlp, backend=nv.backend(compiler="aot_eager", reuse_weight_casts=True))
    _equal(_accumulate(mlp, compiled, xs, sizes, probs, _counted_block(counts)), fresh)
    assert counts == [(2, 2 * (MICRO_BATCHES - 1))]
    # outside a block the option casts every time, as without it
    _equal(_accumulate(mlp, compiled, xs, sizes, probs, None), fresh)


def test_inductor_compiled_micro_batches_with_the_option_equal_casting_every_time():
    mlp, xs, sizes, probs = _model_and_batches()
    fresh = _accumulate(mlp, mlp, xs, sizes, probs, None)
    torch._dynamo.reset()
    counts = []
    compiled = torch.compile(mlp, backend=nv.backend(reuse_weight_casts=True))
    _equal(_accumulate(mlp, compiled, xs, sizes, probs, _counted_block(counts)), fresh)
    assert counts == [(2, 2 * (MICRO_BATCHES - 1))]


def _library_steps(model, make_inputs, fn, block, autocast=False):
    """Gradients of `model`'s parameters after 3 micro-batches of `fn` (a loss of its output)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    with block() if block else contextlib.nullcontext():
        for i in range(MICRO_BATCHES):
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                out = fn(*make_inputs(i))
            out.float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("case", ["torchtitan", "fp32_masters_autocast"])
def test_weights_made_anew_each_step_are_keyed_on_the_parameters_they_come_from(case):
    """A compiled site whose weight stack is made at every step from a parameter: torchtitan's
    experts (w1 and w3 concatenated, each ``.bfloat16().transpose(-2, -1)``), and fp32 master
    weights under bf16 autocast (a bf16 copy of a transformers model's experts). The kept
    copies are keyed on the parameters and on how the stack is made from them: each
    stack cast once, the gradients bitwise those of casting every time."""
    import library_models as lib
    from moe_models import TitanMoE

    torch.manual_seed(0)
    if case == "torchtitan":
        model, autocast = TitanMoE(), False
        make_inputs = model.inputs
    else:
        model, autocast = lib.Logits(lib.tiny_causal_lm("qwen3_moe", dtype=torch.float32)).train(), True

        def make_inputs(i):
            return (lib.input_ids(i),)

    torch._dynamo.reset()
    fresh = _library_steps(model, make_inputs, torch.compile(model, backend=nv.backend(compiler="aot_eager")), None,
                           autocast)
    torch._dynamo.reset()
    counts = []
    compiled = torch.compile(model, backend=nv.backend(compiler="aot_eager", reuse_weight_casts=True))
    _equal(_library_steps(model, make_inputs, compiled, _counted_block(counts), autocast), fresh)
    assert counts == [(2, 2 * (MICRO_BATCHES - 1))]


def test_a_derived_stack_is_cast_again_when_its_parameter_changes():
    """fp32 master weights under autocast with an optimizer step between micro-batches: the
    step moves the fp32 parameters' version counters, so their bf16 copies are cast again."""
    import library_models as lib

    torch.manual_seed(0)
    model = lib.Logits(lib.tiny_causal_lm("qwen3_moe", dtype=torch.float32)).train()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def steps(fn, block):
        model.load_state_dict(start)
        counts, out = [], []
        torch.manual_seed(1)
        with _counted_block(counts)() if block else contextlib.nullcontext():
            for i in range(MICRO_BATCHES):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = fn(lib.input_ids(i)).float().square().mean()
                loss.backward()
                out.append(loss.detach())
                opt.step()
                opt.zero_grad()
        return out + [p.detach().clone() for p in model.parameters()], counts

    torch._dynamo.reset()
    fresh, _ = steps(torch.compile(model, backend=nv.backend(compiler="aot_eager")), False)
    torch._dynamo.reset()
    reused, counts = steps(torch.compile(model, backend=nv.backend(compiler="aot_eager", reuse_weight_casts=True)),
                           True)
    _equal(reused, fresh)
    assert counts == [(2 * MICRO_BATCHES, 0)]


def test_one_parameter_made_into_two_stacks_keeps_two_copies():
    """The same parameter made into stacks of the same shape in two ways (as a square model
    could use it for fc1 and, transposed, for fc2) is two entries: the key holds how."""
    w = torch.randn(4, 32, 32, dtype=torch.bfloat16)
    op = torch.ops.nvfp4.quantize_weights_from
    with nv.reuse_weight_casts() as reuse:
        plain = op(w, [w], "fc1 = W", True)
        flipped = op(w.transpose(1, 2).contiguous(), [w], "fc2 = W.transpose(1, 2)", True)
        _equal(op(w, [w], "fc1 = W", True), plain)
        _equal(op(w.transpose(1, 2).contiguous(), [w], "fc2 = W.transpose(1, 2)", True), flipped)
    assert (reuse.casts, reuse.reuses) == (2, 2)
    _equal(flipped, torch.ops.nvfp4.quantize_weights(w.transpose(1, 2).contiguous(), True))


def test_weights_changed_inside_the_block_are_cast_again():
    """An optimizer step inside the block (in place: the version counter moves) is seen:
    the next forward casts the changed stacks again and equals casting every time."""
    mlp, xs, sizes, probs = _model_and_batches()
    opt = torch.optim.SGD(mlp.parameters(), lr=0.5)

    def step(i):
        if i < MICRO_BATCHES - 1:  # the last micro-batch's gradients are compared
            opt.step()
            opt.zero_grad()

    before = [p.detach().clone() for p in mlp.parameters()]
    fresh = _accumulate(mlp, mlp, xs, sizes, probs, None, between=step)
    with torch.no_grad():
        for p, b in zip(mlp.parameters(), before):
            p.copy_(b)
    counts = []
    _equal(_accumulate(mlp, mlp, xs, sizes, probs, _counted_block(counts), between=step), fresh)
    assert counts == [(2 * MICRO_BATCHES, 0)]


def test_each_forward_gets_new_tensors_and_the_kept_copies_stay_intact():
    w = torch.randn(4, 48, 32, dtype=torch.bfloat16)
    fresh = torch.ops.nvfp4.quantize_weights(w, True)
    with nv.reuse_weight_casts() as reuse:
        first = torch.ops.nvfp4.quantize_weights(w, True)
        for t in first:  # what a compiled graph may do to a buffer it was given
            t.view(torch.uint8).fill_(0x55)
        second = torch.ops.nvfp4.quantize_weights(w, True)
        assert not any(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                       for a in first for b in second)
        assert reuse.kept_bytes == sum(t.nbytes for t in fresh)  # 4 x 48 x 32 x 1.125 bytes + 4 amaxes
    _equal(second, fresh)
    assert (reuse.casts, reuse.reuses) == (1, 1) and reuse.kept_bytes == 0


def test_kept_copies_are_keyed_on_the_stack_and_its_view():
    """A view of a kept stack's storage with other offsets, shapes or strides is another
    stack; the same view taken anew (a compiled graph's reinterpretation of a parameter)
    is the same one."""
    w = torch.randn(4, 48, 32, dtype=torch.bfloat16)
    with nv.reuse_weight_casts() as reuse:
        torch.ops.nvfp4.quantize_weights(w, True)
        torch.ops.nvfp4.quantize_weights(w.view(4, 48, 32), True)
        half = torch.ops.nvfp4.quantize_weights(w[2:], True)
        _equal(half, torch.ops.nvfp4.quantize_weights(w[2:].clone(), True))
        torch.ops.nvfp4.quantize_weights(w, False)  # 1x16 blocks: other copies
    assert (reuse.casts, reuse.reuses) == (4, 1)


def test_inference_tensors_are_cast_every_time():
    """A weight made under torch.inference_mode has no version counter to check."""
    with torch.inference_mode():
        w = torch.randn(4, 48, 32, dtype=torch.bfloat16)
        fresh = torch.ops.nvfp4.quantize_weights(w, True)
    with nv.reuse_weight_casts() as reuse, torch.inference_mode():
        for _ in range(2):
            _equal(torch.ops.nvfp4.quantize_weights(w, True), fresh)
    assert (reuse.casts, reuse.reuses) == (2, 0)


def test_a_freed_weight_drops_its_kept_copies():
    with nv.reuse_weight_casts() as reuse:
        w = torch.randn(4, 48, 32, dtype=torch.bfloat16)
        torch.ops.nvfp4.quantize_weights(w, True)
        assert len(reuse._kept) == 1
        del w
        assert len(reuse._kept) == 0


def test_the_block_frees_its_copies_on_exit_and_does_not_nest():
    w = torch.randn(4, 48, 32, dtype=torch.bfloat16)
    with nv.reuse_weight_casts() as reuse:
        torch.ops.nvfp4.quantize_weights(w, True)
        with pytest.raises(RuntimeError, match="reuse_weight_casts: blocks do not nest"):
            with nv.reuse_weight_casts():
                pass
    assert not reuse._kept and weight_cache._ACTIVE is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.ops.nvfp4.quantize_weights(w, True)  # outside a block: cast, nothing kept
    assert weight_cache._ACTIVE is None


def test_a_block_nothing_went_through_says_which_option_is_missing():
    mlp, xs, sizes, probs = _model_and_batches()
    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend=nv.backend(compiler="aot_eager"))
    with pytest.warns(UserWarning, match="backend option reuse_weight_casts=True"):
        with nv.reuse_weight_casts():
            compiled(xs[0], sizes, probs)


def test_option_is_checked_and_explain_names_the_reuse():
    from nvfp4_inductor.compiler.options import BackendOptions

    with pytest.raises(ValueError, match="option 'reuse_weight_casts' must be a bool"):
        BackendOptions.parse({"reuse_weight_casts": "yes"})
    mlp, xs, sizes, probs = _model_and_batches()
    x = xs[0].requires_grad_()
    reusing = nv.backend(reuse_weight_casts=True)
    assert "reuse_weight_casts() block" in str(nv.explain(mlp, backend=reusing)(x, sizes, probs))
    assert "reuse_weight_casts() block" not in str(nv.explain(mlp)(x, sizes, probs))


# ---------------------------------------------------------------------------------------
# On a GPU (`pytest -m gpu`): the Triton target, whose fused ops are traced as their kernel
# launches, and a CUDA graph captured by hand

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_steps(fn, mlp, xs, sizes, probs, dy):
    """dX, dW1, dW2, dprobs of each step, from generator state 5."""
    torch.cuda.manual_seed(5)
    out = []
    for x in xs:
        y = fn(x, sizes, probs)
        out += [g.clone() for g in torch.autograd.grad(y, (x, mlp.fc1_weight, mlp.fc2_weight, probs), dy)]
    return out


def _gpu_case(activation):
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(8, 256, 256, activation, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(2048, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
          for _ in range(MICRO_BATCHES)]
    sizes = torch.bincount(torch.randint(0, 8, (2048,), device="cuda", generator=gen), minlength=8)
    probs = torch.rand(2048, device="cuda", generator=gen).requires_grad_()
    return mlp, xs, sizes, probs, torch.randn(2048, 256, device="cuda", generator=gen).bfloat16()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_gpu_micro_batches_reusing_weight_casts_equal_casting_every_time(activation, compiled):
    mlp, *case = _gpu_case(activation)
    torch._dynamo.reset()
    fresh = _gpu_steps(torch.compile(mlp, backend="nvfp4") if compiled else mlp, mlp, *case)
    fn = torch.compile(mlp, backend=nv.backend(reuse_weight_casts=True)) if compiled else mlp
    with nv.reuse_weight_casts() as reuse:
        _equal(_gpu_steps(fn, mlp, *case), fresh)
    assert (reuse.casts, reuse.reuses) == (2, 2 * (MICRO_BATCHES - 1))
    torch._dynamo.reset()


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_graph_captured_inside_the_block_casts_the_weights_it_replays_on():
    """A compiled step captured by hand (torch.cuda.graph) inside a block: the capture does
    not consult the block, so every replay casts the weights as they are then. With the
    weights changed in place between replays, each replay equals the same step run
    without graphs and without a block from the same generator state."""
    mlp, xs, sizes, probs, dy = _gpu_case("srelu")
    x = xs[0]
    start = [p.detach().clone() for p in mlp.parameters()]

    def set_weights(scale):
        with torch.no_grad():
            for p, s in zip(mlp.parameters(), start):
                p.copy_(s * scale)

    def step(fn):
        return torch.autograd.grad(fn(x, sizes, probs), (x, mlp.fc1_weight, mlp.fc2_weight, probs), dy)

    torch._dynamo.reset()
    plain = torch.compile(mlp, backend="nvfp4")
    want = []
    torch.cuda.manual_seed(5)
    for scale in (1.0, 0.5):
        set_weights(scale)
        want += [g.clone() for g in step(plain)]

    fn = torch.compile(mlp, backend=nv.backend(reuse_weight_casts=True))
    set_weights(1.0)
    with nv.reuse_weight_casts():
        side = torch.cuda.Stream()  # warm-up off the capture stream, as torch.cuda.graph requires
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(fn)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(fn)
        got = []
        torch.cuda.manual_seed(5)
        for scale in (1.0, 0.5):
            set_weights(scale)
            graph.replay()
            got += [g.clone() for g in out]
    _equal(got, want)
    torch._dynamo.reset()


def test_the_option_is_refused_under_cuda_graph_trees():
    """Inductor's graph trees warm a graph up in their own memory pool: kept copies made then
    would live where replays write (backend.REUSE_UNDER_CUDA_GRAPHS)."""
    from torch._inductor import config

    from nvfp4_inductor.compiler.backend import check_mode
    from nvfp4_inductor.compiler.options import BackendOptions

    reuse = BackendOptions(reuse_weight_casts=True)
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match=f"reuse_weight_casts=True does not run under CUDA graphs .mode='{mode}'"):
            check_mode(mode, reuse)
    with config.patch({"triton.cudagraphs": True}):
        with pytest.raises(ValueError, match="torch._inductor.config.triton.cudagraphs is set"):
            check_mode(None, reuse)
        check_mode("max-autotune-no-cudagraphs", BackendOptions())  # without the option: as before
    check_mode("max-autotune-no-cudagraphs", reuse)
    check_mode(None, BackendOptions(reuse_weight_casts=True, compiler="aot_eager"))
    mlp, xs, sizes, probs = _model_and_batches()
    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend=nv.backend(reuse_weight_casts=True), mode="reduce-overhead")
    with pytest.raises(Exception, match="reuse_weight_casts=True does not run under CUDA graphs"):
        compiled(xs[0], sizes, probs)
