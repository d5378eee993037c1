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
