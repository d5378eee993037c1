"""Public entry points of the Triton quantize kernels: twins of the numerics.py references
with the same arguments and return types, bit for bit the same results.

    quantize(x, ...)                     <-> numerics.quantize_torch            NVFP4Tensor
    group_quantize(x, group_sizes, ...)  <-> numerics.group_quantize_torch      NVFP4GroupedTensor
    quantize_weights(w, block_2d=True)   <-> numerics.quantize_weights_torch    NVFP4WeightStack
    group_hadamard_amax(x, sizes, mask)  <-> numerics.group_hadamard_amax_torch (pre, post)
    activation_group_quantize(c, probs, activation, scale, group_sizes, ...)
                                         <-> group_quantize(activation_forward(c, ...), ...)

Each call is one ``nvfp4_kernels::group_amax`` launch (only for amaxes not supplied) and
one ``nvfp4_kernels::group_cast`` op (one launch; two for a row + column cast that is
stochastically rounded or writes its row-wise copy as deq() values,
``config.cast_launches``), plus a zero fill per amax computed (the atomic maxima start at
0). The amaxes returned are the cast's amax outputs (copies it writes of the amaxes it
used), so like the references' they alias no supplied amax and no other output, with no
copy launch of their own. Nothing reads group sizes on the host.
Differences from the references, on purpose:
* ``quantize(..., block_2d=True, columnwise=True, rht=True)`` raises NotImplementedError:
  numerics.md 3 says weights (the 2D-quantized tensors) are never transformed.
* ``group_quantize`` ignores ``block_2d`` exactly as the reference does (groups of tokens
  are never 2D-quantized; ``nvfp4_inductor.validate`` rejects it).
* Group sizes must sum to T (the references assume it too).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..constants import RHT_DEFAULT_SIGN_MASK
from ..numerics import Seed, columnwise_capacity, require_seed
from ..recipe import QuantizeOptions
from ..tensor import NVFP4GroupedTensor, NVFP4Tensor, NVFP4WeightStack
from ._registry import INTERPRET
from .activation import _act_code, _check, _clamp, is_gated
from .group_amax import group_amax
from .group_cast import group_cast

_E4M3 = torch.float8_e4m3fn


def available(device) -> bool:
    """Whether the kernels run on `device`: CUDA tensors on a CUDA machine, CPU tensors
    when Triton runs in interpreter mode (TRITON_INTERPRET=1 before Triton's import)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and INTERPRET


def _check_input(x: torch.Tensor, name: str) -> None:
    if not available(x.device):
        raise NotImplementedError(
            f"{name}: the Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
            f"set before triton is imported; got a tensor on {x.device} (interpreter mode: {INTERPRET})"
        )
    if x.dim() != 2 or x.shape[1] % 16:
        raise ValueError(f"{name}: x must be 2-D (rows, K) with K % 16 == 0, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: x must be a floating-point tensor, got {x.dtype}")


def _seed_tensor(stochastic_rounding: bool, seed: Optional[Seed], device, blocks: int = 0) -> Optional[torch.Tensor]:
    """The (1,) int64 seed the cast kernel loads. A tensor seed (``draw_seed``'s) stays a
    device value -- no host read, so CUDA graphs replay fresh draws; an int is filled in."""
    if not stochastic_rounding:
        return None
    def too_many() -> str:
        return f"stochastic rounding: {blocks} blocks exceed the 2**32 Philox counter range"

    if isinstance(blocks, torch.SymInt):  # traced: a guard, or for a data-dependent size a run-time assert
        torch._check(blocks < 2**32, too_many)
    elif blocks >= 2**32:
        raise ValueError(too_many())
    require_seed(stochastic_rounding, seed, "the Triton cast")
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64).reshape(1)
    return torch.full((1,), seed, dtype=torch.int64, device=device)  # a fill: no host-to-device copy


def _amaxes(x, sizes, capacity, rowwise, columnwise, rht, sign_mask, rowwise_amax, columnwise_amax):
    """The (row-wise, column-wise) amaxes the references use, computing only what is missing:
    fp32 (G,) inputs of the cast, which may be a supplied amax or one tensor for both (the
    cast's amax outputs are its own copies, so nothing returned aliases them)."""
    groups = sizes.shape[0]
    need_pre = (rowwise and rowwise_amax is None) or (
        columnwise and not rht and columnwise_amax is None and rowwise_amax is None
    )
    need_post = columnwise and rht and columnwise_amax is None
    pre = post = None
    if need_pre or need_post:
        pre, post = group_amax(x, sizes, need_pre, need_post, sign_mask, capacity)

    def given(amax):  # a new tensor only when the dtype differs (the cast reads fp32)
        return amax.to(torch.float32).reshape(groups).contiguous()

    row = (given(rowwise_amax) if rowwise_amax is not None else pre) if rowwise else None
    if not columnwise:
        col = None
    elif columnwise_amax is not None:
        col = given(columnwise_amax)
    elif rht:
        col = post
    elif rowwise_amax is not None:
        col = given(rowwise_amax)
    else:
        col = pre  # both copies use the pre-RHT amax
    return row, col


def quantize(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    rht: bool = False,
    sign_mask: int = RHT_DEFAULT_SIGN_MASK,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    rowwise_amax: Optional[torch.Tensor] = None,
    columnwise_amax: Optional[torch.Tensor] = None,
    seed: Optional[Seed] = None,
) -> NVFP4Tensor:
    """Quantize an (M, K) tensor, M and K multiples of 16 (numerics.quantize_torch)."""
    _check_input(x, "quantize")
    if x.shape[0] % 16:
        raise ValueError(f"quantize: M must be a multiple of 16, got shape {tuple(x.shape)}")
    if block_2d and columnwise and rht:
        raise NotImplementedError("quantize: block_2d with a column-wise RHT copy (numerics.md 3: weights are never transformed)")
    m = x.shape[0]
    sizes = torch.full((1,), m, dtype=torch.int64, device=x.device)  # one group of M tokens, no padding
    row_amax, col_amax = _amaxes(x, sizes, m, rowwise, columnwise, rht, sign_mask, rowwise_amax, columnwise_amax)
    row_data, row_scale, col_data, col_scale, _, row_amax, col_amax = group_cast(
        x, sizes, row_amax, col_amax, _seed_tensor(stochastic_rounding, seed, x.device, x.numel() // 16),
        rowwise, columnwise, rht and columnwise, sign_mask, block_2d, stochastic_rounding, m, False,
    )
    out = NVFP4Tensor(None, None, None, None, None, None)
    if rowwise:
        out.rowwise_data, out.rowwise_scale, out.rowwise_amax = row_data, row_scale, row_amax.reshape(())
    if columnwise:
        out.columnwise_data, out.columnwise_scale = col_data, col_scale
        out.columnwise_amax = col_amax.reshape(())
    return out


def group_quantize(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    rht: bool = False,
    sign_mask: int = RHT_DEFAULT_SIGN_MASK,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    rowwise_amax: Optional[torch.Tensor] = None,
    columnwise_amax: Optional[torch.Tensor] = None,
    seed: Optional[Seed] = None,
    rowwise_deq: bool = False,
) -> NVFP4GroupedTensor:
    """Quantize a (T, K) tensor of G row groups of sizes `group_sizes` (a (G,) int tensor on
    x's device; any sizes, zero included, summing to T) per group (numerics.group_quantize_torch).
    Amaxes supplied are fp32 (G,). `block_2d` is ignored, as by the reference.
    rowwise_deq: the row-wise copy as its deq() values, (T, K) bf16, scale empty
    (``Steps.deq_operands``); the cast writes it, no dequantize launch."""
    _check_input(x, "group_quantize")
    del block_2d
    cast = QuantizeOptions(rowwise, columnwise, rht, sign_mask, stochastic_rounding, rowwise_amax, columnwise_amax,
                           seed, rowwise_deq)
    return _cast_groups(x, x.shape[1], group_sizes, cast)


def _cast_groups(x, k, group_sizes, cast: QuantizeOptions, probs=None, act=-1, clamp=1.0) -> NVFP4GroupedTensor:
    """``group_quantize`` of x (T, K), or with ``act`` >= 0 of D made from C = x by the cast
    (``group_cast``'s activation arguments; K is D's width)."""
    rowwise, columnwise, rht, sign_mask = cast.rowwise, cast.columnwise, cast.rht, cast.sign_mask
    stochastic_rounding, seed = cast.stochastic_rounding, cast.seed
    tokens = x.shape[0]
    capacity = columnwise_capacity(tokens, group_sizes.shape[0])  # >= tokens: it bounds the SR blocks
    row_amax, col_amax = _amaxes(
        x, group_sizes, capacity, rowwise, columnwise, rht, sign_mask, cast.rowwise_amax, cast.columnwise_amax
    )
    row_data, row_scale, col_data, col_scale, pad_off, row_amax, col_amax = group_cast(
        x, group_sizes, row_amax, col_amax, _seed_tensor(stochastic_rounding, seed, x.device, capacity * k // 16),
        rowwise, columnwise, rht and columnwise, sign_mask, False, stochastic_rounding, capacity, False,
        cast.rowwise_deq, probs, act, clamp,
    )
    return NVFP4GroupedTensor(
        row_data if rowwise else None,
        row_scale if rowwise else None,
        row_amax if rowwise else None,
        col_data if columnwise else None,
        col_scale if columnwise else None,
        col_amax if columnwise else None,
        pad_off,
        group_sizes.to(torch.int64),
    )


def activation_group_quantize(
    c: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    tanh_clamp_scale: Optional[float],
    group_sizes: torch.Tensor,
    **options,
) -> NVFP4GroupedTensor:
    """``group_quantize(activation_forward(c, probs, activation, tanh_clamp_scale), group_sizes,
    ...)`` in one launch per copy, bit for bit: the cast computes D = bf16(f(C) * p) from C's
    rows as it loads them, so D (T x F bf16) is never written or read. For the backward's
    recompute of the fc2 input, whose amaxes the forward saved: every copy's amax must be
    supplied (an amax pass would need D itself). C: bf16 (T, F), (T, 2F) for a gated
    activation; F % 16 == 0. `options`: ``group_quantize``'s keywords (but ``block_2d``)."""
    _check(c, activation, "activation_group_quantize")
    act = _act_code(activation)
    d_width = c.shape[1] // 2 if is_gated(act) else c.shape[1]
    _check_input(c, "activation_group_quantize")
    if d_width % 16:
        raise ValueError(f"activation_group_quantize: D's width must be a multiple of 16, got {d_width} "
                         f"(C {tuple(c.shape)}, {activation})")
    cast = QuantizeOptions(**options)  # group_quantize's keywords (a TypeError names any other)
    if (cast.rowwise and cast.rowwise_amax is None) or (cast.columnwise and cast.columnwise_amax is None):
        raise ValueError("activation_group_quantize: supply the amax of every copy asked for (D is never "
                         "materialized, so there is no amax pass over it)")
    if probs is not None and probs.shape != (c.shape[0],):
        raise ValueError(f"activation_group_quantize: probs must be ({c.shape[0]},), got {tuple(probs.shape)}")
    return _cast_groups(c, d_width, group_sizes, cast, probs.contiguous() if probs is not None else None, act,
                        _clamp(activation, tanh_clamp_scale))


def quantize_weights(w: torch.Tensor, *, block_2d: bool = True, rowwise_deq: bool = False) -> NVFP4WeightStack:
    """Quantize a (G, N, K) expert weight stack per expert, N and K multiples of 16
    (numerics.quantize_weights_torch): one amax launch and one cast launch for all experts;
    row-wise (G, N, K/2), column-wise (G, K, N/2), amax (G,), RNE, no RHT.
    rowwise_deq: the row-wise copy as its deq() values, (G, N, K) bf16, scale empty."""
    if w.dim() != 3 or w.shape[1] % 16 or w.shape[2] % 16:
        raise ValueError(f"quantize_weights: w must be (G, N, K) with N, K % 16 == 0, got {tuple(w.shape)}")
    g, n, k = w.shape
    x = w.reshape(g * n, k)
    _check_input(x, "quantize_weights")
    if n == 0:  # experts of no rows: nothing to launch (the kernels count a stack's experts by its rows)
        def empty(*shape, dtype=torch.uint8):
            return w.new_empty(shape, dtype=dtype)

        row = (empty(g, 0, k, dtype=torch.bfloat16), empty(0, dtype=_E4M3)) if rowwise_deq else (
            empty(g, 0, k // 2), empty(g, 0, k // 16, dtype=_E4M3))
        return NVFP4WeightStack(*row, empty(g, k, 0), empty(g, k, 0, dtype=_E4M3), w.new_zeros(g, dtype=torch.float32))
    # stacked: the kernels know each expert's rows; no group-size tensor (a fill per launch)
    amax, _ = group_amax(x, None, True, False, 0, n, True)
    row_data, row_scale, col_data, col_scale, *_ = group_cast(
        x, None, amax, amax, None, True, True, False, 0, block_2d, False, n, True, rowwise_deq,
    )
    return NVFP4WeightStack(
        row_data.reshape(g, n, k) if rowwise_deq else row_data.reshape(g, n, k // 2),
        row_scale if rowwise_deq else row_scale.reshape(g, n, k // 16),
        col_data,
        col_scale,
        amax,
    )


def group_hadamard_amax(x: torch.Tensor, group_sizes: torch.Tensor, sign_mask: int = RHT_DEFAULT_SIGN_MASK):
    """Per-group (pre-RHT amax, post-RHT amax), fp32 (G,) each, in one pass over x
    (numerics.group_hadamard_amax_torch)."""
    _check_input(x, "group_hadamard_amax")
    capacity = columnwise_capacity(x.shape[0], group_sizes.shape[0])
    return group_amax(x, group_sizes, True, True, sign_mask, capacity)
