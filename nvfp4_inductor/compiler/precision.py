"""Which grouped-MLP sites train in NVFP4, and with which recipe: the precision policy.

NVIDIA's NVFP4 pretraining recipe keeps a few layers in BF16 (mostly the last blocks) and
may move whole layers back to BF16 late in training; TransformerEngine takes a recipe per
module. ``Precision`` says the same for a compiled model, per site:

    nv.backend(precision=nv.Precision(
        bf16=("model.layers.0.*",),          # module-path globs kept in BF16
        last_moe_layers_bf16=1,              # the last N MoE layers in BF16 (first_... likewise)
        keep_bf16=lambda site: site.ffn < 256,   # a predicate over SiteInfo
        recipes={"*.layers.3.*": nv.Recipe(stochastic_rounding=False)},  # per-site recipe
    ))

A site kept in BF16 is not rewritten: Inductor compiles the user's own ops for it, exactly
as stock ``torch.compile`` does (a ``GroupedMLP``, NVFP4 by construction, becomes
``bf16_grouped_mlp``). The first rule that keeps a site names it in ``explain``.

A site's module path is the innermost module of the nodes it matched (``nn_module_stack``),
as ``model.named_modules()`` spells it ("model.layers.3.mlp.experts"); its layer is the first
integer in that path (transformers' ``model.layers.N``, torchtitan's ``layers.N``), and its
MoE layer its rank among the distinct layers of the sites the backend sees in one graph
(counted from 0), so "the last N" counts the graph's MoE layers unless ``moe_layers`` says
how many the model has (needed when graph breaks split the layers over several graphs).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import warnings
from typing import Callable, Mapping, Optional, Sequence

import torch

from ..activations import activation_forward, get_activation
from ..recipe import Recipe
from .legality import weight_shape
from .site import Site


@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """What a precision rule sees of a site.

    path: its module path ("model.layers.3.mlp.experts"; "" where the graph has none).
    layer: the first integer in the path (None if there is none).
    moe_layer / moe_layers: its MoE layer, counted from 0, and how many there are.
    activation, experts, hidden, ffn: the block's activation, G, H and F.
    """

    path: str
    layer: Optional[int]
    moe_layer: int
    moe_layers: int
    activation: str
    experts: int
    hidden: int
    ffn: int


@dataclasses.dataclass(frozen=True)
class SiteDecision:
    """What the policy decided for one site: NVFP4 (with `recipe`, None: the backend's) or
    BF16, and the rule that decided it, for ``explain``."""

    info: SiteInfo
    nvfp4: bool
    rule: str
    recipe: Optional[Recipe] = None


@dataclasses.dataclass(frozen=True)
class Precision:
    """The precision policy (a backend option): every site NVFP4 unless a rule keeps it in BF16.

    bf16: module-path globs (``fnmatch``: ``*`` crosses dots) whose sites stay in BF16.
    first_moe_layers_bf16 / last_moe_layers_bf16: the first / last N MoE layers stay in BF16.
    keep_bf16: a predicate over ``SiteInfo``; True keeps the site in BF16.
    recipes: module-path glob -> ``Recipe`` for the sites it matches that run NVFP4 (the
        first glob that matches wins, over the backend's recipe and a GroupedMLP's own).
    moe_layers: how many MoE layers the model has (default: those in the compiled graph).
    """

    bf16: Sequence[str] = ()
    first_moe_layers_bf16: int = 0
    last_moe_layers_bf16: int = 0
    keep_bf16: Optional[Callable[[SiteInfo], bool]] = None
    recipes: Mapping[str, Recipe] = dataclasses.field(default_factory=dict)
    moe_layers: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.bf16, str) or not all(isinstance(g, str) for g in self.bf16):
            raise ValueError(f"Precision.bf16 must be a sequence of glob strings; got {self.bf16!r}")
        object.__setattr__(self, "bf16", tuple(self.bf16))
        for name in ("first_moe_layers_bf16", "last_moe_layers_bf16"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Precision.{name} must be an int >= 0; got {value!r}")
        if self.moe_layers is not None and (not isinstance(self.moe_layers, int) or self.moe_layers < 1):
            raise ValueError(f"Precision.moe_layers must be a positive int or None; got {self.moe_layers!r}")
        if self.keep_bf16 is not None and not callable(self.keep_bf16):
            raise ValueError(f"Precision.keep_bf16 must be callable (SiteInfo -> bool); got {self.keep_bf16!r}")
        if not isinstance(self.recipes, Mapping) or not all(
                isinstance(k, str) and isinstance(v, Recipe) for k, v in self.recipes.items()):
            raise ValueError(f"Precision.recipes must map glob strings to nvfp4_inductor.Recipe; got {self.recipes!r}")
        object.__setattr__(self, "recipes", dict(self.recipes))

    def decide(self, infos: Sequence[SiteInfo]) -> list[SiteDecision]:
        """One decision per site, in order; warns about a rule that selects nothing."""
        decisions = [self._decide(info) for info in infos]
        if infos:
            self._warn_unused(infos)
        return decisions

    def _decide(self, info: SiteInfo) -> SiteDecision:
        for glob in self.bf16:
            if fnmatch.fnmatchcase(info.path, glob):
                return SiteDecision(info, False, f"bf16 glob {glob!r}")
        if info.moe_layer < self.first_moe_layers_bf16:
            return SiteDecision(info, False, f"first_moe_layers_bf16={self.first_moe_layers_bf16}")
        if info.moe_layer >= info.moe_layers - self.last_moe_layers_bf16:
            return SiteDecision(info, False, f"last_moe_layers_bf16={self.last_moe_layers_bf16}")
        if self.keep_bf16 is not None and self.keep_bf16(info):
            return SiteDecision(info, False, f"keep_bf16 predicate {getattr(self.keep_bf16, '__name__', '')}".rstrip())
        for glob, recipe in self.recipes.items():
            if fnmatch.fnmatchcase(info.path, glob):
                return SiteDecision(info, True, f"recipes glob {glob!r}", recipe)
        return SiteDecision(info, True, "default")

    def _warn_unused(self, infos: Sequence[SiteInfo]) -> None:
        """A rule that can select no site of this graph is most likely a typo: say so."""
        paths = [info.path for info in infos]
        unused = [f"glob {g!r}" for g in (*self.bf16, *self.recipes)
                  if not any(fnmatch.fnmatchcase(p, g) for p in paths)]
        layers = infos[0].moe_layers
        for name in ("first_moe_layers_bf16", "last_moe_layers_bf16"):
            if getattr(self, name) > layers:
                unused.append(f"{name}={getattr(self, name)} (the graph has {layers} MoE layers)")
        if unused:
            warnings.warn(f"nvfp4 precision policy: {', '.join(unused)} matched none of this graph's "
                          f"{len(infos)} grouped-MLP sites ({', '.join(paths)}); see nv.explain", stacklevel=2)


def module_path(site: Site) -> str:
    """The site's module path as ``named_modules()`` spells it: the deepest module that holds
    at least half of the nodes it matched (Dynamo's ``nn_module_stack``; the experts module
    rather than its MoE block, which only applies the prob, nor one expert of a loop)."""
    paths = [_named(list(stack.values())[-1][0]) for node in (site.output, *site.nodes)
             if (stack := node.meta.get("nn_module_stack"))]
    if not paths:
        return ""
    under: dict[str, int] = {}
    for path in paths:
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            under[prefix] = under.get(prefix, 0) + 1
    return max((p for p, n in under.items() if 2 * n >= len(paths)), key=lambda p: (p.count(".") + bool(p), p))


def _named(path: str) -> str:
    """Dynamo's module path ("L['self'].model.layers[0]") as ``named_modules()`` spells it,
    without the compiled frame's local ("L['self']"; a module argument keeps its name)."""
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", path)  # L['self'] -> L.self, layers[0] -> layers.0
    path = re.sub(r"^L\.self\.?", "", path)
    return re.sub(r"^L\.", "", path)


def site_infos(sites: Sequence[Site], moe_layers: Optional[int] = None) -> list[SiteInfo]:
    """Each site's ``SiteInfo``: MoE layers are the distinct layers of `sites` in order
    (sites without a layer index count one each, in graph order)."""
    paths = [module_path(site) for site in sites]
    layers = [_layer(path) for path in paths]
    keys = [layer if layer is not None else ("site", i) for i, layer in enumerate(layers)]
    order = sorted(set(keys), key=lambda k: (1, k[1]) if isinstance(k, tuple) else (0, k))
    rank = {k: i for i, k in enumerate(order)}
    infos = []
    for site, path, layer, key in zip(sites, paths, layers, keys):
        g, h, f = weight_shape(site.fc2_weight)
        infos.append(SiteInfo(path, layer, rank[key], moe_layers or len(order), site.activation, g, h, f))
    return infos


def _layer(path: str) -> Optional[int]:
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return int(match.group(1)) if match else None


def bf16_grouped_mlp(x, fc1_weight, fc2_weight, group_sizes, probs, *, activation: str,
                     tanh_clamp_scale: Optional[float]) -> torch.Tensor:
    """A ``GroupedMLP`` site kept in BF16: its block with BF16 grouped GEMMs
    (``torch._grouped_mm``, fp32 accumulation) and the activation's reference math in fp32
    (``activations.activation_forward``), as the plain-PyTorch spellings compute it."""
    get_activation(activation)
    offsets = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    c = torch._grouped_mm(x, fc1_weight.transpose(-2, -1), offs=offsets)
    d = activation_forward(c, probs, activation, tanh_clamp_scale)
    return torch._grouped_mm(d, fc2_weight.transpose(-2, -1), offs=offsets)
