"""nvfp4_inductor: train mixture-of-experts grouped MLPs in NVFP4 with torch.compile.

    torch.compile(model, backend="nvfp4")             # or backend=nvfp4_inductor.backend(...)
    nvfp4_inductor.GroupedMLP / grouped_mlp           # eager NVFP4 (the reference semantics)
    nvfp4_inductor.quantize / group_quantize          # NVFP4 quantizers (docs/numerics.md 1-4)
    nvfp4_inductor.explain(model)(*args, **kwargs)    # look inside; also dump_code, compare (bitwise),
                                                      # each with backend=nvfp4_inductor.backend(...)
    nvfp4_inductor.reuse_weight_casts                 # cast weights once per optimizer step
    nvfp4_inductor.Precision                          # which expert layers train in NVFP4 (backend option)
"""

from .compiler.backend import backend, register
from .compiler.precision import Precision, SiteInfo
from .compiler.self_check_step import fused_equals_eager
from .inspection import compare, dump_code, explain
from .lowerings.self_check import register_training_step_check
from .nn import GroupedMLP, grouped_mlp
from .quantize import group_quantize, quantize
from .recipe import Recipe
from .tensor import NVFP4GroupedTensor, NVFP4Tensor, NVFP4WeightStack
from .weight_cache import reuse_weight_casts

register()
register_training_step_check(fused_equals_eager)  # the cudnn self-check's training step

__all__ = [
    "GroupedMLP",
    "NVFP4GroupedTensor",
    "NVFP4Tensor",
    "NVFP4WeightStack",
    "Precision",
    "Recipe",
    "SiteInfo",
    "backend",
    "compare",
    "dump_code",
    "explain",
    "group_quantize",
    "grouped_mlp",
    "quantize",
    "reuse_weight_casts",
]
