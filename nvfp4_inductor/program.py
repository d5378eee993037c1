"""The grouped MLP's forward and backward, written once, as a sequence of steps.

    forward                                       backward_fc2 (dY)
    xq  = quantize x   row (+ col RHT)            seeds: dY's, then dC's (one draw)
    W1q = quantize W1  row + col                  dYq = quantize dY  row + col RHT, SR
    C, D = fc1 GEMM, activation * p               dC, dp (, D) = fc2 dgrad, activation backward
    Dq  = quantize D   row (+ col RHT)            D's column-wise copy rebuilt (recompute)
    W2q = quantize W2  row + col                  dCq = quantize dC  row + col RHT, SR
    Y   = fc2 GEMM                                dW2 = fc2 wgrad
                                                  backward_fc1: dX, dW1 (order: fc1_wgrad_last)

Inference is the training forward minus what it saves (``save=False``: no column-wise
copies). Three runners run it (``Runner`` over a step table with the ``Steps`` fields'
signatures): the eager chain (``nn.py``) over the eager ``nvfp4::*`` ops bound to the plan's
target (``ops.EagerSteps``; DTensor strategies of the ops apply), the fused ops
(``compiler/fused.py``) over the target's own ``Steps``, and ``explain`` over a recording
runner (``recorded_steps``) that lists each step the program takes with the function of the
target that runs it. Every step call names its step (its first argument), which only the
recording runner reads.

The eager chain runs with ``recompute=False`` (it saves D's column-wise copy) and a step
table without deq() operands; the fused ops with the site's options. Both give the same
bits: the forward draws no random bits, the backward draws its two seeds in one call, in
the eager order, and the GEMMs read the same values whether their operands are packed or
deq() copies (``formats.operand_values``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from . import distributed
from .lowerings import Plan
from .numerics import copy_amaxes
from .recipe import QuantizeOptions, Recipe
from .saved import SavedForBackward
from .sizes import size_hint
from .tensor import NVFP4GroupedTensor, NVFP4WeightStack, Operand


@dataclasses.dataclass(frozen=True)
class SiteOptions:
    """Everything a site's program runs with, besides its tensors.

    activation / tanh_clamp_scale: the activation between the GEMMs and its one parameter.
    recipe: how each tensor is quantized. plan: the target and its fused kernels (its reason
    may be empty: the fused ops rebuild it from their arguments). recompute: whether the
    backward regenerates D (``Plan.recomputes_d`` of the backend option; the eager chain:
    False). reuse_weight_casts / weight_derivation: the weights' casts go through an active
    ``reuse_weight_casts()`` block, keyed on the weights' sources as described
    (``weight_cache.py``; only the fused ops take sources)."""

    activation: str
    tanh_clamp_scale: Optional[float]
    recipe: Recipe
    plan: Plan
    recompute: bool = False
    reuse_weight_casts: bool = False
    weight_derivation: str = ""


class Runner:
    """What the program calls: each field of a step table (``lowerings.Steps``'s, with its
    signature) as ``runner.<field>(step, *args, **kwargs)``, `step` naming the program's step;
    plus ``quantize_weights(step, w, which, rowwise_deq)`` (which: "fc1" or "fc2", for the
    keys of reused casts), ``draw_sr_seeds(after, n)`` and ``fc1_wgrad_last(dcq, saved)``.
    The fused ops' subclass routes reused weight casts by `which`; explain's records each call."""

    def __init__(self, steps, opts: SiteOptions):
        self.steps, self.opts = steps, opts
        self.deq_operands = steps.deq_operands
        self.packed_gemm_operands = steps.deq_operands and steps.packed_gemm_operands
        self.d_after_dgrad = steps.d_after_dgrad
        self.makes_d_in_cast = steps.activation_quantize is not None

    def call(self, step: str, field: str, *args, **kwargs):
        return getattr(self.steps, field)(*args, **kwargs)

    def __getattr__(self, field: str):
        if field.startswith("_"):
            raise AttributeError(field)
        return lambda step, *args, **kwargs: self.call(step, field, *args, **kwargs)

    def quantize_weights(self, step: str, w: Tensor, which: str, rowwise_deq: bool = False) -> NVFP4WeightStack:
        """A weight stack's copies (`which`: "fc1" or "fc2"; a subclass keys reused casts on it)."""
        deq = dict(rowwise_deq=True) if rowwise_deq else {}
        return self.call(step, "quantize_weights", w, block_2d=self.opts.recipe.block_2d, **deq)

    def draw_sr_seeds(self, after: Tensor, n: int) -> list[Tensor]:
        """The backward's `n` stochastic-rounding seeds: one ``nvfp4::draw_sr_seeds`` call, the
        one place they are drawn (``Recipe.sr_per_rank`` honoured)."""
        return distributed.draw_sr_seeds(after, n, self.opts.recipe.sr_per_rank)

    def fc1_wgrad_last(self, dcq: NVFP4GroupedTensor, saved: SavedForBackward) -> bool:
        return fc1_wgrad_last(dcq.rowwise_data, dcq.columnwise_data, saved.x_col_data, saved.w1_col_data)


def _deq(s: Runner, fused: bool) -> dict:
    """The quantize steps' keyword that returns the row-wise copy as its deq() values, where
    the target's GEMM step that reads it takes such operands (``Steps.deq_operands``; `fused`:
    that step is a fused one, which alone takes them under ``Steps.packed_gemm_operands``):
    for the forward GEMMs' operands (x, W1, D, W2 row-wise) and dY's row-wise copy, which a
    GEMM reads right after the cast, so no dequantize launch expands a packed copy written
    just before. Every other copy stays packed: those saved for the backward (3.6x smaller),
    dC's (held across fc2's wgrad), and the column-wise ones, whose casts slowed down by more
    than the dequantize they save (docs/decisions.md, Casts). Equal bits: deq() is what the
    GEMMs read."""
    return dict(rowwise_deq=True) if s.deq_operands and (fused or not s.packed_gemm_operands) else {}


def _fc1(s: Runner, opts: SiteOptions, xq, w1q, group_sizes, probs):
    """(C, D, (pre-RHT, post-RHT) amax of D or None): the target's fused kernel where the
    plan says so (the amaxes then come from its epilogue when ``fused_amax``), else the
    GEMM and the activation."""
    act = (opts.activation, opts.tanh_clamp_scale)
    gemm = (xq.rowwise(), w1q.rowwise(), group_sizes)
    if opts.plan.fused_fc1:
        fused_amax = opts.plan.fused_amax
        c, d, pre_rht, post_rht = s.fc1_act_amax("fc1 GEMM + activation * p -> C (saved), D", *gemm, probs, *act,
                                                 opts.recipe.token_cast(), want_amax=fused_amax)
        return c, d, (pre_rht, post_rht) if fused_amax else None
    c = s.grouped_gemm("fc1 GEMM -> C (saved)", *gemm)
    return c, s.activation_forward("activation(C) * p -> D", c, probs, *act), None


def forward(s: Runner, opts: SiteOptions, x: Tensor, w1: Tensor, w2: Tensor, group_sizes: Tensor,
            probs: Optional[Tensor], *, save: bool):
    """Y, and with `save` the ``SavedForBackward`` (else None): column-wise copies only
    where saved, D's only without recompute (with it, D's column-wise amax only).

    Memory: W2 is quantized just before fc2 and the row-wise copies of x and W1 are
    dropped after fc1, their last consumer (no quantization of the forward draws random
    bits, so the order changes no result)."""
    cast = opts.recipe.token_cast
    fc1_deq, deq = _deq(s, opts.plan.fused_fc1), _deq(s, False)  # fc1's operands; fc2's (a plain GEMM step)
    xq = s.group_quantize("quantize x", x, group_sizes, cast(rowwise=True, columnwise=save, **fc1_deq))
    w1q = s.quantize_weights("quantize W1", w1, "fc1", **fc1_deq)
    c, d, amax = _fc1(s, opts, xq, w1q, group_sizes, probs)
    kept = dict(x_col_data=xq.columnwise_data, x_col_scale=xq.columnwise_scale, x_col_amax=xq.columnwise_amax,
                offsets=xq.columnwise_offsets, w1_col_data=w1q.columnwise_data, w1_col_scale=w1q.columnwise_scale,
                w1_amax=w1q.amax)
    del xq, w1q
    if save and opts.recompute:
        pre_post = amax if amax is not None else s.group_hadamard_amax(
            "amax pass over D (pre + post RHT)", d, group_sizes, cast())
        row_amax, col_amax = copy_amaxes(*pre_post, opts.recipe.rht)
        dq = s.group_quantize("quantize D", d, group_sizes, cast(rowwise=True, columnwise=False,
                                                                 rowwise_amax=row_amax, **deq))
        kept.update(d_col_amax=col_amax, d_col_data=d.new_empty(0, dtype=torch.uint8),
                    d_col_scale=d.new_empty(0, dtype=torch.float8_e4m3fn))
    else:  # the epilogue's amaxes are the ones group_quantize would compute (without RHT: pre)
        row_amax, col_amax = copy_amaxes(*amax, opts.recipe.rht) if amax is not None else (None, None)
        dq = s.group_quantize("quantize D", d, group_sizes, cast(rowwise=True, columnwise=save, rowwise_amax=row_amax,
                                                                 columnwise_amax=col_amax if save else None, **deq))
        kept.update(d_col_amax=dq.columnwise_amax, d_col_data=dq.columnwise_data, d_col_scale=dq.columnwise_scale)
    del d
    w2q = s.quantize_weights("quantize W2", w2, "fc2", **deq)
    y = s.grouped_gemm("fc2 GEMM -> Y", dq.rowwise(), w2q.rowwise(), group_sizes)
    if not save:
        return y, None
    return y, SavedForBackward(c=c, w2_col_data=w2q.columnwise_data, w2_col_scale=w2q.columnwise_scale,
                               w2_amax=w2q.amax, **kept)


def backward_fc2(s: Runner, opts: SiteOptions, dy: Tensor, saved: SavedForBackward, probs: Optional[Tensor],
                 group_sizes: Tensor):
    """(dW2, dprobs or None, dC's NVFP4 copies): the backward up to fc1's GEMMs. SR seeds
    drawn once, dY's then dC's (the order of their casts; nothing between them draws).

    Memory: dC is quantized before fc2's wgrad, so its bf16 copy is gone while the wgrad's
    transient bf16 operands live; each intermediate is dropped after its last consumer
    (``del``). GEMMs draw no random bits, so their order changes no result."""
    recipe, act = opts.recipe, (opts.activation, opts.tanh_clamp_scale)
    sr = recipe.stochastic_rounding
    dy_seed, dc_seed = s.draw_sr_seeds(dy, 2) if sr else (None, None)

    def quantize_grad(step, t, seed, **deq):
        return s.group_quantize(step, t, group_sizes, recipe.token_cast(rowwise=True, columnwise=True,
                                                                        stochastic_rounding=sr, seed=seed, **deq))

    # dY's row-wise copy feeds fc2's dgrad right after its cast: deq() values where the target takes them
    dyq = quantize_grad("quantize dY", dy.contiguous(), dy_seed, **_deq(s, opts.plan.fused_dgrad))
    dgrad = (dyq.rowwise(), saved.w2_col(), group_sizes)
    regenerate = opts.recompute and not s.d_after_dgrad
    if opts.plan.fused_dgrad:  # G stays in the GEMM's epilogue
        dc, dp, d = s.fc2_dgrad_act("fc2 dgrad + activation backward -> dC, dp", *dgrad, saved.c, probs, *act,
                                    regenerate=regenerate)
    else:
        g = s.grouped_gemm("fc2 dgrad -> G", *dgrad)
        dc, dp, d = s.activation_backward("activation backward -> dC, dp", g, saved.c, probs, *act,
                                          regenerate=regenerate)
        del g
    del dgrad
    d_col = saved.d_col()
    if opts.recompute:  # D rebuilt from C; cast column-wise with the forward's amax: no amax pass here
        cast = recipe.token_cast(rowwise=False, columnwise=True, columnwise_amax=saved.d_col_amax)
        if regenerate:
            dq = s.group_quantize("quantize D", d, group_sizes, cast)
        elif s.makes_d_in_cast:  # D made inside its cast where the target can
            dq = s.activation_quantize("activation(C) * p -> D inside the cast (never stored)", saved.c, probs, *act, group_sizes,
                                       cast)
        else:  # after the dgrad, so D and its operand copies are never alive together
            d = s.activation_forward("activation(C) * p -> D, rebuilt after the dgrad", saved.c, probs, *act)
            dq = s.group_quantize("quantize D", d, group_sizes, cast)
        d_col = Operand(dq.columnwise_data, dq.columnwise_scale, saved.d_col_amax)
        del dq
    del d
    dcq = quantize_grad("quantize dC", dc, dc_seed)
    del dc
    dw2 = s.grouped_gemm_wgrad("fc2 wgrad -> dW2", dyq.columnwise(), d_col, saved.offsets)
    return dw2, dp, dcq


def backward_fc1(s: Runner, dcq: NVFP4GroupedTensor, saved: SavedForBackward, group_sizes: Tensor):
    """(dX, dW1), in the order ``fc1_wgrad_last`` picks (the fused ops run these GEMMs as
    their own ops, so that a compiled backward frees what fc2's side read before them)."""

    def wgrad():
        return s.grouped_gemm_wgrad("fc1 wgrad -> dW1 (fc1's two GEMMs in the order fc1_wgrad_last picks)",
                                    dcq.columnwise(), saved.x_col(), saved.offsets)

    def dgrad():
        return s.grouped_gemm("fc1 dgrad -> dX", dcq.rowwise(), saved.w1_col(), group_sizes)

    if s.fc1_wgrad_last(dcq, saved):
        dx = dgrad()
        dw1 = wgrad()
    else:
        dw1 = wgrad()
        dx = dgrad()
    return dx, dw1


def fc1_wgrad_last(dc_row_data: Tensor, dc_col_data: Tensor, x_col_data: Tensor, w1_col_data: Tensor) -> bool:
    """Whether fc1's wgrad runs after its dgrad. On bf16 tensor cores each GEMM makes bf16
    deq() copies of its packed operands for its duration, and the one that runs second
    makes them beside both of fc1's gradients, dX and dW1 (and dW2 and Y): the step's
    memory peak (the measured peaks at S1, S3 and S4 equal that sum to within 2%: docs/decisions.md, Memory).
    The wgrad's copies are x's and dC's column-wise ones (about T x (H + F1) elements),
    the dgrad's W1's and dC's row-wise ones (G x F1 x H + T x F1): the smaller set goes
    second, so the wgrad goes last about when T < G x F1 (S4: 65536 tokens against 128 x
    768). The order is chosen on whole copies, as measured then: W1's copy made in slices
    (``sizes.copy_slices``) only lowers the dgrad's side, and an order chosen on the slices
    measured higher peaks at S3 and S4 (same section). Packed sizes stand for
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


# ---------------------------------------------------------------------------------------
# explain: the steps the program takes for a plan, recorded


class _Recorder(Runner):
    """Runs the program on stand-ins and records each step call: (its step and what the
    call's arguments say, the target's function that runs it)."""

    def __init__(self, steps, opts: SiteOptions):
        super().__init__(steps, opts)
        self.calls: list[tuple[str, str]] = []

    def record(self, text: str, field: str) -> None:
        self.calls.append((text, self.steps.runs(field)))

    def call(self, step, field, *args, **kwargs):
        self.record(step + _details(field, args, kwargs), field)
        if field in ("group_quantize", "activation_quantize"):
            return NVFP4GroupedTensor(*[_STUB] * 8)
        if field == "quantize_weights":
            return NVFP4WeightStack(*[_STUB] * 5)
        returns = {"fc1_act_amax": 4, "fc2_dgrad_act": 3, "activation_backward": 3, "group_hadamard_amax": 2}
        return (_STUB,) * returns[field] if field in returns else _STUB

    def quantize_weights(self, step, w, which, rowwise_deq=False):
        if not self.opts.reuse_weight_casts:
            return super().quantize_weights(step, w, which, rowwise_deq)
        self.record(step + ": row + col, packed; reused inside a reuse_weight_casts() block", "quantize_weights")
        return NVFP4WeightStack(*[_STUB] * 5)

    def draw_sr_seeds(self, after, n):
        return (_STUB,) * n

    def fc1_wgrad_last(self, dcq, saved):
        return False


class _Stub:
    """Every tensor of a recorded run: what the program asks of a tensor, it answers with itself."""

    def new_empty(self, *args, **kwargs):
        return self

    def contiguous(self):
        return self


_STUB = _Stub()


def _details(field: str, args: tuple, kwargs: dict) -> str:
    """What a step call's arguments say, in words: the copies a cast makes and how."""
    if field == "fc1_act_amax":
        return " + D's pre/post-RHT amax, one kernel" if kwargs["want_amax"] else ", one kernel"
    if field in ("fc2_dgrad_act", "activation_backward"):
        return (", one kernel" if field == "fc2_dgrad_act" else "") + (", D regenerated" if kwargs["regenerate"] else "")
    if field == "quantize_weights":
        return ": row + col" + (" (row as deq() values)" if kwargs.get("rowwise_deq") else "")
    if field not in ("group_quantize", "activation_quantize"):
        return ""
    cast: QuantizeOptions = args[-1]
    copies = ": " + " + ".join(name for name, made in (("row", cast.rowwise),
                                                       ("col RHT" if cast.rht else "col", cast.columnwise)) if made)
    if cast.stochastic_rounding:
        copies += ", SR"
    if cast.rowwise_amax is not None or cast.columnwise_amax is not None:
        copies += ", given amax"
    return copies + (" (row as deq() values)" if cast.rowwise_deq else "")


def recorded_steps(steps, opts: SiteOptions) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(forward, backward): the steps the fused ops take for `opts` on the target whose step
    table is `steps`, each (what it does, the target's function that runs it), recorded
    from the program itself. fc1's backward GEMMs are listed wgrad first; the fused ops run
    them in the order ``fc1_wgrad_last`` picks from the operand sizes."""
    run = _Recorder(steps, opts)
    _, saved = forward(run, opts, _STUB, _STUB, _STUB, _STUB, _STUB, save=True)
    forward_calls, run.calls = run.calls, []
    _, _, dcq = backward_fc2(run, opts, _STUB, saved, _STUB, _STUB)
    backward_fc1(run, dcq, saved, _STUB)
    return forward_calls, run.calls
