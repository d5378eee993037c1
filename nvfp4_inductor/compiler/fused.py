"""The fused grouped-MLP ops the backend puts in place of each recognised site.

Contract: ``nvfp4::grouped_mlp_fwd`` + ``grouped_mlp_bwd`` (three ops) are, as a
pair, equivalent bit for bit to the eager chain of ``nn.py``; ``nvfp4::grouped_mlp_infer``
is interchangeable with the pair's forward output. They run the program the eager chain runs
(``program.py``) over the target's own step table, fused where the same plan fuses them, so
equality is by construction.
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
(``activation='swiglu', rht=True, sign_mask=55272, ...``): the fields of ``program.SiteOptions``,
flattened by ``schema_kwargs`` and rebuilt by ``site_options_from``, each op taking them all.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import ops, program
from ..constants import BLOCK
from ..lowerings import Plan, steps_for
from ..numerics import columnwise_capacity
from ..program import SiteOptions
from ..recipe import Recipe
from ..saved import LABELS, REGENERATED, SavedForBackward
from ..target_ops import target_op
from ..tensor import NVFP4GroupedTensor, NVFP4WeightStack
from ..validate import check_group_sizes_values, check_grouped_mlp_args

LIB = "nvfp4"


# ---------------------------------------------------------------------------------------
# The schema boundary: a site's options as the ops' keyword arguments, and back


def schema_kwargs(opts: SiteOptions) -> dict:
    """`opts` as the keyword arguments every op here (and ``fused_grouped_mlp``) takes:
    plain values, each printed by name in FX graphs and generated code."""
    recipe, plan = opts.recipe, opts.plan
    return dict(activation=opts.activation, tanh_clamp_scale=opts.tanh_clamp_scale, rht=recipe.rht,
                sign_mask=recipe.sign_mask, block_2d=recipe.block_2d, stochastic_rounding=recipe.stochastic_rounding,
                sr_per_rank=recipe.sr_per_rank, recompute=opts.recompute, target=plan.target,
                fused_fc1=plan.fused_fc1, fused_amax=plan.fused_amax, fused_dgrad=plan.fused_dgrad,
                reuse_weight_casts=opts.reuse_weight_casts, weight_derivation=opts.weight_derivation)


def site_options_from(kwargs: dict) -> SiteOptions:
    """The ops' keyword arguments (``schema_kwargs``'s) as the options object. The plan's
    reason is not an argument: empty here."""
    k = kwargs
    recipe = Recipe(rht=k["rht"], sign_mask=k["sign_mask"], block_2d=k["block_2d"],
                    stochastic_rounding=k["stochastic_rounding"], sr_per_rank=k["sr_per_rank"])
    plan = Plan(k["target"], k["fused_fc1"], k["fused_amax"], k["fused_dgrad"], "")
    return SiteOptions(k["activation"], k["tanh_clamp_scale"], recipe, plan, recompute=k["recompute"],
                       reuse_weight_casts=k["reuse_weight_casts"], weight_derivation=k["weight_derivation"])


class _FusedRunner(program.Runner):
    """The program over the target's own step table (the fused ops' bodies); the weights'
    casts through an active ``reuse_weight_casts()`` block when the option says so."""

    def __init__(self, opts: SiteOptions, device, sources: dict):
        super().__init__(steps_for(opts.plan.target, device), opts)
        self.sources = sources

    def quantize_weights(self, step, w, which, rowwise_deq=False):
        """With ``reuse_weight_casts`` (the backend option): the eager op
        ``quantize_weights_from``, one opaque call in a compiled graph, which reuses the
        copies kept by an active ``reuse_weight_casts()`` block (``weight_cache.py``; packed,
        so the GEMM dequantizes its operand), keyed on the graph inputs `w` was made from
        (`sources`, the ones given) and how (``weight_derivation``), or on `w` itself; else
        the target's cast (row-wise as `rowwise_deq` says)."""
        opts = self.opts
        if not opts.reuse_weight_casts:
            return super().quantize_weights(step, w, which, rowwise_deq)
        given = [t for t in self.sources[which] if t is not None]
        return NVFP4WeightStack(*ops.quantize_weights_from_op(w, given, f"{which} of {opts.weight_derivation}",
                                                              opts.recipe.block_2d, opts.plan.target))


def _sources(fc1_source, fc1_up_source, fc2_source) -> dict:
    return {"fc1": (fc1_source, fc1_up_source), "fc2": (fc2_source,)}


@target_op(f"{LIB}::grouped_mlp_infer")
def grouped_mlp_infer(
    x: Tensor, fc1_weight: Tensor, fc2_weight: Tensor, group_sizes: Tensor, probs: Optional[Tensor],
    fc1_source: Optional[Tensor] = None, fc1_up_source: Optional[Tensor] = None, fc2_source: Optional[Tensor] = None,
    *, activation: str, tanh_clamp_scale: Optional[float], rht: bool, sign_mask: int, block_2d: bool,
    stochastic_rounding: bool, sr_per_rank: bool = True, recompute: bool, target: str, fused_fc1: bool,
    fused_amax: bool, fused_dgrad: bool, reuse_weight_casts: bool = False, weight_derivation: str = "",
) -> Tensor:
    """Forward only (no_grad / inference): the training forward minus what it saves
    (row-wise copies only). The sources: ``fused_grouped_mlp``'s."""
    opts = site_options_from(locals())
    check_group_sizes_values(group_sizes, x.shape[0])
    run = _FusedRunner(opts, x.device, _sources(fc1_source, fc1_up_source, fc2_source))
    y, _ = program.forward(run, opts, x, fc1_weight, fc2_weight, group_sizes, probs, save=False)
    return y


@grouped_mlp_infer.register_fake
def _(x, fc1_weight, fc2_weight, group_sizes, probs, *sources, **options):
    return x.new_empty(x.shape[0], fc2_weight.shape[1])


@target_op(f"{LIB}::grouped_mlp_fwd")
def grouped_mlp_fwd(
    x: Tensor, fc1_weight: Tensor, fc2_weight: Tensor, group_sizes: Tensor, probs: Optional[Tensor],
    fc1_source: Optional[Tensor] = None, fc1_up_source: Optional[Tensor] = None, fc2_source: Optional[Tensor] = None,
    *, activation: str, tanh_clamp_scale: Optional[float], rht: bool, sign_mask: int, block_2d: bool,
    stochastic_rounding: bool, sr_per_rank: bool = True, recompute: bool, target: str, fused_fc1: bool,
    fused_amax: bool, fused_dgrad: bool, reuse_weight_casts: bool = False, weight_derivation: str = "",
) -> list[Tensor]:
    """[Y, *SavedForBackward] — D's column-wise data and scales empty with recompute (D is
    rebuilt in the backward)."""
    opts = site_options_from(locals())
    check_group_sizes_values(group_sizes, x.shape[0])
    run = _FusedRunner(opts, x.device, _sources(fc1_source, fc1_up_source, fc2_source))
    y, saved = program.forward(run, opts, x, fc1_weight, fc2_weight, group_sizes, probs, save=True)
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
    activation: str, tanh_clamp_scale: Optional[float], rht: bool, sign_mask: int, block_2d: bool,
    stochastic_rounding: bool, sr_per_rank: bool = True, recompute: bool, target: str, fused_fc1: bool,
    fused_amax: bool, fused_dgrad: bool, reuse_weight_casts: bool = False, weight_derivation: str = "",
) -> list[Tensor]:
    """The backward up to dC's NVFP4 copies (``program.backward_fc2``): [dW2, dprobs (empty
    without probs), dC row-wise (data, scale, amax), dC column-wise (data, scale, amax)].
    The saved tensors it does not read (x's and W1's copies) are not arguments, so a
    compiled backward can free what it reads after it."""
    opts = site_options_from(locals())
    saved = SavedForBackward(c=c, x_col_data=None, x_col_scale=None, x_col_amax=None, offsets=offsets,
                             w1_col_data=None, w1_col_scale=None, w1_amax=None, w2_col_data=w2_col_data,
                             w2_col_scale=w2_col_scale, w2_amax=w2_amax, d_col_amax=d_col_amax,
                             d_col_data=d_col_data, d_col_scale=d_col_scale)
    run = _FusedRunner(opts, dy.device, {})
    dw2, dp, dcq = program.backward_fc2(run, opts, dy, saved, probs, group_sizes)
    dprobs = dp.to(probs.dtype) if probs is not None else dy.new_empty(0, dtype=torch.float32)
    return [dw2, dprobs, *dcq.rowwise(), *dcq.columnwise()]


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


def grouped_mlp_bwd(dy: Tensor, saved: SavedForBackward, probs: Optional[Tensor], group_sizes: Tensor,
                    opts: SiteOptions) -> list[Tensor]:
    """[dX, dW1, dW2, dprobs (empty without probs)] from the forward op's saved tensors.

    Three ops, so that a compiled backward frees each saved tensor after the op that last
    reads it: C, W2's copies and D's are gone before fc1's GEMMs, and the operands of
    fc1's first GEMM before its second (Inductor deletes buffers after their last use; one
    op would hold all its arguments until it returns). fc1's two GEMMs are the eager GEMM
    ops (``program.backward_fc1``), in the order ``program.fc1_wgrad_last`` picks."""
    dw2, dprobs, *dc = grouped_mlp_bwd_fc2(
        dy, saved.c, probs, group_sizes, saved.offsets, saved.w2_col_data, saved.w2_col_scale, saved.w2_amax,
        saved.d_col_amax, saved.d_col_data, saved.d_col_scale, **schema_kwargs(opts))
    dcq = NVFP4GroupedTensor(*dc, saved.offsets, group_sizes)
    run = program.Runner(ops.EagerSteps(opts.plan.target, opts.recipe.sr_per_rank), opts)
    dx, dw1 = program.backward_fc1(run, dcq, saved, group_sizes)
    return [dx, dw1, dw2, dprobs]


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, fc1_weight, fc2_weight, group_sizes, probs, *_ = inputs
    ctx.save_for_backward(probs, group_sizes, *output[1:])
    ctx.options = site_options_from(keyword_only_inputs)
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
    """``fused_grouped_mlp``'s keyword arguments for a site, but the activation's (the
    rewrite adds them) and ``weight_derivation`` (the rewrite adds it with
    ``reuse_weight_casts``): the recipe's fields, the plan's decisions as plain values
    (``recompute``: whether D is regenerated, the backend option as the plan allows it) and
    the backend option ``reuse_weight_casts``. A rewritten graph's call holds them as
    constants, so its code prints each by name and AOTAutograd's and Inductor's caches key
    on them (compiler/backend.py ``inductor_patches``)."""
    opts = SiteOptions("", None, recipe, plan, recompute=plan.recomputes_d(recompute),
                       reuse_weight_casts=reuse_weight_casts)
    kwargs = schema_kwargs(opts)
    for name in ("activation", "tanh_clamp_scale", "weight_derivation"):
        del kwargs[name]
    return kwargs


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
    gives them (flat: the schema boundary, whose constants print by name and key the
    caches): the inference op when no gradient is needed, else the forward op whose
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
    options = schema_kwargs(site_options_from(locals()))
    op = grouped_mlp_fwd if needs_grad else grouped_mlp_infer
    out = op(x, fc1_weight, fc2_weight, group_sizes, probs, fc1_source, fc1_up_source, fc2_source, **options)
    return out[0] if needs_grad else out


def explain_steps(opts: SiteOptions):
    """The steps the fused ops take for `opts` on its plan's target, each with the function
    of the target that runs it, for ``explain``: recorded from the program they run
    (``program.recorded_steps``). Returns (forward, backward) lists."""
    return program.recorded_steps(steps_for(opts.plan.target, None), opts)


def saved_for_backward(x, fc1_weight, fc2_weight, group_sizes, probs, *, activation: str,
                       recompute: bool) -> list[tuple[str, Tensor]]:
    """(label, meta tensor) of everything the forward op saves, from its own fake impl run
    on meta tensors of the given tensors' shapes and dtypes (sizes may be symbolic)."""
    x, fc1_weight, fc2_weight, group_sizes, probs = (
        None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")
        for t in (x, fc1_weight, fc2_weight, group_sizes, probs)
    )
    opts = SiteOptions(activation, None, Recipe(), Plan("reference", False, False, False, ""), recompute=recompute)
    outs = grouped_mlp_fwd(x, fc1_weight, fc2_weight, group_sizes, probs, **schema_kwargs(opts))
    saved = SavedForBackward.unflatten(outs[1:])._asdict()
    kept = [(LABELS[name], t) for name, t in saved.items() if not (recompute and name in REGENERATED)]
    extra = [("group_sizes", group_sizes)] + ([("probs", probs)] if probs is not None else [])
    return kept + extra
