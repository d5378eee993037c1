"""Activations in Triton: the kernels of the activations that have a ``triton_code``. One of
three activation modules: ``activations.py`` holds the registry and the reference math,
``compiler/match_activation.py`` the FX spellings.

Twins of ``activations.activation_forward`` / ``activations.activation_backward`` (same
arguments, same return types), operation for operation in fp32 (numerics.md 5). The kernels
take two constexprs from the activation's registry entry: GATED (its ``gated`` flag: C is
[gate | up], 2F columns) picks the layout, ACT (its ``triton_code``) the math. Each code of
``activations.TRITON_BRANCHES`` has its own branch below, and the last ``else`` of every
chain is a static assertion: a code without a branch fails to compile instead of running
another activation's math (``register_activation`` refuses such codes first). An
activation registered without a code has no kernel here (``_act_code`` raises
NotImplementedError).

    forward:  D  = bf16(f(float(C)) * p)
    backward: dC = bf16((float(G) * p) * f'(float(C))),  dp = row_sum(float(G) * f(float(C))),
              D regenerated bit-exactly when asked (the fc2 input recompute)

Kernels ``_act_fwd_kernel`` (2-D grid over (T, F) tiles) and ``_act_bwd_kernel`` (one
program per BM rows, looping over F in BF-column chunks so dp is one deterministic
reduction per row, no atomics); ops ``nvfp4_kernels::activation_forward`` /
``nvfp4_kernels::activation_backward``.

Bits. SReLU is only relu, * and + (the dp sums), so it matches activations.py bit for bit
on every device, provided:
* relu(c) is ``c < 0 ? 0 : c`` (torch's CPU relu keeps -0.0 and NaN, so this does too);
* no product feeding an addition is contracted into an FMA: those products are written
  with ``mul.rn.f32`` inline PTX on the GPU (``_mul_rn``), which LLVM cannot fuse;
* dp follows ``activations.row_sum``: a halving tree inside each run of 16 columns
  (x[i] + x[i+8], then 4, 2, 1), run totals added to a zero-initialised total left to right;
* bf16 rounding is round-to-nearest-even (``_nvfp4.bf16_round``), as torch's cast.
tanh-SReLU and SwiGLU call tanh / exp (CUDA libdevice on the GPU, numpy in the
interpreter), which differ from torch's CPU implementations by a few fp32 ulps; the
division by the clamp scale and the sigmoid's 1 / (1 + e) are IEEE divisions (div_rn).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..activations import TRITON_BRANCHES, activation_names, get_activation
from ._nvfp4 import bf16_round, to_float32
from ._registry import INTERPRET, cdiv, kernel_op, launch, next_power_of_2

# The kernels' branches, one per entry of activations.TRITON_BRANCHES (the codes' one source).
_SRELU: tl.constexpr = tl.constexpr(TRITON_BRANCHES["srelu"].code)
_TANH_SRELU: tl.constexpr = tl.constexpr(TRITON_BRANCHES["tanh_srelu"].code)
_SWIGLU: tl.constexpr = tl.constexpr(TRITON_BRANCHES["swiglu"].code)


# ---------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _mul_rn(a, b, GPU: tl.constexpr):
    """a * b, never contracted into an FMA with a following add (the interpreter never does)."""
    if GPU:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _relu(c):
    return tl.where(c < 0.0, 0.0, c)  # torch.relu on CPU: keeps -0.0 and NaN


@triton.jit
def _tanh(x, GPU: tl.constexpr):
    """tanh of x >= 0 (or -0.0): libdevice on the GPU; in the interpreter (no libdevice)
    from exp, with the odd series below 0.01 where 1 - e would cancel."""
    if GPU:
        return libdevice.tanh(x)
    else:
        e = tl.exp(-2.0 * x)
        return tl.where(x < 0.01, x * (1.0 - x * x * 0.3333333432674408), (1.0 - e) / (1.0 + e))


@triton.jit
def _sigmoid(a, GPU: tl.constexpr):
    one = tl.zeros_like(a) + 1.0
    if GPU:
        return tl.math.div_rn(one, 1.0 + libdevice.exp(-a))
    else:
        return tl.math.div_rn(one, 1.0 + tl.exp(-a))


@triton.jit
def _store_bf16(ptrs, y, mask):
    bits = (bf16_round(y).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
    tl.store(ptrs, bits.to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def _halve(x, BM: tl.constexpr, NR: tl.constexpr, W: tl.constexpr):
    """(BM, NR, 2W) -> (BM, NR, W): x[..., i] + x[..., i + W] (one step of row_sum's tree)."""
    lo, hi = tl.split(tl.permute(tl.reshape(x, (BM, NR, 2, W)), (0, 1, 3, 2)))
    return lo + hi


@triton.jit
def _run_sums(v, BM: tl.constexpr, BF: tl.constexpr):
    """(BM, BF) -> (BM, BF/16): each run of 16 columns summed by the halving tree."""
    NR: tl.constexpr = BF // 16
    x = _halve(tl.reshape(v, (BM, NR, 16)), BM, NR, 8)
    x = _halve(x, BM, NR, 4)
    x = _halve(x, BM, NR, 2)
    x = _halve(x, BM, NR, 1)
    return tl.reshape(x, (BM, NR))


# ---------------------------------------------------------------------------------------
# Kernels


@triton.jit
def act_fwd_math(x, u, clamp, ACT: tl.constexpr, GATED: tl.constexpr, GPU: tl.constexpr):
    """f(C) of activations.activation_forward in fp32, operation for operation: x is C, or
    for a GATED activation the gate half with u the up half (u unused otherwise). The one
    copy of this math: the unfused kernel and the fused fc1 epilogue call it."""
    if GATED:
        if ACT == _SWIGLU:
            f = (x * _sigmoid(x, GPU)) * u
        else:
            tl.static_assert(False, "ACT is the code of no gated branch (activations.TRITON_BRANCHES)")
    else:
        if ACT == _SRELU:
            r = _relu(x)
            f = r * r
        elif ACT == _TANH_SRELU:
            clamp = tl.cast(clamp, tl.float32)  # (see act_bwd_tile)
            b = clamp * _tanh(tl.math.div_rn(_relu(x), tl.zeros_like(x) + clamp), GPU)
            f = b * b
        else:
            tl.static_assert(False, "ACT is the code of no branch (activations.TRITON_BRANCHES)")
    return f


@triton.jit
def act_fwd_rows(c_ptr, p_ptr, rows, row_ok, cols, col_ok, F, clamp,
                 ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, GPU: tl.constexpr):
    """f(C) * p of C's `rows` (int64) at `cols` in fp32, D before its bf16 rounding; masked
    elements are those of zero rows and columns (+0.0 for every built-in activation). The
    one copy of D's loads and math: the activation kernel calls it, and so does the cast
    that makes D as it loads it (group_cast's ACT_IN), which is why their D's are the same."""
    mask = row_ok[:, None] & col_ok[None, :]
    if GATED:
        gate_ptrs = c_ptr + rows[:, None] * (2 * F) + cols[None, :]
        a = to_float32(tl.load(gate_ptrs, mask=mask, other=0.0))
        u = to_float32(tl.load(gate_ptrs + F, mask=mask, other=0.0))
        f = act_fwd_math(a, u, clamp, ACT, GATED, GPU)
    else:
        c = to_float32(tl.load(c_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0))
        f = act_fwd_math(c, c, clamp, ACT, GATED, GPU)
    if HAS_PROBS:
        f = f * to_float32(tl.load(p_ptr + rows, mask=row_ok, other=0.0))[:, None]
    return f


@triton.jit
def _act_fwd_kernel(
    c_ptr, p_ptr, d_ptr, T, F, clamp,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, GPU: tl.constexpr,
    BM: tl.constexpr, BF: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BF + tl.arange(0, BF)
    rows64 = rows.to(tl.int64)
    f = act_fwd_rows(c_ptr, p_ptr, rows64, rows < T, cols, cols < F, F, clamp, ACT, GATED, HAS_PROBS, GPU)
    _store_bf16(d_ptr + rows64[:, None] * F + cols[None, :], f, (rows < T)[:, None] & (cols < F)[None, :])


@triton.jit
def act_bwd_tile(g, p, c_ptr, dc_ptr, d_ptr, rows64, cols, mask, F, clamp, ACT: tl.constexpr,
                 GATED: tl.constexpr, HAS_PROBS: tl.constexpr, REGEN: tl.constexpr, GPU: tl.constexpr):
    """The activation backward of one (rows, cols) tile of G (fp32 values of bf16 G), in
    activations.activation_backward's operation order: stores dC (both halves when GATED) and,
    when REGEN, the regenerated D; returns g * f (0 outside `mask`) for dprob's run sums.
    The one copy of this math: the unfused kernel and the fused fc2-dgrad epilogue call it."""
    if HAS_PROBS:
        gp = g * p
    else:
        gp = g
    if GATED:
        a_ptrs = c_ptr + rows64[:, None] * (2 * F) + cols[None, :]
        a = to_float32(tl.load(a_ptrs, mask=mask, other=0.0))
        u = to_float32(tl.load(a_ptrs + F, mask=mask, other=0.0))
        if ACT == _SWIGLU:
            sg = _sigmoid(a, GPU)
            si = a * sg
            f = si * u
            dca = gp * (u * (sg * (1.0 + _mul_rn(a, 1.0 - sg, GPU))))
            dcu = gp * si
        else:
            tl.static_assert(False, "ACT is the code of no gated branch (activations.TRITON_BRANCHES)")
        dc_ptrs = dc_ptr + rows64[:, None] * (2 * F) + cols[None, :]
        _store_bf16(dc_ptrs, dca, mask)
        _store_bf16(dc_ptrs + F, dcu, mask)
    else:
        c = to_float32(tl.load(c_ptr + rows64[:, None] * F + cols[None, :], mask=mask, other=0.0))
        if ACT == _SRELU:
            r = _relu(c)
            f = r * r
            dc = gp * (2.0 * r)
        elif ACT == _TANH_SRELU:
            # Triton's launcher passes a Python float as fp32; Inductor's generated launch
            # (traced launches) as fp64, which would make this math fp64. Both round the
            # same double to the same fp32 (the reference's scalar is fp32 too).
            clamp = tl.cast(clamp, tl.float32)
            t = _tanh(tl.math.div_rn(_relu(c), tl.zeros_like(c) + clamp), GPU)
            b = clamp * t
            f = b * b
            dc = gp * ((2.0 * b) * (1.0 - _mul_rn(t, t, GPU)))
        else:
            tl.static_assert(False, "ACT is the code of no branch (activations.TRITON_BRANCHES)")
        _store_bf16(dc_ptr + rows64[:, None] * F + cols[None, :], dc, mask)
    if REGEN:
        if HAS_PROBS:
            _store_bf16(d_ptr + rows64[:, None] * F + cols[None, :], f * p, mask)
        else:
            _store_bf16(d_ptr + rows64[:, None] * F + cols[None, :], f, mask)
    return tl.where(mask, _mul_rn(g, f, GPU), 0.0)


@triton.jit
def _act_bwd_kernel(
    g_ptr, c_ptr, p_ptr, dc_ptr, dp_ptr, d_ptr, T, F, clamp,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, REGEN: tl.constexpr, GPU: tl.constexpr,
    BM: tl.constexpr, BF: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    if HAS_PROBS:
        p = to_float32(tl.load(p_ptr + rows, mask=row_ok, other=0.0))[:, None]
    else:
        p = 1.0  # unused
    total = tl.zeros((BM,), dtype=tl.float32)
    run = tl.arange(0, BF // 16)
    for f0 in range(0, F, BF):
        cols = f0 + tl.arange(0, BF)
        mask = row_ok[:, None] & (cols < F)[None, :]
        g = to_float32(tl.load(g_ptr + rows64[:, None] * F + cols[None, :], mask=mask, other=0.0))
        gf = act_bwd_tile(g, p, c_ptr, dc_ptr, d_ptr, rows64, cols, mask, F, clamp, ACT, GATED, HAS_PROBS, REGEN,
                          GPU)
        if HAS_PROBS:
            runs = _run_sums(gf, BM, BF)
            for j in tl.static_range(BF // 16):  # run totals left to right (row_sum)
                total = total + tl.sum(tl.where(run[None, :] == j, runs, 0.0), axis=1)
    if HAS_PROBS:
        tl.store(dp_ptr + rows, total, mask=row_ok)


# ---------------------------------------------------------------------------------------
# Ops and launchers


def _blocks(F: int) -> tuple[int, int]:
    if INTERPRET:
        return 32, max(16, min(128, next_power_of_2(F)))
    return 32, 128


def _act_code(activation: str) -> int:
    """The ACT constexpr of `activation`: its registry entry's triton_code."""
    code = get_activation(activation).triton_code
    if code is None:
        raise NotImplementedError(f"activation {activation!r} has no Triton kernel (its triton_code is None); "
                                  f"the reference (activations.py) runs it")
    return code


def is_gated(act: int) -> bool:
    """The ``gated`` flag of the registered activation of Triton code `act` (C has 2F
    columns, [gate | up]): the kernels' GATED constexpr."""
    for name in activation_names():
        entry = get_activation(name)
        if entry.triton_code == act:
            return entry.gated
    raise ValueError(f"act must be the triton_code of a registered activation; got {act!r}")


def _clamp(activation: str, tanh_clamp_scale: Optional[float]) -> float:
    if get_activation(activation).takes_scale:
        if tanh_clamp_scale is None or not tanh_clamp_scale > 0:
            raise ValueError(f"{activation} needs tanh_clamp_scale > 0, got {tanh_clamp_scale!r}")
        return float(tanh_clamp_scale)
    return 1.0


@kernel_op("nvfp4_kernels::activation_forward")
def _activation_forward_op(c: torch.Tensor, probs: Optional[torch.Tensor], act: int, clamp: float) -> torch.Tensor:
    tokens, width = c.shape
    gated = is_gated(act)
    f = width // 2 if gated else width
    d = c.new_empty(tokens, f, dtype=torch.bfloat16)
    bm, bf = _blocks(f)
    launch(
        _act_fwd_kernel, (cdiv(tokens, bm), cdiv(f, bf)),
        c_ptr=c, p_ptr=probs, d_ptr=d, T=tokens, F=f, clamp=clamp,
        ACT=act, GATED=gated, HAS_PROBS=probs is not None, GPU=not INTERPRET, BM=bm, BF=bf, num_warps=4,
    )
    return d


@kernel_op("nvfp4_kernels::activation_backward")
def _activation_backward_op(
    g: torch.Tensor, c: torch.Tensor, probs: Optional[torch.Tensor], act: int, clamp: float, regenerate: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dC, dp or an empty (0,) fp32 tensor, D or an empty (0,) bf16 tensor)."""
    tokens, f = g.shape
    dc = c.new_empty(c.shape, dtype=torch.bfloat16)
    dp = c.new_empty(tokens if probs is not None else 0, dtype=torch.float32)
    d = c.new_empty((tokens, f) if regenerate else (0,), dtype=torch.bfloat16)
    bm, bf = _blocks(f)
    launch(
        _act_bwd_kernel, (cdiv(tokens, bm),),
        g_ptr=g, c_ptr=c, p_ptr=probs, dc_ptr=dc, dp_ptr=dp if probs is not None else None,
        d_ptr=d if regenerate else None, T=tokens, F=f, clamp=clamp,
        ACT=act, GATED=is_gated(act), HAS_PROBS=probs is not None, REGEN=regenerate, GPU=not INTERPRET,
        BM=bm, BF=bf, num_warps=4,
    )
    return dc, dp, d


def _check(c: torch.Tensor, activation: str, name: str) -> None:
    if c.dim() != 2 or c.dtype != torch.bfloat16:
        raise NotImplementedError(f"{name}: the Triton kernel takes 2-D bf16 C (GEMM outputs), got "
                                  f"{c.dtype} {tuple(c.shape)}; use activations.{name} for other dtypes")
    if get_activation(activation).gated and c.shape[1] % 2:
        raise ValueError(f"{name}: {activation} needs an even number of columns (gate and up), got {c.shape[1]}")


def activation_forward(
    c: torch.Tensor, probs: Optional[torch.Tensor], activation: str, tanh_clamp_scale: Optional[float] = None
) -> torch.Tensor:
    """D = bf16(f(float(C)) * p): the twin of ``activations.activation_forward`` (bf16 C)."""
    _check(c, activation, "activation_forward")
    act, clamp = _act_code(activation), _clamp(activation, tanh_clamp_scale)
    return _activation_forward_op(c.contiguous(), probs.contiguous() if probs is not None else None, act, clamp)


def activation_backward(
    g: torch.Tensor,
    c: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    tanh_clamp_scale: Optional[float] = None,
    *,
    regenerate: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(dC, dp or None, D or None): the twin of ``activations.activation_backward`` (bf16 G, C).
    With probs, F must be a multiple of 16 (row_sum's runs)."""
    _check(c, activation, "activation_backward")
    act, clamp = _act_code(activation), _clamp(activation, tanh_clamp_scale)
    f = c.shape[1] // 2 if is_gated(act) else c.shape[1]
    if g.shape != (c.shape[0], f):
        raise ValueError(f"activation_backward: g must be ({c.shape[0]}, {f}), got {tuple(g.shape)}")
    if probs is not None and f % 16:
        raise ValueError(f"activation_backward: dp sums runs of 16 columns; F = {f} is not a multiple of 16")
    dc, dp, d = _activation_backward_op(
        g.contiguous(), c.contiguous(), probs.contiguous() if probs is not None else None, act, clamp, regenerate
    )
    return dc, (dp if probs is not None else None), (d if regenerate else None)
