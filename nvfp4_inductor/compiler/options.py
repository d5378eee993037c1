"""The backend's options: one frozen object, parsed once, unknown names rejected."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..lowerings.policy import CUDNN_MODES
from ..recipe import Recipe
from .precision import Precision


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """recipe: how every tensor is quantized (``Recipe``).
    recompute: the backward regenerates the fc2 input from the saved pre-activation and
        casts it with the forward's saved amax (numerics.md 6); False saves its column-wise copy.
        Bitwise-identical results either way.
    compiler: what compiles the rewritten graph. "inductor" (default) is the product;
        "aot_eager" runs the same rewrite, AOTAutograd and min-cut partition without
        Inductor's code generation: a bisecting aid, and fast to compile on CPU.
    trace_launches: where the site's target allows it (``Target.inline``: the Triton
        kernels on a GPU), the fused ops are traced as their kernel launches, which
        Inductor's generated code makes itself (``target_ops.py``; much less host
        time per step). False keeps every fused op one call (a fallback); torch's analysis
        of each traced launch while compiling is done once per distinct launch
        (``compiler/launch_analysis.py``); the results are the same bits either way.
    reuse_weight_casts: each weight stack's NVFP4 copies come from one opaque op
        (``nvfp4::quantize_weights_from``) that, inside a ``nvfp4_inductor.reuse_weight_casts()``
        block, reuses the copies the block kept from its first cast of that stack: the
        micro-batches of one optimizer step cast the weights once (``weight_cache.py``). Same
        bits; False (default) casts inside the traced op, with kernels Inductor launches.
    precision: which sites run NVFP4 and with which recipe (``precision.Precision``; default:
        every site, with ``recipe``); the others stay in BF16, compiled as stock Inductor does.
    cudnn: the cudnn target (Blackwell, docs/blackwell.md). "auto" (default) plans it where it
        runs: SM10x with the frontend installed, after its self-check on the GPU passed; "off"
        passes it over (Triton runs); "require" makes a site it cannot run an error saying why
        (a failed self-check included). The eager chain always runs "auto"'s choice."""

    recipe: Recipe = dataclasses.field(default_factory=Recipe)
    recompute: bool = True
    compiler: str = "inductor"
    trace_launches: bool = True
    reuse_weight_casts: bool = False
    precision: Precision = dataclasses.field(default_factory=Precision)
    cudnn: str = "auto"

    @classmethod
    def parse(cls, options: Optional[dict[str, Any]]) -> "BackendOptions":
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown nvfp4 backend option(s) {unknown}; valid options are {sorted(names)}")
        recipe = options.get("recipe", Recipe())
        if not isinstance(recipe, Recipe):
            raise ValueError(f"option 'recipe' must be an nvfp4_inductor.Recipe; got {type(recipe).__name__}")
        recompute = options.get("recompute", True)
        if not isinstance(recompute, bool):
            raise ValueError(f"option 'recompute' must be a bool; got {recompute!r}")
        compiler = options.get("compiler", "inductor")
        if compiler not in ("inductor", "aot_eager"):
            raise ValueError(f"option 'compiler' must be 'inductor' or 'aot_eager'; got {compiler!r}")
        flags = {name: options.get(name, getattr(cls, name)) for name in ("trace_launches", "reuse_weight_casts")}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"option '{name}' must be a bool; got {value!r}")
        precision = options.get("precision", Precision())
        if not isinstance(precision, Precision):
            raise ValueError(f"option 'precision' must be an nvfp4_inductor.Precision; got {type(precision).__name__}")
        cudnn = options.get("cudnn", "auto")
        if cudnn not in CUDNN_MODES:
            raise ValueError(f"option 'cudnn' must be one of {CUDNN_MODES}; got {cudnn!r}")
        return cls(recipe=recipe, recompute=recompute, compiler=compiler, precision=precision, cudnn=cudnn, **flags)
