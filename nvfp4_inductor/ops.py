"""``torch.library`` ops ``nvfp4::*``: one op per step of the eager chain.

Each op runs the step of the target it names (``target``; the fused ops pass their
site's plan), or, when None, of the first registered target that runs on its inputs'
device (``lowerings.choose_target``): the Triton kernels on CUDA, the reference on CPU.
Fake impls give shapes for tracing. Optional outputs (a copy that was not asked for) come back as empty tensors;
the Python wrappers in ``quantize.py`` turn them into None.

Stochastic-rounding seeds are drawn by ``numerics.draw_seed`` at run time, as tensors on the
data's device from that device's generator (no host read, so CUDA graphs replay fresh
draws); ``sr_per_rank`` (``Recipe.sr_per_rank``) folds the torch.distributed rank into each.
The grouped MLP's backward draws its seeds in one ``nvfp4::draw_sr_seeds`` call (eager and
compiled alike, ``program.py``) and passes each to its cast (``seed``); a quantize op given
none draws its own. Eager and compiled runs consume the generator in the same order, so a
fixed ``torch.manual_seed`` gives the same bits in both.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import numerics
from .activations import compute_dtype, get_activation
from .constants import BLOCK
from .lowerings import steps_for
from .recipe import QuantizeOptions
from .target_ops import target_op
from .tensor import NVFP4GroupedTensor, NVFP4WeightStack, Operand
from .validate import check_group_sizes_values
from .weight_cache import weight_copies

LIB = "nvfp4"


def _empty(like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


def _or_empty(t: Optional[Tensor], like: Tensor, dtype: torch.dtype) -> Tensor:
    return _empty(like, dtype) if t is None else t


def _seed(seed: Optional[Tensor], stochastic_rounding: bool, device, sr_per_rank: bool) -> Optional[Tensor]:
    """The seed a cast rounds with: the one given, else drawn here (``numerics.draw_seed``)."""
    if not stochastic_rounding:
        return None
    return seed if seed is not None else numerics.draw_seed(device, sr_per_rank)


@torch.library.custom_op(f"{LIB}::draw_sr_seeds", mutates_args=())
def draw_sr_seeds(after: Tensor, n: int, per_rank: bool) -> list[Tensor]:
    """`n` stochastic-rounding seeds (``numerics.draw_seed``, drawn one after another on
    `after`'s device): the grouped MLP's backward draws its seeds here, eager and compiled,
    as one op that a compiled graph keeps whole: traced, the draws would become Inductor's
    own random numbers, not the eager chain's. `after` (the step's incoming gradient) is not
    read: it orders the draws after every draw that produced it, as in eager execution,
    since their order fixes their values and Inductor may reorder nodes that nothing
    connects."""
    return [numerics.draw_seed(after.device, per_rank) for _ in range(n)]


@draw_sr_seeds.register_fake
def _(after, n, per_rank):
    return [after.new_empty((), dtype=torch.int64) for _ in range(n)]


# ---------------------------------------------------------------------------------------
# Quantization


@torch.library.custom_op(f"{LIB}::quantize", mutates_args=())
def quantize_op(
    x: Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    sign_mask: int,
    block_2d: bool,
    stochastic_rounding: bool,
    rowwise_amax: Optional[Tensor],
    columnwise_amax: Optional[Tensor],
    target: Optional[str] = None,
    sr_per_rank: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(row data, row scale, row amax, col data, col scale, col amax); empty when absent."""
    q = steps_for(target, x.device).quantize(
        x,
        rowwise=rowwise,
        columnwise=columnwise,
        rht=rht,
        sign_mask=sign_mask,
        block_2d=block_2d,
        stochastic_rounding=stochastic_rounding,
        rowwise_amax=rowwise_amax,
        columnwise_amax=columnwise_amax,
        seed=_seed(None, stochastic_rounding, x.device, sr_per_rank),
    )
    dtypes = (torch.uint8, torch.float8_e4m3fn, torch.float32) * 2
    return tuple(_or_empty(t, x, d) for t, d in zip(q.as_tuple(), dtypes))


@quantize_op.register_fake
def _(x, rowwise, columnwise, rht, sign_mask, block_2d, stochastic_rounding, rowwise_amax, columnwise_amax,
      target=None, sr_per_rank=True):
    m, k = x.shape
    row = (
        (x.new_empty(m, k // 2, dtype=torch.uint8), x.new_empty(m, k // BLOCK, dtype=torch.float8_e4m3fn),
         x.new_empty((), dtype=torch.float32))
        if rowwise else (_empty(x, torch.uint8), _empty(x, torch.float8_e4m3fn), _empty(x))
    )
    col = (
        (x.new_empty(k, m // 2, dtype=torch.uint8), x.new_empty(k, m // BLOCK, dtype=torch.float8_e4m3fn),
         x.new_empty((), dtype=torch.float32))
        if columnwise else (_empty(x, torch.uint8), _empty(x, torch.float8_e4m3fn), _empty(x))
    )
    return row + col


@torch.library.custom_op(f"{LIB}::group_quantize", mutates_args=())
def group_quantize_op(
    x: Tensor,
    group_sizes: Tensor,
    rowwise: bool,
    columnwise: bool,
    rht: bool,
    sign_mask: int,
    stochastic_rounding: bool,
    rowwise_amax: Optional[Tensor],
    columnwise_amax: Optional[Tensor],
    target: Optional[str] = None,
    sr_per_rank: bool = True,
    seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """NVFP4GroupedTensor fields without group_sizes (the caller has them). `seed`: the
    stochastic-rounding seed (drawn here when None)."""
    check_group_sizes_values(group_sizes, x.shape[0])
    cast = QuantizeOptions(rowwise, columnwise, rht, sign_mask, stochastic_rounding, rowwise_amax, columnwise_amax,
                           _seed(seed, stochastic_rounding, x.device, sr_per_rank))
    q = steps_for(target, x.device).group_quantize(x, group_sizes, cast)
    dtypes = (torch.uint8, torch.float8_e4m3fn, torch.float32) * 2 + (torch.int64,)
    return tuple(_or_empty(t, x, d) for t, d in zip(q.as_tuple()[:7], dtypes))


@group_quantize_op.register_fake
def _(x, group_sizes, rowwise, columnwise, rht, sign_mask, stochastic_rounding, rowwise_amax, columnwise_amax,
      target=None, sr_per_rank=True, seed=None):
    t, k = x.shape
    g = group_sizes.shape[0]
    p = numerics.columnwise_capacity(t, g)
    row = (
        (x.new_empty(t, k // 2, dtype=torch.uint8), x.new_empty(t, k // BLOCK, dtype=torch.float8_e4m3fn),
         x.new_empty(g, dtype=torch.float32))
        if rowwise else (_empty(x, torch.uint8), _empty(x, torch.float8_e4m3fn), _empty(x))
    )
    col = (
        (x.new_empty(k, p // 2, dtype=torch.uint8), x.new_empty(k, p // BLOCK, dtype=torch.float8_e4m3fn),
         x.new_empty(g, dtype=torch.float32))
        if columnwise else (_empty(x, torch.uint8), _empty(x, torch.float8_e4m3fn), _empty(x))
    )
    return row + col + (x.new_empty(g + 1, dtype=torch.int64),)


@torch.library.custom_op(f"{LIB}::group_hadamard_amax", mutates_args=())
def group_hadamard_amax_op(x: Tensor, group_sizes: Tensor, sign_mask: int,
                           target: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """Per-group (pre-RHT amax, post-RHT amax), one pass over x."""
    return steps_for(target, x.device).group_hadamard_amax(x, group_sizes, _hadamard_cast(sign_mask))


def _hadamard_cast(sign_mask: int) -> QuantizeOptions:
    """The casts an amax step's (pre-RHT, post-RHT) amaxes feed, as the steps take them:
    both copies, the column-wise one transformed with `sign_mask`'s Hadamard."""
    return QuantizeOptions(rowwise=True, columnwise=True, rht=True, sign_mask=sign_mask)


@group_hadamard_amax_op.register_fake
def _(x, group_sizes, sign_mask, target=None):
    g = group_sizes.shape[0]
    return x.new_empty(g, dtype=torch.float32), x.new_empty(g, dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::quantize_weights", mutates_args=())
def quantize_weights_op(w: Tensor, block_2d: bool,
                        target: Optional[str] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """NVFP4WeightStack fields of a (G, N, K) expert weight stack; inside a
    ``reuse_weight_casts`` block, copies of the ones kept since the block first cast `w`
    (``weight_cache.py``: the same bits)."""
    return _weight_copies(w, block_2d, target)


@torch.library.custom_op(f"{LIB}::quantize_weights_from", mutates_args=())
def quantize_weights_from_op(w: Tensor, sources: list[Tensor], derivation: str, block_2d: bool,
                             target: Optional[str] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``quantize_weights`` of a compiled site's weight stack `w`, made at every step from
    the graph inputs `sources` as `derivation` says (a bf16 copy of fp32 master weights, a
    concatenation of gate and up weights; `w` itself where `sources` is empty): inside a
    ``reuse_weight_casts`` block the kept copies are keyed on those inputs."""
    return _weight_copies(w, block_2d, target, sources, derivation)


def _weight_copies(w, block_2d, target, sources=None, derivation=""):
    """The two ops' body: the target's cast, through the active block (``weight_copies``)."""
    steps = steps_for(target, w.device)
    return weight_copies(w, block_2d, lambda: steps.quantize_weights(w, block_2d=block_2d), sources,
                         derivation).as_tuple()


def _weight_stack_fake(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    g, n, k = w.shape
    return (
        w.new_empty(g, n, k // 2, dtype=torch.uint8),
        w.new_empty(g, n, k // BLOCK, dtype=torch.float8_e4m3fn),
        w.new_empty(g, k, n // 2, dtype=torch.uint8),
        w.new_empty(g, k, n // BLOCK, dtype=torch.float8_e4m3fn),
        w.new_empty(g, dtype=torch.float32),
    )


quantize_weights_op.register_fake(lambda w, block_2d, target=None: _weight_stack_fake(w))
quantize_weights_from_op.register_fake(lambda w, sources, derivation, block_2d, target=None: _weight_stack_fake(w))


# ---------------------------------------------------------------------------------------
# Grouped GEMMs


@target_op(f"{LIB}::grouped_gemm")
def grouped_gemm_op(
    a_data: Tensor, a_scale: Tensor, a_amax: Tensor, b_data: Tensor, b_scale: Tensor, b_amax: Tensor,
    group_sizes: Tensor, target: Optional[str] = None,
) -> Tensor:
    """fprop/dgrad: (T, N) bf16 = per group alpha_g * deq(a) . deq(b_g)^T."""
    a, b = Operand(a_data, a_scale, a_amax), Operand(b_data, b_scale, b_amax)
    return steps_for(target, a_data.device).grouped_gemm(a, b, group_sizes)


@grouped_gemm_op.register_fake
def _(a_data, a_scale, a_amax, b_data, b_scale, b_amax, group_sizes, target=None):
    return a_data.new_empty(a_data.shape[0], b_data.shape[1], dtype=torch.bfloat16)


@target_op(f"{LIB}::grouped_gemm_wgrad")
def grouped_gemm_wgrad_op(
    a_data: Tensor, a_scale: Tensor, a_amax: Tensor, b_data: Tensor, b_scale: Tensor, b_amax: Tensor,
    padded_offsets: Tensor, target: Optional[str] = None,
) -> Tensor:
    """wgrad: (G, N, M) bf16 from two column-wise grouped copies (contraction over tokens)."""
    return steps_for(target, a_data.device).grouped_gemm_wgrad(
        Operand(a_data, a_scale, a_amax), Operand(b_data, b_scale, b_amax), padded_offsets
    )


@grouped_gemm_wgrad_op.register_fake
def _(a_data, a_scale, a_amax, b_data, b_scale, b_amax, padded_offsets, target=None):
    return a_data.new_empty(padded_offsets.shape[0] - 1, a_data.shape[0], b_data.shape[0], dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------
# Activation (scaled by the router probability) and its backward


@torch.library.custom_op(f"{LIB}::activation", mutates_args=())
def activation_op(c: Tensor, probs: Optional[Tensor], activation: str, tanh_clamp_scale: Optional[float],
                  target: Optional[str] = None) -> Tensor:
    """D = round(f(C) * p) to C's dtype (``activations.activation_forward``)."""
    return steps_for(target, c.device).activation_forward(c, probs, activation, tanh_clamp_scale)


@activation_op.register_fake
def _(c, probs, activation, tanh_clamp_scale, target=None):
    f = c.shape[1] // 2 if get_activation(activation).gated else c.shape[1]
    return c.new_empty(c.shape[0], f)


@torch.library.custom_op(f"{LIB}::activation_backward", mutates_args=())
def activation_backward_op(
    g: Tensor, c: Tensor, probs: Optional[Tensor], activation: str, tanh_clamp_scale: Optional[float],
    regenerate: bool, target: Optional[str] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dC, dprobs (empty without probs), D regenerated (empty unless `regenerate`))."""
    dc, dp, d = steps_for(target, c.device).activation_backward(
        g.contiguous(), c, probs, activation, tanh_clamp_scale, regenerate=regenerate
    )
    return dc, _or_empty(dp, c, compute_dtype(c)), _or_empty(d, c, c.dtype)


@activation_backward_op.register_fake
def _(g, c, probs, activation, tanh_clamp_scale, regenerate, target=None):
    dp = c.new_empty(c.shape[0], dtype=compute_dtype(c)) if probs is not None else _empty(c, compute_dtype(c))
    d = c.new_empty(g.shape) if regenerate else _empty(c, c.dtype)
    return c.new_empty(c.shape), dp, d


def _activation_setup_context(ctx, inputs, output):
    c, probs, activation, tanh_clamp_scale, target = inputs
    ctx.save_for_backward(c, probs)
    ctx.activation, ctx.tanh_clamp_scale, ctx.target = activation, tanh_clamp_scale, target


def _activation_backward(ctx, grad):
    c, probs = ctx.saved_tensors
    dc, dp, _ = activation_backward_op(grad, c, probs, ctx.activation, ctx.tanh_clamp_scale, False, ctx.target)
    return dc, (dp.to(probs.dtype) if probs is not None else None), None, None, None


activation_op.register_autograd(_activation_backward, setup_context=_activation_setup_context)


# ---------------------------------------------------------------------------------------
# Fused steps: one kernel for a GEMM and the activation beside it, where the plan fuses them.
# The eager chain calls these on such a plan so that it runs what the compiled path runs: on
# a target whose fused kernels differ from its unfused steps (cuDNN's, numerics.md 7), eager
# means the fused kernels, and compiled == eager still holds bit for bit.


def _fused_step(target: Optional[str], device, step: str):
    fn = getattr(steps_for(target, device), step)
    if fn is None:
        raise ValueError(f"nvfp4::{step}: the {target or 'default'} target has no fused kernel for this step")
    return fn


@torch.library.custom_op(f"{LIB}::fc1_act_amax", mutates_args=())
def fc1_act_amax_op(
    a_data: Tensor, a_scale: Tensor, a_amax: Tensor, b_data: Tensor, b_scale: Tensor, b_amax: Tensor,
    group_sizes: Tensor, probs: Optional[Tensor], activation: str, tanh_clamp_scale: Optional[float],
    sign_mask: int, want_amax: bool, target: Optional[str] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fc1 GEMM + activation * p (``Steps.fc1_act_amax``): (C, D, D's pre-RHT amax, D's
    post-RHT amax with `sign_mask`); the amaxes empty unless `want_amax`."""
    c, d, pre_rht, post_rht = _fused_step(target, a_data.device, "fc1_act_amax")(
        Operand(a_data, a_scale, a_amax), Operand(b_data, b_scale, b_amax), group_sizes, probs, activation,
        tanh_clamp_scale, _hadamard_cast(sign_mask), want_amax=want_amax)
    return c, d, _or_empty(pre_rht, c, torch.float32), _or_empty(post_rht, c, torch.float32)


@fc1_act_amax_op.register_fake
def _(a_data, a_scale, a_amax, b_data, b_scale, b_amax, group_sizes, probs, activation, tanh_clamp_scale, sign_mask,
      want_amax, target=None):
    t, f1, g = a_data.shape[0], b_data.shape[1], group_sizes.shape[0]
    f = f1 // 2 if get_activation(activation).gated else f1
    amaxes = [a_data.new_empty(g if want_amax else 0, dtype=torch.float32) for _ in range(2)]
    return a_data.new_empty(t, f1, dtype=torch.bfloat16), a_data.new_empty(t, f, dtype=torch.bfloat16), *amaxes


@torch.library.custom_op(f"{LIB}::fc2_dgrad_act", mutates_args=())
def fc2_dgrad_act_op(
    a_data: Tensor, a_scale: Tensor, a_amax: Tensor, b_data: Tensor, b_scale: Tensor, b_amax: Tensor,
    group_sizes: Tensor, c: Tensor, probs: Optional[Tensor], activation: str, tanh_clamp_scale: Optional[float],
    target: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """fc2 dgrad + activation backward (``Steps.fc2_dgrad_act``): (dC, dprobs (empty without
    probs)). D is not regenerated: the eager chain keeps D's column-wise copy."""
    dc, dp, _ = _fused_step(target, a_data.device, "fc2_dgrad_act")(
        Operand(a_data, a_scale, a_amax), Operand(b_data, b_scale, b_amax), group_sizes, c, probs, activation,
        tanh_clamp_scale)
    return dc, _or_empty(dp, c, compute_dtype(c))


@fc2_dgrad_act_op.register_fake
def _(a_data, a_scale, a_amax, b_data, b_scale, b_amax, group_sizes, c, probs, activation, tanh_clamp_scale,
      target=None):
    return c.new_empty(c.shape), c.new_empty(c.shape[0] if probs is not None else 0, dtype=compute_dtype(c))


# ---------------------------------------------------------------------------------------
# The eager chain's step table


def _present(out, rowwise: bool, columnwise: bool) -> list:
    """An op's copies with the ones not asked for (returned empty) as None."""
    keep = [rowwise] * 3 + [columnwise] * 3
    return [t if k else None for t, k in zip(out, keep)]


class EagerSteps:
    """A step table (``lowerings.Steps``'s fields, with their signatures) made of this
    module's ops, bound to `target`: what the eager chain runs the program with
    (``program.py``), so each step is one ``nvfp4::`` op call (with its DTensor sharding
    strategy) running that target's step. Packed operands only; D is never regenerated (the
    eager chain saves its column-wise copy). `sr_per_rank`: passed to the casts, where the
    DTensor strategies check it."""

    deq_operands = False
    d_after_dgrad = False
    activation_quantize = None

    def __init__(self, target: Optional[str], sr_per_rank: bool = True):
        self.target, self.sr_per_rank = target, sr_per_rank

    # The steps' values flattened into the ops' schemas (the op bodies rebuild them)
    def group_quantize(self, x, group_sizes, cast: QuantizeOptions):
        if cast.rowwise_deq:
            raise ValueError("nvfp4::group_quantize returns packed copies only (EagerSteps.deq_operands is False)")
        out = group_quantize_op(x, group_sizes, cast.rowwise, cast.columnwise, cast.rht, cast.sign_mask,
                                cast.stochastic_rounding, cast.rowwise_amax, cast.columnwise_amax, self.target,
                                self.sr_per_rank, cast.seed)
        return NVFP4GroupedTensor(*_present(out[:6], cast.rowwise, cast.columnwise), out[6], group_sizes)

    def group_hadamard_amax(self, x, group_sizes, cast: QuantizeOptions):
        return group_hadamard_amax_op(x, group_sizes, cast.sign_mask, self.target)

    def quantize_weights(self, w, *, block_2d):
        return NVFP4WeightStack(*quantize_weights_op(w, block_2d, self.target))

    def grouped_gemm(self, a: Operand, b: Operand, group_sizes):
        return grouped_gemm_op(*a, *b, group_sizes, self.target)

    def grouped_gemm_wgrad(self, a: Operand, b: Operand, padded_offsets):
        return grouped_gemm_wgrad_op(*a, *b, padded_offsets, self.target)

    def activation_forward(self, c, probs, activation, tanh_clamp_scale):
        return activation_op(c, probs, activation, tanh_clamp_scale, self.target)

    def activation_backward(self, g, c, probs, activation, tanh_clamp_scale, *, regenerate=False):
        dc, dp, d = activation_backward_op(g, c, probs, activation, tanh_clamp_scale, regenerate, self.target)
        return dc, dp if probs is not None else None, d if regenerate else None

    def fc1_act_amax(self, a: Operand, b: Operand, group_sizes, probs, activation, tanh_clamp_scale,
                     d_cast: QuantizeOptions, *, want_amax=True):
        c, d, pre_rht, post_rht = fc1_act_amax_op(*a, *b, group_sizes, probs, activation, tanh_clamp_scale,
                                                  d_cast.sign_mask, want_amax, self.target)
        return (c, d, pre_rht, post_rht) if want_amax else (c, d, None, None)

    def fc2_dgrad_act(self, a: Operand, b: Operand, group_sizes, c, probs, activation, tanh_clamp_scale, *,
                      regenerate=False):
        if regenerate:
            raise ValueError("nvfp4::fc2_dgrad_act does not regenerate D (the eager chain saves its column-wise copy)")
        dc, dp = fc2_dgrad_act_op(*a, *b, group_sizes, c, probs, activation, tanh_clamp_scale, self.target)
        return dc, dp if probs is not None else None, None
