"""Library ops that may hold an expert block the backend cannot see into: reasons only.

A model library can run its experts inside its own torch.library op (a custom op is one
opaque node in the Dynamo graph). The ops whose function is known, a grouped GEMM with
``_grouped_mm``'s arguments, are matched as grouped GEMMs (``nodes.LIBRARY_GROUPED_GEMMS``,
match_grouped_mm.py); every other library op whose name says grouped GEMM, MoE or experts
is listed as a rejection, so ``explain`` never reports a MoE model with nothing to say::

    y = torch.ops.<namespace>.<name>(...)    # name contains grouped_mm / grouped_gemm /
                                             # moe / expert (any case)

Replacement: none.
"""

from __future__ import annotations

import re

import torch

from .nodes import LIBRARY_GROUPED_GEMMS, library_op
from .site import Rejection, Site, location_of

MOE_SHAPED = re.compile(r"grouped_?mm|grouped_?gemm|moe|expert", re.IGNORECASE)
OWN_NAMESPACES = ("nvfp4",)


def find_library_ops(gm: torch.fx.GraphModule) -> tuple[list[Site], list[Rejection]]:
    rejections = []
    for node in gm.graph.nodes:
        name = library_op(node)
        if name is None or name in LIBRARY_GROUPED_GEMMS or name.split("::")[0] in OWN_NAMESPACES:
            continue
        if MOE_SHAPED.search(name.split("::")[-1]):
            rejections.append(Rejection("library_op", location_of(node), (
                f"`{name}` is a library's own op: its body is opaque to the backend (the library ops "
                f"known to compute a grouped GEMM are {list(LIBRARY_GROUPED_GEMMS)})")))
    return [], rejections
