"""What a matcher found: a grouped-MLP ``Site`` to rewrite, or a ``Rejection`` saying why not.

A Site describes the user's operands *as the user holds them* (per-expert or stacked
weights, (out, in) or (in, out) layout, offsets or sizes) and the region of the Dynamo
graph they computed; ``rewrite.rewrite_sites`` turns it into the canonical call

    make_call(x, fc1_weight, fc2_weight, group_sizes, probs,
              *, activation, tanh_clamp_scale) -> y

    x            (T, H) bf16, rows sorted by expert
    fc1_weight   (G, F1, H) bf16, nn.Linear layout; F1 = F, or 2F for a gated activation
                 (swiglu: rows 0..F-1 the gate that silu is applied to, F..2F-1 the up)
    fc2_weight   (G, H, F) bf16, nn.Linear layout
    group_sizes  (G,) int32 on x's device (rows per expert, no host values)
    probs        (T,) router probabilities, or None
    y            (T, H) bf16 = fc2(f(fc1(x)) * probs) per group
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from typing import Literal, Union

import torch.fx

from ..activations import get_activation
from .nodes import RowMask

Spelling = Literal["token_permutation", "grouped_mm", "expert_loop", "bmm", "grouped_mlp_module", "library_op"]
WeightLayout = Literal["out_in", "in_out"]


@dataclasses.dataclass(frozen=True)
class Weight:
    """One expert weight of the MLP as the user's graph holds it.

    nodes: ``(W,)`` for one expert-stacked tensor W of shape (G, a, b), or G nodes of
        shape (a, b), one per expert in expert order (a ModuleList of nn.Linear, a
        Python list of parameters); the rewrite stacks those with ``torch.stack``.
    layout: "out_in" when (a, b) = (out features, in features) (nn.Linear, F.linear),
        "in_out" when (a, b) = (in, out) (``x @ W``, ``_grouped_mm(x, W)``, ``bmm(x, W)``);
        the rewrite transposes "in_out" weights to the canonical "out_in".
    """

    nodes: tuple[torch.fx.Node, ...]
    layout: WeightLayout

    @property
    def stacked(self) -> bool:
        return len(self.nodes) == 1


@dataclasses.dataclass(frozen=True)
class GroupSizes:
    """Where the rows per expert come from; the rewrite turns each kind into a (G,) int32
    tensor on the device without host values.

    kind "offsets": ``source`` is a (G,) int tensor node of cumulative group ends
        (``offs`` of ``_grouped_mm``); sizes = ``torch.diff(offs, prepend=[0])``.
    kind "sizes": ``source`` is a (G,) int tensor node of rows per expert (the counts a
        user took ``.tolist()`` of, or the group_sizes of ``nvfp4_inductor.grouped_mlp``).
    kind "split": ``source`` is a tuple of G python ints or SymInt nodes (the
        ``split_size_or_sections`` of ``torch.split``), built with ``torch.tensor``.
    kind "equal": ``source`` is None; x is a (G, T/G, H) batch (``torch.bmm``) and every
        group has T/G rows.
    """

    kind: Literal["offsets", "sizes", "split", "equal"]
    source: Union[torch.fx.Node, tuple, None]
    count: int  # G, the number of experts


@dataclasses.dataclass(frozen=True)
class Site:
    """One recognised grouped MLP: fc1 grouped GEMM -> activation (x prob) -> fc2 grouped GEMM.

    x: the node of the expert input, (T, H) bf16 sorted by expert, or for ``bmm`` the
        (G, T/G, H) batch (``x_batched``).
    fc1_weight: fc1 weight; for a gated activation (swiglu) with one fused gate/up GEMM it
        holds both halves, with separate gate and up GEMMs (torchtitan's w1/w3, Mixtral's
        w1/w3) the gate only.
    fc1_up_weight: the up-projection weight when gate and up are separate GEMMs, else None.
    gate_second: a gated activation whose fused fc1 output gates with the SECOND half; the
        rewrite swaps the halves of fc1_weight so the gate comes first.
    fc2_weight: fc2 weight.
    group_sizes: where the rows per expert come from (GroupSizes).
    probs: node of the router probabilities, shaped (T,), (T, 1) or for bmm (G, T/G, 1);
        None when the MLP has none. Whether the user multiplied it on the activation or on
        the fc2 output (equal without an fc2 bias), the canonical call applies it on the
        activation.
    activation: the name of a registered activation (activations.py), e.g. "srelu"
        (relu(h)**2), "tanh_srelu" ((s * tanh(relu(h) / s))**2) or "swiglu" (silu(gate) * up).
    tanh_clamp_scale: the scale of an activation that takes one (tanh_srelu's s, a python
        float), else None.
    spelling: which user spelling matched ("token_permutation", "grouped_mm",
        "expert_loop", "bmm", "grouped_mlp_module").
    location: where the user wrote it: module path and file:line, from node meta.
    output: the node whose uses the canonical call takes over (the fc2 output, or the
        node that applied the prob to it, or the cat of the expert loop).
    nodes: every node the match consumed; those left without users after the rewrite are
        erased (a node also used elsewhere, e.g. a shared split, is kept).
    x_batched: x is a (G, T/G, H) batch (bmm); the rewrite flattens it and reshapes y back.
    row_masks: row masks on fc1's output (only for an activation that is 0 at 0,
        ``Activation.zero_at_zero``), on D or on fc2's output (``nodes.RowMask``); the
        rewrite folds them into probs as zeros (a ones prob when the site has none).
    """

    x: torch.fx.Node
    fc1_weight: Weight
    fc2_weight: Weight
    group_sizes: GroupSizes
    probs: torch.fx.Node | None
    activation: str
    tanh_clamp_scale: float | None
    spelling: Spelling
    location: str
    output: torch.fx.Node
    nodes: tuple[torch.fx.Node, ...]
    fc1_up_weight: Weight | None = None
    gate_second: bool = False
    x_batched: bool = False
    row_masks: tuple[RowMask, ...] = ()

    def __post_init__(self):
        entry = get_activation(self.activation, "Site.activation")
        if entry.takes_scale != (self.tanh_clamp_scale is not None):
            raise ValueError(
                f"Site.tanh_clamp_scale must be a float exactly for activations that take a scale, got "
                f"{self.tanh_clamp_scale!r} with activation {self.activation!r}"
            )
        if (self.fc1_up_weight is not None or self.gate_second) and not entry.gated:
            raise ValueError(f"Site: separate up weight / gate_second only apply to gated activations, "
                             f"got {self.activation!r}")


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A candidate grouped MLP left unchanged.

    spelling: the matcher that looked at it (same names as Site.spelling).
    location: where the user wrote it (see ``location_of``).
    reason: the rule that failed and the value found, e.g.
        "x is torch.float32; the fused grouped MLP takes torch.bfloat16".
    """

    spelling: str
    location: str
    reason: str


def location_of(node: torch.fx.Node) -> str:
    """``"<module path> (<file>:<line> in <fn>)"`` of the user code that produced ``node``:
    the innermost frame in the file that defines the innermost module of the node's module
    stack (for a transformers model, the model file's line that calls the experts, not
    ``integrations/moe.py`` or ``torch/nn/functional.py``); else in the file of the compiled
    code; else the innermost frame outside torch; else the innermost frame."""
    parts = []
    module_stack = node.meta.get("nn_module_stack")
    files = []
    if module_stack:
        for path, module_type in reversed(list(module_stack.values())):
            if not parts:
                parts.append(path)
            files.append(_source_file(module_type))
    frame = _user_frame(node.meta.get("stack_trace") or "", [f for f in files if f])
    if frame:
        parts.append(f"({frame})" if parts else frame)
    return " ".join(parts) or f"node {node.name}"


def _source_file(module_type) -> str | None:
    """The file that defines a module class (given as the class or its qualified name)."""
    if isinstance(module_type, str):
        module_name, _, class_name = module_type.rpartition(".")
        module_type = getattr(sys.modules.get(module_name), class_name, None)
    try:
        return os.path.realpath(inspect.getsourcefile(module_type))
    except TypeError:
        return None


_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep


def _frames(stack_trace: str) -> list[tuple[str, str, str]]:
    """``(file, line, fn)`` of each frame of a Dynamo ``stack_trace``, outermost first."""
    frames = []
    for line in stack_trace.strip().splitlines():
        line = line.strip()
        if line.startswith('File "'):
            file_part, _, rest = line[len('File "'):].partition('", line ')
            lineno, _, fn = rest.partition(", in ")
            frames.append((file_part, lineno, fn))
    return frames


def _user_frame(stack_trace: str, module_files: list[str]) -> str:
    """``file:line in fn`` of the frame ``location_of`` names."""
    frames = _frames(stack_trace)
    if not frames:
        return ""
    real = [(os.path.realpath(f), f, line, fn) for f, line, fn in frames]
    # the files of the module stack, innermost module first; then the compiled code's own
    # file (the outermost frame: the caller of a library's module built standalone)
    for module_file in [*module_files, real[0][0]]:
        for path, f, line, fn in reversed(real):
            if path == module_file:
                return f"{os.path.basename(f)}:{line} in {fn}"
    for path, f, line, fn in reversed(real):
        if not path.startswith(_TORCH_DIR):
            return f"{os.path.basename(f)}:{line} in {fn}"
    _, f, line, fn = real[-1]
    return f"{os.path.basename(f)}:{line} in {fn}"
