"""The NVFP4 training recipe: one frozen options object (docs/numerics.md section 4).

Defaults follow TransformerEngine's NVFP4 recipe. Every field changes numerics, and
each states its effect; all combinations are bitwise reproducible under a fixed
``torch.manual_seed`` (stochastic rounding draws its Philox seed from the data device's
generator, see ``numerics.draw_seed``; under torch.distributed each rank's seed also
depends on its rank unless ``sr_per_rank=False``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from .constants import RHT_DEFAULT_SIGN_MASK

DEFAULT_SIGN_MASK = RHT_DEFAULT_SIGN_MASK  # Recipe's default; tests import it by this name


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How each tensor of the grouped MLP is quantized.

    rht: random Hadamard transform on the column-wise (wgrad) copies of the GEMM
        inputs (x, fc2_x) and of the gradients (dY, dC); never on row-wise copies or
        weights. Needs bf16 inputs.
    sign_mask: the RHT's 16 random signs, bit i set where sign i is -1 (0 = plain H/4).
    block_2d: weights use one E4M3 scale per 16x16 tile (so the column-wise copy is the
        exact transpose of the row-wise copy); otherwise 1x16 blocks like activations.
    stochastic_rounding: gradients (dY, dC), both copies, round stochastically
        (8 Philox bits per element); everything else rounds to nearest even.
    sr_per_rank: with stochastic rounding under an initialised torch.distributed, each
        seed drawn has the global rank folded into the Philox
        key's high word (seed ^ (rank << 32)): ranks seeded alike (the usual data-parallel
        set-up) draw independent rounding bits, so their rounding noise averages out.
        Rank 0 draws what a single process draws. False: every rank uses the drawn seed
        unchanged, reproducing a single-process run of its own batch (and, with ranks
        seeded alike, giving every rank the same bits: required for all-Replicate
        DTensors). No effect without torch.distributed or without stochastic rounding.
        Either way bitwise reproducible under a fixed ``torch.manual_seed`` per rank.
    """

    rht: bool = True
    sign_mask: int = DEFAULT_SIGN_MASK
    block_2d: bool = True
    stochastic_rounding: bool = True
    sr_per_rank: bool = True

    def __post_init__(self):
        for name in ("rht", "block_2d", "stochastic_rounding", "sr_per_rank"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Recipe.{name} must be a bool, got {getattr(self, name)!r}")
        check_sign_mask("Recipe.sign_mask", self.sign_mask)

    def token_cast(self, **options) -> QuantizeOptions:
        """A cast of tokens (x, D, dY, dC) under this recipe: its Hadamard transform on the
        column-wise copy (numerics.md 3; weights are never transformed), plus `options`
        (``QuantizeOptions``' other fields)."""
        return QuantizeOptions(rht=self.rht, sign_mask=self.sign_mask, **options)


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizeOptions:
    """One cast's options, as one value: what the quantize steps take
    (``Steps.group_quantize``, ``activation_quantize``) and what the amax steps read the
    Hadamard of (``group_hadamard_amax``, ``fc1_act_amax``: the casts their amaxes feed). The
    program makes it (``Recipe.token_cast``); the ``nvfp4::`` ops flatten it into their schemas
    and rebuild it; the quantizers that compute with it take its fields as keywords
    (``keywords()``).

    rowwise / columnwise: which copies to make. rht / sign_mask: the random Hadamard
    transform of the column-wise copy and its 16 signs (bit i set: sign i is -1).
    stochastic_rounding / seed: round stochastically with that Philox seed (required with
    it). rowwise_amax / columnwise_amax: amaxes to use instead of computing them (fp32 (G,);
    the column-wise one post-RHT with `rht`). rowwise_deq: the row-wise copy as its deq()
    values (``Steps.deq_operands``).
    """

    rowwise: bool = True
    columnwise: bool = False
    rht: bool = False
    sign_mask: int = RHT_DEFAULT_SIGN_MASK
    stochastic_rounding: bool = False
    rowwise_amax: Optional[torch.Tensor] = None
    columnwise_amax: Optional[torch.Tensor] = None
    seed: Optional[Union[int, torch.Tensor]] = None
    rowwise_deq: bool = False

    def __post_init__(self):
        check_sign_mask("sign_mask", self.sign_mask)

    def keywords(self) -> dict:
        """The fields as the quantizers' keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def check_sign_mask(name: str, sign_mask) -> None:
    """The RHT's signs are 16 bits: an int in [0, 0xFFFF]."""
    if not isinstance(sign_mask, int) or not 0 <= sign_mask <= 0xFFFF:
        raise ValueError(f"{name} must be an int in [0, 0xFFFF], got {sign_mask!r}")
