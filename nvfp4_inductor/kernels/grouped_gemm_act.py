"""fc1 forward in one launch: the grouped NVFP4 GEMM with the activation in its epilogue,
bit for bit the unfused chain

    C = kernels.grouped_gemm_via_bf16(a, b_W1)               (T, F1) bf16, saved for backward
    D = kernels.activation.activation_forward(C, p, act)     (T, F)  bf16, the fc2 input

Kernel ``_grouped_gemm_act_kernel``; launcher ``grouped_gemm_act``; op
``nvfp4_kernels::grouped_gemm_act``. Its reference is that chain (numerics.grouped_gemm_torch,
activations.activation_forward), up to the GEMM's fp32 summation order, which is
grouped_gemm_via_bf16's (same tile config, same K loop).

D's amaxes are not computed here: ``group_hadamard_amax`` reads D once after this kernel.
An epilogue that stored D, then read each tile back for its post-RHT amax, cost more than
that pass (docs/decisions.md, "GEMM operands": the read-back made ptxas spill), so the
Triton target does not offer
``Capabilities.fused_amax``.

Why the bits match:
* C: the launcher dequantizes both operands to transient bf16 deq() copies
  in one launch (``dequantize.dequantize_bf16_pair``, as ``grouped_gemm_via_bf16`` does),
  and the kernel calls ``grouped_gemm_bf16.bf16_tile_acc(s)`` -- the K loop of
  ``_grouped_gemm_bf16_kernel``, one copy for the three kernels (natural K order, so the
  tile config -- ``bf16_gemm_config("act")``, which may differ from the unfused GEMM's --
  changes no bit), then bf16(acc * alpha_g) with
  RNE (``gemm_common.gemm_out_bits``, the unfused kernel's ``store_bf16`` value).
* D: the activation reads the bf16-rounded C (``widen`` of its bits, so no multiply of
  the epilogue can be contracted with anything of the activation) and
  calls ``activation.act_fwd_math`` (the same function the unfused kernel calls); then bf16
  with RNE (``_nvfp4.bf16_round``).

SwiGLU: program (tm, tn) owns D's columns tn * BN + [0, BN) and computes both halves of
C that feed them (gate columns j, up columns F + j) in one K loop with two accumulators
(``grouped_gemm_bf16.bf16_tile_accs``: each x tile loaded once for both, where two K loops
loaded it twice; docs/decisions.md, "GEMM operands"). When F % BN != 0 the up
column F + j sits at another position of its tile than in the unfused GEMM, so the bits
match only if an MMA's result for an element does not depend on its column in the tile:
true of the interpreter (``grouped_gemm_bf16._mma`` sums each K step exactly) and of the
H200 (tests/test_kernels_epilogue.py::test_gpu_k_order_and_unaligned_f, also with act/dact
tiles narrower than the unfused GEMM's).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..sizes import is_zero
from ..tensor import Operand
from ._nvfp4 import bf16_round, to_float32
from ._registry import INTERPRET, kernel_op, launch, next_power_of_2
from .activation import _act_code, _clamp, act_fwd_math, is_gated
from .config import bf16_gemm_config
from .dequantize import bf16_operands
from .gemm_common import check_gemm_operands, gemm_alpha, gemm_out_bits, num_programs, tile_coords, tile_table
from .grouped_gemm_bf16 import bf16_tile_acc, bf16_tile_accs, use_tma

# ---------------------------------------------------------------------------------------
# Device helpers shared with grouped_gemm_dact.py


@triton.jit
def widen(bits):
    """uint16 bf16 bits -> the exact fp32 value (integer ops: no contraction across it)."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def store_bits(ptrs, bits, mask):
    tl.store(ptrs, bits.to(tl.bfloat16, bitcast=True), mask=mask)


# ---------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _grouped_gemm_act_kernel(
    a_ptr, a_amax_ptr, b_ptr, b_amax_ptr, sizes_ptr, p_ptr,
    c_ptr, d_ptr,
    F, K, G, clamp,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_PROBS: tl.constexpr, GPU: tl.constexpr,
    BLOCK_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    BAND: tl.constexpr,
):
    """a (T, K) bf16, b (G, F1, K) bf16 (deq() values); C (T, F1), D (T, F) bf16."""
    sizes = tl.load(sizes_ptr + tl.arange(0, BLOCK_G), mask=tl.arange(0, BLOCK_G) < G, other=0)
    gi, sizes, m_tiles, n_tiles, tile_end, row_end, total = tile_table(sizes, F, G, BLOCK_G, BM, BN)
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
        grp, tm, tn, size, row0 = tile_coords(tile, gi, sizes, m_tiles, n_tiles, tile_end, row_end, BAND)
        rows = tm * BM + tl.arange(0, BM)
        cols = tn * BN + tl.arange(0, BN)
        row_ok = rows < size
        col_ok = cols < F
        mask = row_ok[:, None] & col_ok[None, :]
        arow = (row0 + rows).to(tl.int64)
        alpha = gemm_alpha(a_amax_ptr, b_amax_ptr, grp)
        if GATED:
            b0 = grp.to(tl.int64) * (2 * F)  # W1's gate rows b0 + [0, F), up rows b0 + F + [0, F)
            c_ptrs = c_ptr + arow[:, None] * (2 * F) + cols[None, :]
            acc, acc_up = bf16_tile_accs(a_ptr, b_ptr, row0, size, tm * BM, b0, b0 + F, F, tn * BN, K,
                                         BM, BN, BK, NUM_STAGES, EVEN_K, TMA, True)
            gate = gemm_out_bits(acc, alpha)
            store_bits(c_ptrs, gate, mask)
            up = gemm_out_bits(acc_up, alpha)
            store_bits(c_ptrs + F, up, mask)
            f = act_fwd_math(widen(gate), widen(up), clamp, ACT, GATED, GPU)
        else:
            acc = bf16_tile_acc(a_ptr, b_ptr, row0, size, tm * BM, grp.to(tl.int64) * F, F, tn * BN, K,
                                BM, BN, BK, NUM_STAGES, EVEN_K, TMA)
            cb = gemm_out_bits(acc, alpha)
            store_bits(c_ptr + arow[:, None] * F + cols[None, :], cb, mask)
            c = widen(cb)
            f = act_fwd_math(c, c, clamp, ACT, GATED, GPU)
        if HAS_PROBS:
            f = f * to_float32(tl.load(p_ptr + arow, mask=row_ok, other=0.0))[:, None]
        d = bf16_round(f)
        store_bits(d_ptr + arow[:, None] * F + cols[None, :], (d.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16),
                   mask)


# ---------------------------------------------------------------------------------------
# Op and launcher


def epilogue_config(kind: str, act: int, device: torch.device):
    """``bf16_gemm_config(kind)`` for a fused kernel ("act" or "dact"), checked for what the
    dact epilogue needs: each of its column slices (BN / epilogue_split) a multiple of 16
    (dprob's runs of 16 columns)."""
    cfg = bf16_gemm_config(kind, device, swiglu=is_gated(act))
    if cfg.epilogue_split not in (1, 2, 4):
        raise ValueError(f"fused GEMM epilogues: epilogue_split must be 1, 2 or 4, got {cfg}")
    if (cfg.block_n // cfg.epilogue_split) % 16 or cfg.block_n % cfg.epilogue_split:
        raise ValueError(f"fused GEMM epilogues need block_n / epilogue_split a multiple of 16, got {cfg}")
    return cfg


@kernel_op("nvfp4_kernels::grouped_gemm_act")
def _grouped_gemm_act_op(
    a: torch.Tensor, a_amax: torch.Tensor, b: torch.Tensor, b_amax: torch.Tensor,
    group_sizes: torch.Tensor, probs: Optional[torch.Tensor], act: int, clamp: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a (T, K) bf16, b (G, F1, K) bf16 (deq() values); every tensor contiguous. Returns
    (C (T, F1), D (T, F) bf16)."""
    tokens, k = a.shape
    groups, f1, _ = b.shape
    gated = is_gated(act)
    f = f1 // 2 if gated else f1
    c = a.new_empty(tokens, f1, dtype=torch.bfloat16)
    d = a.new_empty(tokens, f, dtype=torch.bfloat16)
    if is_zero(tokens) or f == 0 or groups == 0:
        return c, d
    cfg = epilogue_config("act", act, a.device)
    programs = num_programs(cfg, a.device)
    launch(
        _grouped_gemm_act_kernel, (programs,),
        a_ptr=a, a_amax_ptr=a_amax, b_ptr=b, b_amax_ptr=b_amax, sizes_ptr=group_sizes,
        p_ptr=probs,
        c_ptr=c, d_ptr=d, F=f, K=k, G=groups, clamp=clamp,
        ACT=act, GATED=gated, HAS_PROBS=probs is not None, GPU=not INTERPRET,
        BLOCK_G=max(next_power_of_2(groups), 2), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        NUM_PROGRAMS=programs, NUM_STAGES=cfg.num_stages,
        EVEN_K=k % cfg.block_k == 0, TMA=use_tma(cfg, a.device, k), BAND=cfg.band_m,
        num_warps=cfg.num_warps,
    )
    return c, d


def grouped_gemm_act(
    a: Operand,
    b: Operand,
    group_sizes: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    tanh_clamp_scale: Optional[float],
    d_cast,
    *,
    want_amax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    """fc1 + activation: (C, D, None, None) -- ``Steps.fc1_act_amax`` without D's amaxes
    (this kernel has none to give: `d_cast` and `want_amax` are the step's arguments,
    and want_amax=True raises), bit for bit

        C = grouped_gemm_via_bf16(a, b, group_sizes)
        D = activation.activation_forward(C, probs, activation, tanh_clamp_scale)

    a: x's row-wise grouped copy (T, H/2), (T, H/16), amax (G,); b: W1's row-wise copies
    (G, F1, H/2), (G, F1, H/16), amax (G,), F1 = 2F for SwiGLU (gate rows first). The bf16
    deq() copies of a and b (``dequantize_bf16_pair``) live only inside this call."""
    (a_data, a_scale, a_amax), (b_data, b_scale, b_amax) = a, b
    if want_amax:
        raise ValueError("grouped_gemm_act: want_amax=True, but the Triton fc1 kernel does not compute D's amaxes "
                         "(the Triton target has no fused_amax capability); run group_hadamard_amax on D")
    check_gemm_operands("grouped_gemm_act", a_data, a_scale, b_data, b_scale, group_sizes)
    act, clamp = _act_code(activation), _clamp(activation, tanh_clamp_scale)
    if is_gated(act) and b_data.shape[1] % 2:
        raise ValueError(f"grouped_gemm_act: {activation} needs an even F1, got {b_data.shape[1]}")
    if probs is not None and probs.shape != (a_data.shape[0],):
        raise ValueError(f"grouped_gemm_act: probs must be ({a_data.shape[0]},), got {tuple(probs.shape)}")
    a, b = bf16_operands(a_data, a_scale, b_data, b_scale)
    c, d = _grouped_gemm_act_op(
        a, a_amax.float().contiguous(), b, b_amax.float().contiguous(), group_sizes.contiguous(),
        probs.contiguous() if probs is not None else None, act, clamp,
    )
    return c, d, None, None
