"""nvfp4_inductor: train mixture-of-experts grouped MLPs in NVFP4 with torch.compile.

Public names: ``Recipe``, ``quantize``, ``group_quantize``, ``NVFP4Tensor``,
``NVFP4GroupedTensor``, ``NVFP4WeightStack``, ``grouped_mlp``, ``GroupedMLP``.
"""

from .nn import GroupedMLP, grouped_mlp
from .quantize import group_quantize, quantize
from .recipe import Recipe
from .tensor import NVFP4GroupedTensor, NVFP4Tensor, NVFP4WeightStack

__all__ = [
    "GroupedMLP",
    "NVFP4GroupedTensor",
    "NVFP4Tensor",
    "NVFP4WeightStack",
    "Recipe",
    "group_quantize",
    "grouped_mlp",
    "quantize",
]
