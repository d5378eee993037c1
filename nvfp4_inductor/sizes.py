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


def copy_slices(other_rows, rows: int) -> int:
    """How many slices of its rows a GEMM's bf16 copy of a packed operand of `rows` rows is
    made in, one after the other, beside the whole copy of its other operand (`other_rows`
    rows; both copies are K wide), where bf16 tensor cores need the copies (the Triton
    target, kernels/grouped_gemm_bf16.py): enough that each slice is at most half the other
    copy, at most 8, since each slice is two more launches. The sliced operands are fc1's
    dgrad's W1 (G x H rows against dC's T) and fc1's wgrad's x (H rows against dC's F1):
    at fc1's backward GEMMs, the step's memory peak, those copies are the excess over BF16,
    which holds dC there too but no copy of W1 or x. 1 (the whole copy) for a
    data-dependent size. Slices of fc1's dgrad at the benchmark shapes: S1 4, S3 4, S4 8,
    S2 1 (benchmarks/NOTES.md)."""
    hint = size_hint(other_rows)
    if not hint:
        return 1
    return min(max(-(-2 * rows // hint), 1), 8)
