"""Input checks shared by the eager API, the ops and the compiled path.

Errors name the argument, the rule and the value received (ValueError for bad input).
Group sizes are checked on the host only when they already live there; on a device the
check is a device-side assert (``torch._assert_async``), so no step ever syncs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .activations import activation_names, get_activation
from .constants import BLOCK
from .recipe import QuantizeOptions


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name} must have dtype {names}; got {str(t.dtype).replace('torch.', '')}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}; got shape {tuple(t.shape)}")


def check_multiple_of_16(name: str, size: int) -> None:
    if isinstance(size, int) and size % BLOCK:
        raise ValueError(f"{name} must be a multiple of {BLOCK} (NVFP4 blocks of {BLOCK}); got {size}")


def check_quantize_args(x: torch.Tensor, cast: QuantizeOptions, *, block_2d: bool, grouped: bool) -> None:
    """The rules of numerics.md sections 1-4 for one quantize call (`cast` checks its sign
    mask itself)."""
    rowwise, columnwise, rht = cast.rowwise, cast.columnwise, cast.rht
    check_dtype("x", x, (torch.bfloat16, torch.float16, torch.float32))
    check_ndim("x", x, 2, "(M, K)" if not grouped else "(T, K)")
    if not (rowwise or columnwise):
        raise ValueError("quantize: at least one of rowwise / columnwise must be True")
    check_multiple_of_16("x.shape[1] (K)", x.shape[1])
    if columnwise and not grouped:
        check_multiple_of_16("x.shape[0] (M) for a column-wise copy", x.shape[0])
    if block_2d:
        if grouped:
            raise ValueError("block_2d: 16x16 tiles are for weights; grouped (token) tensors use 1x16 blocks")
        check_multiple_of_16("x.shape[0] (M) with block_2d", x.shape[0])
    if rht and columnwise and x.dtype != torch.bfloat16:
        raise ValueError(f"rht needs a bfloat16 x (numerics.md 3); got {str(x.dtype).replace('torch.', '')}")


def check_amax_arg(name: str, amax: Optional[torch.Tensor], numel: int) -> None:
    if amax is None:
        return
    check_dtype(name, amax, (torch.float32,))
    if amax.numel() != numel:
        raise ValueError(f"{name} must have {numel} element(s); got shape {tuple(amax.shape)}")


def check_same_device(x: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Every tensor of `others` (by argument name; None skipped) on x's device: a kernel
    handed a tensor from another device fails deep inside, or copies it with a sync."""
    for name, t in others.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device ({x.device}); got {t.device}")


def check_group_sizes_meta(group_sizes: torch.Tensor, groups: Optional[int] = None) -> None:
    """Shape and dtype of group sizes (no values read)."""
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_sizes must be an int32 or int64 tensor; got {group_sizes.dtype}")
    check_ndim("group_sizes", group_sizes, 1, "(G,)")
    if groups is not None and group_sizes.shape[0] != groups:
        raise ValueError(
            f"group_sizes has {group_sizes.shape[0]} entries but the weights have {groups} experts"
        )


def check_group_sizes_values(group_sizes: torch.Tensor, tokens: int) -> None:
    """Group sizes non-negative and summing to T: a ValueError when they live on the host,
    a device-side assert (no sync) when they live on a GPU."""
    if group_sizes.device.type == "cpu":
        if bool((group_sizes < 0).any()):
            raise ValueError(f"group_sizes must be non-negative; got {group_sizes.tolist()}")
        total = int(group_sizes.sum())
        if total != tokens:
            raise ValueError(f"group_sizes must sum to the number of rows of x ({tokens}); they sum to {total}")
        return
    assert_group_sizes_on_device(group_sizes, tokens)


def assert_group_sizes_on_device(group_sizes: torch.Tensor, tokens: int) -> None:
    """``check_group_sizes_values`` on a GPU: device-side asserts, which a compiled graph
    holds as ops (they read no value on the host, so they can be traced)."""
    torch._assert_async((group_sizes >= 0).all(), "group_sizes must be non-negative")
    torch._assert_async(group_sizes.sum() == tokens, "group_sizes must sum to the number of rows of x")


def check_grouped_mlp_args(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    group_sizes: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    tanh_clamp_scale: Optional[float],
) -> None:
    """The grouped MLP's contract (numerics.md 5); shapes and dtypes only (no values read)."""
    entry = get_activation(activation)
    if entry.takes_scale:
        if tanh_clamp_scale is None or not tanh_clamp_scale > 0:
            raise ValueError(f"tanh_clamp_scale must be a positive float for {activation}; got {tanh_clamp_scale!r}")
    elif tanh_clamp_scale is not None:
        takes = [n for n in activation_names() if get_activation(n).takes_scale]
        raise ValueError(f"tanh_clamp_scale applies only to activations that take a scale {takes}; "
                         f"got it with {activation!r}")
    for name, t, ndim, layout in (
        ("x", x, 2, "(T, H)"),
        ("fc1_weight", fc1_weight, 3, "(G, F1, H)"),
        ("fc2_weight", fc2_weight, 3, "(G, H, F)"),
    ):
        check_dtype(name, t, (torch.bfloat16,))
        check_ndim(name, t, ndim, layout)
    groups, f1, hidden = fc1_weight.shape
    if fc2_weight.shape[0] != groups:
        raise ValueError(
            f"fc1_weight has {groups} experts but fc2_weight has {fc2_weight.shape[0]} (mismatched expert counts)"
        )
    check_group_sizes_meta(group_sizes, groups)
    if x.shape[1] != hidden:
        raise ValueError(f"x.shape[1] ({x.shape[1]}) must equal fc1_weight.shape[2] (H = {hidden})")
    if fc2_weight.shape[1] != hidden:
        raise ValueError(f"fc2_weight.shape[1] ({fc2_weight.shape[1]}) must equal H = {hidden}")
    ffn = f1 // 2 if entry.gated else f1
    if entry.gated and f1 % 2:
        raise ValueError(f"{activation} needs an even fc1_weight.shape[1] (gate and up halves); got {f1}")
    if fc2_weight.shape[2] != ffn:
        raise ValueError(
            f"fc2_weight.shape[2] ({fc2_weight.shape[2]}) must equal F = {ffn} "
            f"(fc1_weight.shape[1] = {f1} with activation={activation!r})"
        )
    check_multiple_of_16("H (hidden)", hidden)
    check_multiple_of_16("F (ffn)", ffn)
    if probs is not None:
        check_dtype("probs", probs, (torch.float32, torch.bfloat16))
        # guard_or_false: with data-dependent row counts the two may be different unbacked
        # symbols; no guard is taken on them (the ops check values at run time)
        if probs.dim() != 1 or guard_or_false(probs.shape[0] != x.shape[0]):
            raise ValueError(f"probs must be (T,) = ({x.shape[0]},); got shape {tuple(probs.shape)}")
    check_same_device(x, fc1_weight=fc1_weight, fc2_weight=fc2_weight, group_sizes=group_sizes, probs=probs)
