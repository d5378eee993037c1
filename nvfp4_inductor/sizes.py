"""Sizes as plain ints for heuristics that must not specialize a compiled graph."""

from __future__ import annotations

from typing import Optional

import torch


def size_hint(n) -> Optional[int]:
    """A size as an int for a heuristic's choice: a traced symbolic size gives the value of
    the example being traced, with no guard on it, so one compiled graph serves every size
    (the choices made with it -- tiles, the order of independent GEMMs -- change no bit).
    None for an unbacked size (data-dependent: no example value), which the kernels' tile
    heuristics never see (``lowerings/inline._sizes_known``) and the others must handle."""
    return n.node.hint if isinstance(n, torch.SymInt) else int(n)


def weight_copy_slices(tokens, weight_rows: int) -> int:
    """How many slices a GEMM's bf16 copy of a packed expert weight stack is made in, one
    after the other, where bf16 tensor cores need the copy (the Triton target's dgrad,
    kernels/grouped_gemm_bf16.py): enough that each slice is at most half the size of the
    token operand's copy (both copies are K wide: `weight_rows` = G x N rows against
    `tokens` rows), at most 8, since each slice is two more launches. That copy is the
    excess over BF16 at the backward's memory peak (BF16 holds the token-side gradient there
    too, but no bf16 copy of a weight). 1 (the whole copy) for a data-dependent token count.
    At the benchmark shapes: S1 4, S3 4, S4 8, S2 1 (benchmarks/NOTES.md)."""
    hint = size_hint(tokens)
    if not hint:
        return 1
    return min(max(-(-2 * weight_rows // hint), 1), 8)
