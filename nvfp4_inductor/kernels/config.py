"""Tile choices of the quantize kernels: a heuristic returning frozen configs that tests
and benchmarks can pin (STYLE rule 13). No choice here changes any result bit: every
output element is computed by the same fp32 operations whatever the tiling, and the
amax reduction is a max (order-free)."""

from __future__ import annotations

import dataclasses

from ._registry import INTERPRET


@dataclasses.dataclass(frozen=True)
class CastConfig:
    block_m: int  # padded tokens per program: 16 x a power of 2 (block_m / 16 runs)
    block_k: int  # columns per program, a power of 2 >= 16
    num_warps: int
    # ptxas register cap per thread (None: ptxas takes up to 255). Fewer registers let more
    # warps share an SM, at the cost of spills to local memory.
    max_registers: int | None = None

    def launch_options(self) -> dict:
        """Triton launch options of this config."""
        options = dict(num_warps=self.num_warps)
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options


@dataclasses.dataclass(frozen=True)
class AmaxConfig:
    block_m: int  # padded tokens per program, a multiple of 16
    block_k: int  # columns per loop step
    k_split: int  # programs along K (each loops over K / k_split columns)
    num_warps: int


_CAST_OVERRIDE: CastConfig | None = None
_AMAX_OVERRIDE: AmaxConfig | None = None


def cast_config(rows: int, cols: int, *, rht: bool, sr: bool = False) -> CastConfig:
    """8 elements per thread per token row (R * BK / (32 * warps)): every 1x16 row block
    spans 2 threads, so the per-block scale chain (two IEEE divisions) is computed by 2
    threads, not 4 -- ~20% fewer instructions than 4 per thread (SASS count, ptxas sm_90a:
    row+col 58 vs 72 per element, row-only 29 vs 42), at ~250 registers and no spills.
    Tiles from the H200 sweep of run Q3 (65536 x 4096, benchmarks/quantize.py --sweep):
    RNE 32x128 1 warp 863 us vs 32x256 2 warps 885 us; SR 16x256 2 warps 1708 us vs
    64x128 4 warps 2617 us (one run of 16 tokens per program: fewer Philox words held).
    Register caps (run Q6, same shape): SR at 128 registers 1342 us vs 1467 uncapped (16
    warps per SM instead of 10 outweigh its spills); RNE loses with any cap (200: 933 vs
    863 us; 128: 1516). A row-wise-only cast holds one token at a time (64 registers)."""
    if _CAST_OVERRIDE is not None:
        return _CAST_OVERRIDE
    if INTERPRET:  # numpy: the cost is per operation, not per element -> the fewest programs
        return CastConfig(block_m=256, block_k=128, num_warps=4)
    if sr:
        return CastConfig(block_m=16, block_k=256, num_warps=2, max_registers=128)
    return CastConfig(block_m=32, block_k=128, num_warps=1)


def amax_config(rows: int, cols: int) -> AmaxConfig:
    if _AMAX_OVERRIDE is not None:
        return _AMAX_OVERRIDE
    if INTERPRET:
        return AmaxConfig(block_m=256, block_k=128, k_split=1, num_warps=4)
    # measured on the H200 (run 2, 65536 x 4096): (64, 128, split 1, 4 warps) 191 us beat
    # (32, 256, 1, 2 warps) 212 us and (32, 256, 2, 2 warps) 219 us
    programs = -(-rows // 64)
    return AmaxConfig(block_m=64, block_k=128, k_split=1 if programs >= 1024 else 2, num_warps=4)


class override:
    """Context manager pinning the configs (benchmarks and tests): ``with override(cast=..)``."""

    def __init__(self, cast: CastConfig | None = None, amax: AmaxConfig | None = None):
        self.cast, self.amax = cast, amax

    def __enter__(self):
        global _CAST_OVERRIDE, _AMAX_OVERRIDE
        self.saved = (_CAST_OVERRIDE, _AMAX_OVERRIDE)
        _CAST_OVERRIDE, _AMAX_OVERRIDE = self.cast or _CAST_OVERRIDE, self.amax or _AMAX_OVERRIDE
        return self

    def __exit__(self, *exc):
        global _CAST_OVERRIDE, _AMAX_OVERRIDE
        _CAST_OVERRIDE, _AMAX_OVERRIDE = self.saved
