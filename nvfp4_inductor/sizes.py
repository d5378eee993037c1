"""Sizes as plain ints for heuristics that must not specialize a compiled graph."""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false


def size_hint(n) -> Optional[int]:
    """A size as an int for a heuristic's choice: a traced symbolic size gives the value of
    the example being traced, with no guard on it, so one compiled graph serves every size
    (the choices made with it -- tiles, the order of independent GEMMs -- change no bit).
    None for an unbacked size (data-dependent: no example value); ``tile_hint`` gives one."""
    return n.node.hint if isinstance(n, torch.SymInt) else int(n)


def tile_hint(n) -> int:
    """``size_hint`` for a tile or order heuristic, which needs some int: an unbacked size
    (data-dependent, e.g. the rows a rank receives under expert parallelism) takes
    Inductor's stand-in for such sizes (``unbacked_symint_fallback``, as its own kernels'
    heuristics do); the choice changes no bit."""
    hint = size_hint(n)
    if hint is None:
        from torch._inductor import config

        return config.unbacked_symint_fallback
    return hint


def is_zero(n) -> bool:
    """Whether a size is known to be 0, without a guard: False for a symbolic size that may
    be 0 or not (an empty-input exit is then not taken, and the launches' grids, empty at
    run time, launch nothing). (Plain ints first: launches outside tracing ask this of
    every grid dimension.)"""
    if isinstance(n, int):
        return n == 0
    return guard_or_false(n == 0)


# The fewest of out's columns a slice of a weight's bf16 copy is given: each slice's GEMM
# reads the whole token operand again, which narrower slices did not hide (the dgrads' weight
# copies in 256-column slices at S4 cost 0.3 ms a step; 1024-column ones at S1 nothing:
# docs/decisions.md, "Memory").
MIN_SLICE_ROWS = 1024


def copy_slices(tokens, groups: int, rows: int, min_rows: int = MIN_SLICE_ROWS) -> int:
    """How many slices of its rows (out's columns) the bf16 copy of a packed weight stack of
    `groups` experts x `rows` rows is made in, one after the other, beside the copy of a
    token operand of `tokens` rows (both copies K wide), where bf16 tensor cores need the
    copies (the Triton target's dgrads, kernels/grouped_gemm_bf16.py and
    grouped_gemm_dact.py): enough that each slice is at most half the token operand's copy,
    but no slice under `min_rows` rows and at most 8 (each slice is two more launches).
    At fc1's and fc2's dgrads the weight's copy is an excess over BF16 at the step's memory
    peak (BF16 holds the token-side gradient there too, no copy of a weight). 1 (the whole
    copy) for a data-dependent token count. fc1's dgrad at the benchmark shapes: S1 4, S2 1,
    S3 2, S4 2."""
    hint = size_hint(tokens)
    if not hint:
        return 1
    return max(min(-(-2 * groups * rows // hint), rows // min_rows, 8), 1)
