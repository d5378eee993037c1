"""The NVFP4 training recipe: one frozen options object (docs/numerics.md section 4).

Defaults follow TransformerEngine's NVFP4 recipe. Every field changes numerics, and
each states its effect; all combinations are bitwise reproducible under a fixed
``torch.manual_seed`` (stochastic rounding draws its Philox seed from the data device's
generator, see ``numerics.draw_seed``; under torch.distributed each rank's seed also
depends on its rank unless ``sr_per_rank=False``).
"""

from __future__ import annotations

import dataclasses

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
        if not isinstance(self.sign_mask, int) or not 0 <= self.sign_mask <= 0xFFFF:
            raise ValueError(f"Recipe.sign_mask must be an int in [0, 0xFFFF], got {self.sign_mask!r}")
