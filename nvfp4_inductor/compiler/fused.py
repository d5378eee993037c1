"""The fused grouped-MLP ops the backend puts in place of each recognised site.

Contract: ``nvfp4::grouped_mlp_fwd`` + ``grouped_mlp_bwd`` (three ops) are, as a
pair, equivalent bit for bit to the eager chain of ``nn.py``; ``nvfp4::grouped_mlp_infer``
is interchangeable with the pair's forward output. They call the same lowering steps as
the eager ops, fused where the same plan fuses them, so equality is by construction.
What the forward returns beyond Y is exactly what AOTAutograd saves for the backward
(``saved.SavedForBackward``):

    saved, recompute=True (default; numerics.md 6)     saved, recompute=False
    C (T, F1) bf16                              C
    x's column-wise RHT copy + amax + offsets   x's column-wise RHT copy + amax + offsets
    W1, W2 column-wise copies + amaxes          W1, W2 column-wise copies + amaxes
    D's column-wise amax (G,) fp32              D's column-wise copy (K, P/2) + scales + amax
    probs, group_sizes                          probs, group_sizes

The ops run the site's plan (``lowerings.Plan``, chosen once per site by the backend and
passed as op arguments, so they run exactly what ``explain`` prints): its target's steps,
and its fused kernels where the plan says so. With recompute the forward quantizes D
row-wise only, with the pre-RHT amax from one group Hadamard-amax pass that also yields
the post-RHT amax (or, where the plan says ``fused_amax``, from the fused fc1 kernel's
epilogue, with no pass over D at all); the backward regenerates D bit-exactly, with the
activation step after the fc2 dgrad where the target's ``Steps.d_after_dgrad`` says so
(the dgrad's bf16 operand copies are gone by then; inside D's column-wise cast where the
target's ``Steps.activation_quantize`` can, so D is never stored), else in the
activation-gradient step (fused into the fc2 dgrad GEMM where the plan says
``fused_dgrad``), and casts it column-wise with the saved post-RHT amax, so no amax pass
over D runs in the backward.
A plan whose fused fc1 does not make D from the saved C (``Plan.d_regenerable`` False:
cuDNN's) keeps D's column-wise copy instead (rule 5).
The backward runs its own ops (``grouped_mlp_bwd``: ``nvfp4::grouped_mlp_bwd_fc2`` up to
dC's NVFP4 copies, then fc1's wgrad and dgrad as the eager GEMM ops, in the order
``fc1_wgrad_last`` picks), never the forward op again: that would be merged with it by the
partitioner's CSE and the activation saved after all.
Three ops rather than one let the compiled backward free each saved tensor after its last
reader (benchmarks/memory_model.py) where the ops stay whole. On the Triton target they do
not: made with ``target_ops.target_op``, each is traced as its body, so Inductor's
generated code launches the kernels itself and plans every buffer; the stochastic-rounding
seeds are then the one opaque op, ``nvfp4::draw_sr_seeds``.
Every non-tensor argument of the ops (the activation, the recipe's fields, recompute, the
plan's) is keyword-only, so FX graphs and Inductor's generated code print each by name
(``activation='swiglu', rht=True, sign_mask=55272, ...``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import ops
from ..constants import BLOCK
from ..lowerings import Plan, steps_for
from ..numerics import columnwise_capacity, copy_amaxes, draw_seed
from ..recipe import Recipe
from ..saved import LABELS, REGENERATED, SavedForBackward
from ..sizes import size_hint
from ..target_ops import target_op
from ..tensor import NVFP4WeightStack
from ..validate import check_group_sizes_values, check_grouped_mlp_args

LIB = "nvfp4"


def _fc1(steps, fused_fc1, fused_amax, xq, w1q, group_sizes, probs, activation, tanh_clamp_scale, sign_mask):
    """(C, D, (pre-RHT, post-RHT) amax of D or None): the target's fused kernel where the
    plan says so (the amaxes then come from its epilogue when ``fused_amax``), else the
    GEMM and the activation."""
    args = (xq.rowwise_data, xq.rowwise_scale, xq.rowwise_amax, w1q.rowwise_data, w1q.rowwise_scale, w1q.amax,
            group_sizes)
    if fused_fc1:
        c, d, pre_rht, post_rht = steps.fc1_act_amax(*args, probs, activation, tanh_clamp_scale, sign_mask,
                                                     want_amax=fused_amax)
        return c, d, (pre_rht, post_rht) if fused_amax else None
    c = steps.grouped_gemm(*args)
    return c, steps.activation_forward(c, probs, activation, tanh_clamp_scale), None


def _deq(steps) -> dict:
    """The quantize steps' keyword that returns the row-wise copy as its deq() values, where
    the target's GEMM steps take such operands (``Steps.deq_operands``): for the forward
    GEMMs' operands (x, W1, D, W2 row-wise) and dY's row-wise copy, which a GEMM reads right
    after the cast, so no dequantize launch expands a packed copy written just before. Every
    other copy stays packed: those saved for the backward (3.6x smaller), dC's (held across
    fc2's wgrad), and the column-wise ones, whose casts slowed down by more than the
    dequantize they save (NOTES, runs Y2-Y3, AC1-AC4). Equal bits: deq() is what the GEMMs read."""
    return dict(rowwise_deq=True) if steps.deq_operands else {}


def _weights(steps, w, block_2d, deq, reuse, target, sources=(), derivation=""):
    """A weight stack's NVFP4 copies: with ``reuse_weight_casts`` (the backend option) from
    the eager op ``quantize_weights_from``, one opaque call in a compiled graph, which
    reuses the copies kept by an active ``reuse_weight_casts()`` block (``weight_cache.py``;
    packed, so the GEMM dequantizes its operand), keyed on the graph inputs `w` was made
    from (`sources`, the ones given) and how (`derivation`), or on `w` itself; else the
    target's cast (row-wise as `deq` says)."""
    if reuse:
        given = [t for t in sources if t is not None]
        return NVFP4WeightStack(*ops.quantize_weights_from_op(w, given, derivation, block_2d, target))
    return steps.quantize_weights(w, block_2d=block_2d, **deq)


def _fc2(steps, dq, w2q, group_sizes):
    return steps.grouped_gemm(dq.rowwise_data, dq.rowwise_scale, dq.rowwise_amax,
                              w2q.rowwise_data, w2q.rowwise_scale, w2q.amax, group_sizes)


@torch.library.custom_op(f"{LIB}::draw_sr_seeds", mutates_args=())
def draw_sr_seeds(after: Tensor, n: int, per_rank: bool) -> list[Tensor]:
    """`n` stochastic-rounding seeds (``numerics.draw_seed``, drawn one after another on
    `after`'s device), as one op that a compiled graph keeps whole: traced, the draws would
    become Inductor's own random numbers, not the eager chain's. `after` (the step's
    incoming gradient) is not read: it orders the draws after every draw that produced it,
    as in eager execution, since their order fixes their values and Inductor may reorder
    nodes that nothing connects."""
    return [draw_seed(after.device, per_rank) for _ in range(n)]


@draw_sr_seeds.register_fake
def _(after, n, per_rank):
    return [after.new_empty((), dtype=torch.int64) for _ in range(n)]


@target_op(f"{LIB}::grouped_mlp_infer")
def grouped_mlp_infer(
    x: Tensor, fc1_weight: Tensor, fc2_weight: Tensor, group_sizes: Tensor, probs: Optional[Tensor],
    fc1_source: Optional[Tensor] = None, fc1_up_source: Optional[Tensor] = None, fc2_source: Optional[Tensor] = None,
    *, activation: str, tanh_clamp_scale: Optional[float], rht: bool, sign_mask: int, block_2d: bool,
    target: str, fused_fc1: bool, fused_amax: bool, reuse_weight_casts: bool = False, weight_derivation: str = "",
) -> Tensor:
    """Forward only (no_grad / inference): row-wise copies only, nothing kept. The sources
    and ``weight_derivation``: ``fused_grouped_mlp``'s."""
    check_group_sizes_values(group_sizes, x.shape[0])
    steps = steps_for(target, x.device)
    deq = _deq(steps)
    xq = steps.group_quantize(x, group_sizes, rowwise=True, columnwise=False, rht=rht, sign_mask=sign_mask, **deq)
    w1q = _weights(steps, fc1_weight, block_2d, deq, reuse_weight_casts, target, (fc1_source, fc1_up_source),
                   f"fc1 of {weight_derivation}")
    _, d, amax = _fc1(steps, fused_fc1, fused_amax, xq, w1q, group_sizes, probs, activation, tanh_clamp_scale,
                      sign_mask)
    del xq, w1q
    dq = steps.group_quantize(d, group_sizes, rowwise=True, columnwise=False,
                              rowwise_amax=amax[0] if amax is not None else None, **deq)
    del d
    w2q = _weights(steps, fc2_weight, block_2d, deq, reuse_weight_casts, target, (fc2_source,),
                   f"fc2 of {weight_derivation}")
    return _fc2(steps, dq, w2q, group_sizes)


@grouped_mlp_infer.register_fake
def _(x, fc1_weight, fc2_weight, group_sizes, probs, *sources, **options):
    return x.new_empty(x.shape[0], fc2_weight.shape[1])


@target_op(f"{LIB}::grouped_mlp_fwd")
def grouped_mlp_fwd(
    x: Tensor, fc1_weight: Tensor, fc2_weight: Tensor, group_sizes: Tensor, probs: Optional[Tensor],
    fc1_source: Optional[Tensor] = None, fc1_up_source: Optional[Tensor] = None, fc2_source: Optional[Tensor] = None,
    *, activation: str, tanh_clamp_scale: Optional[float], rht: bool, sign_mask: int, block_2d: bool,
    stochastic_rounding: bool, recompute: bool, target: str, fused_fc1: bool, fused_amax: bool, fused_dgrad: bool,
    sr_per_rank: bool = True, reuse_weight_casts: bool = False, weight_derivation: str = "",
) -> list[Tensor]:
    """[Y, *SavedForBackward] — D's column-wise data and scales empty with recompute (D is
    rebuilt in the backward).

    Memory: W2 is quantized just before fc2 and the row-wise copies of x and W1 are
    dropped after fc1, their last consumer (no quantization of the forward draws random
    bits, so the order changes no result)."""
    check_group_sizes_values(group_sizes, x.shape[0])
    steps = steps_for(target, x.device)
    deq = _deq(steps)
    xq = steps.group_quantize(x, group_sizes, rowwise=True, columnwise=True, rht=rht, sign_mask=sign_mask, **deq)
    w1q = _weights(steps, fc1_weight, block_2d, deq, reuse_weight_casts, target, (fc1_source, fc1_up_source),
                   f"fc1 of {weight_derivation}")
    c, d, amax = _fc1(steps, fused_fc1, fused_amax, xq, w1q, group_sizes, probs, activation, tanh_clamp_scale,
                      sign_mask)
    kept = dict(x_col_data=xq.columnwise_data, x_col_scale=xq.columnwise_scale, x_col_amax=xq.columnwise_amax,
                offsets=xq.columnwise_offsets, w1_col_data=w1q.columnwise_data, w1_col_scale=w1q.columnwise_scale,
                w1_amax=w1q.amax)
    del xq, w1q
    if recompute:
        pre_post = amax if amax is not None else steps.group_hadamard_amax(d, group_sizes, sign_mask)
        row_amax, col_amax = copy_amaxes(*pre_post, rht)
        dq = steps.group_quantize(d, group_sizes, rowwise=True, columnwise=False, rowwise_amax=row_amax, **deq)
        kept.update(d_col_amax=col_amax, d_col_data=d.new_empty(0, dtype=torch.uint8),
                    d_col_scale=d.new_empty(0, dtype=torch.float8_e4m3fn))
    else:  # the epilogue's amaxes are the ones group_quantize would compute (without RHT: pre)
        row_amax, col_amax = copy_amaxes(*amax, rht) if amax is not None else (None, None)
        dq = steps.group_quantize(d, group_sizes, rowwise=True, columnwise=True, rht=rht, sign_mask=sign_mask,
                                  rowwise_amax=row_amax, columnwise_amax=col_amax, **deq)
        kept.update(d_col_amax=dq.columnwise_amax, d_col_data=dq.columnwise_data, d_col_scale=dq.columnwise_scale)
    del d
    w2q = _weights(steps, fc2_weight, block_2d, deq, reuse_weight_casts, target, (fc2_source,),
                   f"fc2 of {weight_derivation}")
    y = _fc2(steps, dq, w2q, group_sizes)
    saved = SavedForBackward(c=c, w2_col_data=w2q.columnwise_data, w2_col_scale=w2q.columnwise_scale,
                             w2_amax=w2q.amax, **kept)
    return [y, *saved.flatten()]


@grouped_mlp_fwd.register_fake
def _(x, fc1_weight, fc2_weight, group_sizes, probs, *sources, recompute, **options):
    t, h = x.shape
    g, f1, _ = fc1_weight.shape
    f = fc2_weight.shape[2]
    p = columnwise_capacity(t, g)
    e4m3 = torch.float8_e4m3fn

    def new(*shape, dtype):
        return x.new_empty(*shape, dtype=dtype)

    d_col = dict(d_col_data=new(0, dtype=torch.uint8), d_col_scale=new(0, dtype=e4m3)) if recompute else dict(
        d_col_data=new(f, p // 2, dtype=torch.uint8), d_col_scale=new(f, p // BLOCK, dtype=e4m3))
    saved = SavedForBackward(
        c=new(t, f1, dtype=torch.bfloat16),
        x_col_data=new(h, p // 2, dtype=torch.uint8), x_col_scale=new(h, p // BLOCK, dtype=e4m3),
        x_col_amax=new(g, dtype=torch.float32), offsets=new(g + 1, dtype=torch.int64),
        w1_col_data=new(g, h, f1 // 2, dtype=torch.uint8), w1_col_scale=new(g, h, f1 // BLOCK, dtype=e4m3),
        w1_amax=new(g, dtype=torch.float32),
        w2_col_data=new(g, f, h // 2, dtype=torch.uint8), w2_col_scale=new(g, f, h // BLOCK, dtype=e4m3),
        w2_amax=new(g, dtype=torch.float32), d_col_amax=new(g, dtype=torch.float32), **d_col)
    return [new(t, h, dtype=torch.bfloat16), *saved.flatten()]


@target_op(f"{LIB}::grouped_mlp_bwd_fc2")
def grouped_mlp_bwd_fc2(
    dy: Tensor, c: Tensor, probs: Optional[Tensor], group_sizes: Tensor, offsets: Tensor,
    w2_col_data: Tensor, w2_col_scale: Tensor, w2_amax: Tensor,
    d_col_amax: Tensor, d_col_data: Tensor, d_col_scale: Tensor, *,
    activation: str, tanh_clamp_scale: Optional[float], rht: bool, sign_mask: int, stochastic_rounding: bool,
    recompute: bool, target: str, fused_dgrad: bool, sr_per_rank: bool = True,
) -> list[Tensor]:
    """The backward up to dC's NVFP4 copies: [dW2, dprobs (empty without probs), dC row-wise
    (data, scale, amax), dC column-wise (data, scale, amax)]. SR seeds drawn dY first, then dC.

    Memory: dC is quantized before fc2's wgrad, so its bf16 copy is gone while the wgrad's
    transient bf16 operands live; each intermediate is dropped after its last consumer
    (``del``). GEMMs draw no random bits, so their order changes no result."""
    steps = steps_for(target, dy.device)
    # dY's seed, then dC's: the draws of the eager chain, in its order (nothing between them draws)
    dy_seed, dc_seed = draw_sr_seeds(dy, 2, sr_per_rank) if stochastic_rounding else (None, None)

    def quantize_grad(t, seed, **deq):
        return steps.group_quantize(t, group_sizes, rowwise=True, columnwise=True, rht=rht, sign_mask=sign_mask,
                                    stochastic_rounding=stochastic_rounding, seed=seed, **deq)

    # dY's row-wise copy feeds fc2's dgrad right after its cast: deq() values where the target takes them
    dyq = quantize_grad(dy.contiguous(), dy_seed, **_deq(steps))
    dgrad = (dyq.rowwise_data, dyq.rowwise_scale, dyq.rowwise_amax, w2_col_data, w2_col_scale, w2_amax, group_sizes)
    regenerate = recompute and not steps.d_after_dgrad
    if fused_dgrad:  # G stays in the GEMM's epilogue
        dc, dp, d = steps.fc2_dgrad_act(*dgrad, c, probs, activation, tanh_clamp_scale, regenerate=regenerate)
    else:
        g = steps.grouped_gemm(*dgrad)
        dc, dp, d = steps.activation_backward(g, c, probs, activation, tanh_clamp_scale, regenerate=regenerate)
        del g
    del dgrad
    if recompute:  # D rebuilt from C; cast column-wise with the forward's amax: no amax pass here
        cast = dict(rowwise=False, columnwise=True, rht=rht, sign_mask=sign_mask, columnwise_amax=d_col_amax)
        if regenerate:
            dq = steps.group_quantize(d, group_sizes, **cast)
        elif steps.activation_quantize is not None:  # D made inside its cast where the target can
            dq = steps.activation_quantize(c, probs, activation, tanh_clamp_scale, group_sizes, **cast)
        else:  # after the dgrad, so D and its operand copies are never alive together
            dq = steps.group_quantize(steps.activation_forward(c, probs, activation, tanh_clamp_scale), group_sizes,
                                      **cast)
        d_col_data, d_col_scale = dq.columnwise_data, dq.columnwise_scale
        del dq
    del d
    dcq = quantize_grad(dc, dc_seed)
    del dc
    dw2 = steps.grouped_gemm_wgrad(dyq.columnwise_data, dyq.columnwise_scale, dyq.columnwise_amax,
                                   d_col_data, d_col_scale, d_col_amax, offsets)
    dprobs = dp.to(probs.dtype) if probs is not None else dy.new_empty(0, dtype=torch.float32)
    return [dw2, dprobs, dcq.rowwise_data, dcq.rowwise_scale, dcq.rowwise_amax,
            dcq.columnwise_data, dcq.columnwise_scale, dcq.columnwise_amax]


@grouped_mlp_bwd_fc2.register_fake
def _(dy, c, probs, group_sizes, offsets, w2_col_data, w2_col_scale, w2_amax, d_col_amax, d_col_data, d_col_scale,
      **options):
    t, f1 = c.shape
    g, f, h_half = w2_col_data.shape
    p = columnwise_capacity(t, g)
    e4m3 = torch.float8_e4m3fn
    dprobs = probs.new_empty(probs.shape) if probs is not None else dy.new_empty(0, dtype=torch.float32)
    return [dy.new_empty(g, 2 * h_half, f), dprobs,
            c.new_empty(t, f1 // 2, dtype=torch.uint8), c.new_empty(t, f1 // BLOCK, dtype=e4m3),
            c.new_empty(g, dtype=torch.float32),
            c.new_empty(f1, p // 2, dtype=torch.uint8), c.new_empty(f1, p // BLOCK, dtype=e4m3),
            c.new_empty(g, dtype=torch.float32)]


class BackwardOptions(NamedTuple):
    """The forward op's non-tensor arguments its backward needs."""

    activation: str
    tanh_clamp_scale: Optional[float]
    rht: bool
    sign_mask: int
    stochastic_rounding: bool
    recompute: bool
    target: str
    fused_dgrad: bool
    sr_per_rank: bool = True


def grouped_mlp_bwd(dy: Tensor, saved: SavedForBackward, probs: Optional[Tensor], group_sizes: Tensor,
                    options: BackwardOptions) -> list[Tensor]:
    """[dX, dW1, dW2, dprobs (empty without probs)] from the forward op's saved tensors.

    Three ops, so that a compiled backward frees each saved tensor after the op that last
    reads it: C, W2's copies and D's are gone before fc1's GEMMs, and the operands of
    fc1's first GEMM before its second (Inductor deletes buffers after their last use; one
    op would hold all its arguments until it returns). fc1's two GEMMs run in the order
    ``fc1_wgrad_last`` picks."""
    o = options
    dw2, dprobs, *dcq = grouped_mlp_bwd_fc2(
        dy, saved.c, probs, group_sizes, saved.offsets, saved.w2_col_data, saved.w2_col_scale, saved.w2_amax,
        saved.d_col_amax, saved.d_col_data, saved.d_col_scale, **o._asdict())

    def wgrad():
        return ops.grouped_gemm_wgrad_op(*dcq[3:], saved.x_col_data, saved.x_col_scale, saved.x_col_amax,
                                         saved.offsets, o.target)

    def dgrad():
        return ops.grouped_gemm_op(*dcq[:3], saved.w1_col_data, saved.w1_col_scale, saved.w1_amax, group_sizes,
                                   o.target)

    if fc1_wgrad_last(dcq[0], dcq[3], saved.x_col_data, saved.w1_col_data):
        dx = dgrad()
        dw1 = wgrad()
    else:
        dw1 = wgrad()
        dx = dgrad()
    return [dx, dw1, dw2, dprobs]


def fc1_wgrad_last(dc_row_data: Tensor, dc_col_data: Tensor, x_col_data: Tensor, w1_col_data: Tensor) -> bool:
    """Whether fc1's wgrad runs after its dgrad. On bf16 tensor cores each GEMM makes bf16
    deq() copies of its packed operands for its duration, and the one that runs second
    makes them beside both of fc1's gradients, dX and dW1 (and dW2 and Y): the step's
    memory peak (run Z3's measured peaks at S1, S3 and S4 equal that sum to within 2%).
    The wgrad's copies are x's and dC's column-wise ones (about T x (H + F1) elements),
    the dgrad's W1's and dC's row-wise ones (G x F1 x H + T x F1): the smaller set goes
    second, so the wgrad goes last about when T < G x F1 (S4: 65536 tokens against 128 x
    768). The order is chosen on whole copies, as measured then: W1's copy made in slices
    (``sizes.copy_slices``) only lowers the dgrad's side, and an order chosen on the slices
    measured higher peaks at S3 and S4 (benchmarks/NOTES.md run M6). Packed sizes stand for
    the copies' (both 2 elements a byte); a traced token count is read without a guard
    (neither GEMM draws random bits, so the order changes no result, only the peak), and a
    data-dependent one, which has no example value, keeps the dgrad last. A deq() copy (bf16)
    would break both counts: the GEMM makes no copy of it, and it lives from its cast on, so
    the rule refuses one rather than misorder (dC's copies stay packed: ``_deq``)."""
    for name, data in [("dC row", dc_row_data), ("dC col", dc_col_data), ("x col", x_col_data),
                       ("W1 col", w1_col_data)]:
        torch._check(data.dtype == torch.uint8,
                     lambda: f"fc1_wgrad_last counts packed copies; {name} is {data.dtype}")
    wgrad_copies = [size_hint(x_col_data.numel()), size_hint(dc_col_data.numel())]
    dgrad_copies = [size_hint(w1_col_data.numel()), size_hint(dc_row_data.numel())]
    if None in wgrad_copies + dgrad_copies:
        return False
    return sum(wgrad_copies) < sum(dgrad_copies)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, fc1_weight, fc2_weight, group_sizes, probs, *_ = inputs
    ctx.save_for_backward(probs, group_sizes, *output[1:])
    # (an option left at its default may be absent from keyword_only_inputs)
    ctx.options = BackwardOptions(**{name: keyword_only_inputs[name] for name in BackwardOptions._fields
                                     if name in keyword_only_inputs})
    ctx.has_probs = probs is not None


def _backward(ctx, grads):
    probs, group_sizes, *saved = ctx.saved_tensors
    dx, dw1, dw2, dprobs = grouped_mlp_bwd(grads[0], SavedForBackward.unflatten(saved), probs, group_sizes,
                                           ctx.options)
    # No gradients for the weights' sources, which only key reused casts (one entry each that
    # the call passed: trailing ones left at None are not inputs), nor for the keyword-only options
    sources = [None] * (len(ctx.needs_input_grad) - 5)
    return dx, dw1, dw2, None, dprobs if ctx.has_probs else None, *sources


grouped_mlp_fwd.register_autograd(_backward, setup_context=_setup_context)


def site_options(recipe: Recipe, recompute: bool, plan: Plan, reuse_weight_casts: bool = False) -> dict:
    """``fused_grouped_mlp``'s keyword arguments for a site: the recipe's fields, the
    plan's decisions as plain values (``recompute``: whether D is regenerated, the backend
    option as the plan allows it) and the backend option ``reuse_weight_casts``. A
    rewritten graph's call holds them as constants, so its
    code prints each by name and AOTAutograd's and Inductor's caches key on them
    (compiler/backend.py ``inductor_patches``)."""
    return dict(rht=recipe.rht, sign_mask=recipe.sign_mask, block_2d=recipe.block_2d,
                stochastic_rounding=recipe.stochastic_rounding, sr_per_rank=recipe.sr_per_rank,
                recompute=plan.recomputes_d(recompute), target=plan.target, fused_fc1=plan.fused_fc1,
                fused_amax=plan.fused_amax, fused_dgrad=plan.fused_dgrad, reuse_weight_casts=reuse_weight_casts)


def fused_grouped_mlp(
    x: Tensor,
    fc1_weight: Tensor,
    fc2_weight: Tensor,
    group_sizes: Tensor,
    probs: Optional[Tensor],
    fc1_source: Optional[Tensor] = None,
    fc1_up_source: Optional[Tensor] = None,
    fc2_source: Optional[Tensor] = None,
    *,
    activation: str,
    tanh_clamp_scale: Optional[float],
    rht: bool,
    sign_mask: int,
    block_2d: bool,
    stochastic_rounding: bool,
    sr_per_rank: bool,
    recompute: bool,
    target: str,
    fused_fc1: bool,
    fused_amax: bool,
    fused_dgrad: bool,
    reuse_weight_casts: bool = False,
    weight_derivation: str = "",
) -> Tensor:
    """What a rewritten site calls (traced by AOTAutograd), options as ``site_options``
    gives them: the inference op when no gradient is needed, else the forward op whose
    autograd formula runs the backward ops; both run the site's plan. With
    ``reuse_weight_casts``, the rewrite passes the graph inputs the weights are made from
    at every step (``fc1_source`` and ``fc1_up_source`` for fc1, ``fc2_source``; a bf16
    copy of fp32 master weights, a transpose, a concatenation of gate and up weights) and
    ``weight_derivation``, how: a ``reuse_weight_casts()`` block keys the weights' kept
    copies on them (``weight_cache.py``)."""
    check_grouped_mlp_args(x, fc1_weight, fc2_weight, group_sizes, probs, activation, tanh_clamp_scale)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, fc1_weight, fc2_weight, probs)
    )
    common = dict(activation=activation, tanh_clamp_scale=tanh_clamp_scale, rht=rht, sign_mask=sign_mask,
                  block_2d=block_2d, target=target, fused_fc1=fused_fc1, fused_amax=fused_amax,
                  reuse_weight_casts=reuse_weight_casts, weight_derivation=weight_derivation)
    sources = (fc1_source, fc1_up_source, fc2_source)
    if not needs_grad:
        return grouped_mlp_infer(x, fc1_weight, fc2_weight, group_sizes, probs, *sources, **common)
    return grouped_mlp_fwd(x, fc1_weight, fc2_weight, group_sizes, probs, *sources, **common,
                           stochastic_rounding=stochastic_rounding, recompute=recompute, fused_dgrad=fused_dgrad,
                           sr_per_rank=sr_per_rank)[0]


def _recompute_d_steps(steps, col: str) -> list[tuple[str, str]]:
    """The backward's steps that rebuild D after the dgrad and cast it (``grouped_mlp_bwd_fc2``)."""
    cast = f"{col} only, saved amax (no amax pass)"
    if not steps.d_after_dgrad:  # regenerated by the activation-gradient step
        return [(f"quantize D: {cast}", "group_quantize")]
    if steps.activation_quantize is not None:
        return [(f"activation(C) * p -> D, quantize D: {cast}; one launch where the target makes D "
                 "inside the cast (never stored)", "activation_quantize")]
    return [("activation(C) * p -> D, rebuilt after the dgrad", "activation_forward"),
            (f"quantize D: {cast}", "group_quantize")]


def describe_steps(steps, plan: Plan, *, recompute: bool, rht: bool, stochastic_rounding: bool,
                   reuse_weight_casts: bool = False):
    """The steps the fused ops run for `plan`, in order, each with the function of the
    plan's target that runs it, for ``explain`` (kept beside the ops they describe, and
    branching on the same plan fields). Returns (forward, backward) lists."""
    col = "col RHT" if rht else "col"
    sr = ", SR" if stochastic_rounding else ""
    regen = ", D regenerated" if recompute and not steps.d_after_dgrad else ""
    deq = " (row as deq() values)" if _deq(steps) else ""
    if plan.fused_fc1:
        amax = " + D's pre/post-RHT amax" if plan.fused_amax else ""
        fc1 = [(f"fc1 GEMM + activation * p{amax}, one kernel -> C (saved), D", "fc1_act_amax")]
    else:
        fc1 = [("fc1 GEMM -> C (saved)", "grouped_gemm"), ("activation(C) * p -> D", "activation_forward")]
    d_amax = [] if plan.fused_amax else [("amax pass over D (pre + post RHT)", "group_hadamard_amax")]
    forward = [
        (f"quantize x: row + {col}{deq}", "group_quantize"),
        ("quantize W1, W2: row + col, packed; reused inside a reuse_weight_casts() block" if reuse_weight_casts
         else f"quantize W1, W2: row + col{deq}", "quantize_weights"),
        *fc1,
        *(d_amax + [(f"quantize D: row only, given amax{deq}", "group_quantize")] if recompute
          else [(f"quantize D: row + {col}" + (", given amaxes" if plan.fused_amax else "") + deq, "group_quantize")]),
        ("fc2 GEMM -> Y", "grouped_gemm"),
    ]
    dact = [("fc2 dgrad + activation backward, one kernel -> dC, dp" + regen, "fc2_dgrad_act")] if (
        plan.fused_dgrad) else [
        ("fc2 dgrad -> G", "grouped_gemm"), ("activation backward -> dC, dp" + regen, "activation_backward")]
    backward = [
        (f"quantize dY: row + {col}{sr}{deq}", "group_quantize"),
        *dact,
        *(_recompute_d_steps(steps, col) if recompute else []),
        (f"quantize dC: row + {col}{sr}", "group_quantize"),
        ("fc2 wgrad -> dW2", "grouped_gemm_wgrad"),
        ("fc1 wgrad -> dW1 (own op; fc1's two GEMMs in either order, fc1_wgrad_last)", "grouped_gemm_wgrad"),
        ("fc1 dgrad -> dX (own op)", "grouped_gemm"),
    ]

    def named(listed):
        return [(text, steps.runs(step)) for text, step in listed]

    return named(forward), named(backward)


def saved_for_backward(x, fc1_weight, fc2_weight, group_sizes, probs, *, activation: str,
                       recompute: bool) -> list[tuple[str, Tensor]]:
    """(label, meta tensor) of everything the forward op saves, from its own fake impl run
    on meta tensors of the given tensors' shapes and dtypes (sizes may be symbolic)."""
    x, fc1_weight, fc2_weight, group_sizes, probs = (
        None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")
        for t in (x, fc1_weight, fc2_weight, group_sizes, probs)
    )
    outs = grouped_mlp_fwd(x, fc1_weight, fc2_weight, group_sizes, probs, activation=activation,
                           tanh_clamp_scale=None, rht=True, sign_mask=0, block_2d=True, stochastic_rounding=False,
                           recompute=recompute, target="reference", fused_fc1=False, fused_amax=False,
                           fused_dgrad=False)
    saved = SavedForBackward.unflatten(outs[1:])._asdict()
    kept = [(LABELS[name], t) for name, t in saved.items() if not (recompute and name in REGENERATED)]
    extra = [("group_sizes", group_sizes)] + ([("probs", probs)] if probs is not None else [])
    return kept + extra
