"""The grouped MLP's activations, forward and backward, in fp32 (SPEC.md section 5).

Every kernel epilogue reproduces these formulas operation for operation; the operation
order written here is the contract. Inputs are GEMM outputs already rounded to bf16
(C, and G = the fc2 dgrad), so a fused kernel, the unfused chain and the backward
recompute all start from the same bits.

    D  = bf16(f(float(C)) * p)                  p = router prob (fp32) or 1
    dC = bf16((float(G) * p) * f'(float(C)))    (SwiGLU: per half, below)
    dp = sum_n float(G) * f(float(C))           (order: ``row_sum``)

SReLU:       r = relu(c);            f = r * r;  f' = 2 * r
tanh-SReLU:  t = tanh(relu(c) / s);  b = s * t;  f = b * b;  f' = (2 * b) * (1 - t * t)
SwiGLU:      c = [a | u] (gate a = first half of the columns, up u = second half)
             sg = sigmoid(a); si = a * sg;  f = si * u
             df/da = u * (sg * (1 + a * (1 - sg)));  df/du = si
"""

from __future__ import annotations

from typing import Optional

import torch

from .constants import BLOCK

ACTIVATIONS = ("srelu", "tanh_srelu", "swiglu")


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (the contract); fp64 stays fp64 so gradcheck can run."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _act_fwd(c: torch.Tensor, activation: str, tanh_clamp_scale: Optional[float]) -> torch.Tensor:
    if activation == "srelu":
        r = torch.relu(c)
        return r * r
    if activation == "tanh_srelu":
        b = tanh_clamp_scale * torch.tanh(torch.relu(c) / tanh_clamp_scale)
        return b * b
    a, u = c.chunk(2, dim=-1)
    return (a * torch.sigmoid(a)) * u


def activation_forward(
    c: torch.Tensor, probs: Optional[torch.Tensor], activation: str, tanh_clamp_scale: Optional[float] = None
) -> torch.Tensor:
    """D = bf16(f(float(C)) * p); C (T, F1) bf16, probs (T,) or None; D (T, F) in C's dtype."""
    dtype = compute_dtype(c)
    f = _act_fwd(c.to(dtype), activation, tanh_clamp_scale)
    if probs is not None:
        f = f * probs.to(dtype).unsqueeze(1)
    return f.to(c.dtype)


def row_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum each row of a (T, N) matrix in the pinned order used by every kernel:
    within each run of 16 columns a halving tree (x[:8] + x[8:], then 4, 2, 1), then the
    run totals added left to right. Deterministic on every device; no atomics."""
    t, n = v.shape
    part = v.reshape(t, n // BLOCK, BLOCK)
    width = BLOCK
    while width > 1:
        width //= 2
        part = part[..., :width] + part[..., width:]
    part = part.squeeze(-1)  # (T, N/16)
    total = torch.zeros(t, dtype=v.dtype, device=v.device)
    for j in range(part.shape[1]):
        total = total + part[:, j]
    return total


def activation_backward(
    g: torch.Tensor,
    c: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    tanh_clamp_scale: Optional[float] = None,
    *,
    regenerate: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """From G = dL/dD (T, F) bf16 and the saved pre-activation C (T, F1) bf16:
    dC (T, F1) in C's dtype, dp (T,) fp32 (None without probs) and, when `regenerate`, D exactly
    as ``activation_forward`` made it (the backward recompute of the fc2 input)."""
    dtype = compute_dtype(c)
    gf, cf = g.to(dtype), c.to(dtype)
    p = probs.to(dtype).unsqueeze(1) if probs is not None else None
    gp = gf * p if p is not None else gf
    if activation == "swiglu":
        a, u = cf.chunk(2, dim=-1)
        sg = torch.sigmoid(a)
        si = a * sg
        f = si * u
        dc = torch.cat((gp * (u * (sg * (1 + a * (1 - sg)))), gp * si), dim=-1)
    elif activation == "srelu":
        r = torch.relu(cf)
        f = r * r
        dc = gp * (2 * r)
    else:
        s = tanh_clamp_scale
        t = torch.tanh(torch.relu(cf) / s)
        b = s * t
        f = b * b
        dc = gp * ((2 * b) * (1 - t * t))
    dp = row_sum(gf * f) if probs is not None else None
    d = None
    if regenerate:
        d = (f * p if p is not None else f).to(c.dtype)
    return dc.to(c.dtype), dp, d
