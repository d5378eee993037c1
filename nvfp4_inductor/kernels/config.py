"""Tile choices of every kernel: frozen configs, the heuristics that pick them, and one
context manager that pins them for tests and benchmarks.

    with config.override(cast=CastConfig(...), fprop=Bf16GemmConfig(...)):
        ...   # every launch inside takes the pinned configs; the others keep their heuristic

Kinds: ``cast`` (group_cast.py), ``amax`` (group_amax.py), ``dequant`` (dequantize.py),
``fprop`` / ``wgrad`` (the bf16-operand GEMMs of grouped_gemm_bf16.py), ``act`` / ``dact``
(the fused epilogue GEMMs of grouped_gemm_act.py / grouped_gemm_dact.py).

No choice here changes any result bit: every quantized element is computed by the same
fp32 operations whatever the tiling, the amax reduction is a max (order-free), deq() is
exact in bf16, and every GEMM kind runs ``grouped_gemm_bf16.bf16_tile_acc``'s natural K
order whatever the tile (the interpreter sums each K step exactly; see ``_mma`` there).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..sizes import MIN_SLICE_ROWS, tile_hint
from ._registry import INTERPRET


@dataclasses.dataclass(frozen=True)
class CastConfig:
    block_m: int  # padded tokens per program: 16 x a power of 2 (block_m / 16 runs)
    block_k: int  # columns per program, a power of 2 >= 16
    num_warps: int
    # ptxas register cap per thread (None: ptxas takes up to 255). Fewer registers let more
    # warps share an SM, at the cost of spills to local memory.
    max_registers: int | None = None
    # column blocks (of block_k) per program, cast one after the other: the search for the
    # runs' groups and the other per-program work are paid once for all of them
    k_blocks: int = 1
    # row-wise-only casts: tokens of a run unrolled per step of the loop over a run's 16
    # (16: no loop). Unrolled, the compiler can overlap each token's load with the previous
    # token's work, at more registers a thread and a longer compile (the SR row cast on
    # sm_90a, compiled on a CPU: 8.3 s unrolled, 0.8 s one token a step, most of it Triton's
    # coalescing pass); ``cast_config`` says where a loop is faster.
    token_unroll: int = 16

    def __post_init__(self):
        if self.token_unroll not in (1, 2, 4, 8, 16):
            raise ValueError(f"CastConfig.token_unroll must divide a run's 16 tokens (1, 2, 4, 8, 16), "
                             f"got {self.token_unroll}")

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


@dataclasses.dataclass(frozen=True)
class DequantConfig:
    block_r: int  # rows per program
    block_c: int  # packed bytes per program row (2 * block_c elements), a multiple of 8
    num_warps: int


@dataclasses.dataclass(frozen=True)
class Bf16GemmConfig:
    block_m: int  # output rows (tokens; N of wgrad) per tile
    block_n: int  # output columns per tile
    block_k: int
    num_warps: int
    num_stages: int
    num_programs: int = 0  # persistent programs; 0 = one per SM (1 under the interpreter)
    tma: bool = False  # device-side TMA descriptors (CUDA only)
    epilogue_split: int = 1  # fused epilogues (dact): 2 = the tile's column halves one after the other
    band_m: int = 0  # fprop-shaped tile order: M tiles per band (gemm_common.tile_coords); 0 = a group's all
    # fprop / dact on a packed weight stack: the fewest of out's columns a slice of the
    # weight's bf16 copy may have (sizes.copy_slices)
    min_slice_rows: int = MIN_SLICE_ROWS


_KINDS = {"cast": CastConfig, "amax": AmaxConfig, "dequant": DequantConfig,
          "fprop": Bf16GemmConfig, "wgrad": Bf16GemmConfig, "act": Bf16GemmConfig, "dact": Bf16GemmConfig}
_PINNED: dict[str, object] = {}  # kind -> config, set by ``override`` only


@contextlib.contextmanager
def override(**configs):
    """Pin tile configs for a ``with`` block (tests, benchmarks), by kind:
    ``override(cast=CastConfig(...), amax=AmaxConfig(...), dequant=DequantConfig(...),
    fprop=..., wgrad=..., act=..., dact=Bf16GemmConfig(...))``. A kind passed as None, or
    not passed, keeps what it had; blocks nest, and leaving one restores the pins before it."""
    for kind, cfg in configs.items():
        if kind not in _KINDS:
            raise TypeError(f"config.override: unknown kind {kind!r}; kinds are {', '.join(_KINDS)}")
        if cfg is not None and not isinstance(cfg, _KINDS[kind]):
            raise TypeError(f"config.override: {kind} must be a {_KINDS[kind].__name__}, got {cfg!r}")
    saved = dict(_PINNED)
    _PINNED.update({kind: cfg for kind, cfg in configs.items() if cfg is not None})
    try:
        yield
    finally:
        _PINNED.clear()
        _PINNED.update(saved)


# ---------------------------------------------------------------------------------------
# Heuristics


def cast_config(rows: int, cols: int, *, rht: bool, sr: bool = False, rowwise: bool = True,
                columnwise: bool = True, stacked: bool = False, row_deq: bool = False,
                act_in: bool = False) -> CastConfig:
    """Tiles of a cast writing the copies asked for (`rowwise`, `columnwise`; `row_deq`: the
    row-wise one as deq() values) of a token tensor, or of an expert weight stack
    (`stacked`: 2D blocks, both copies in one launch); `act_in`: the cast makes its input
    D from C as it loads it (``group_cast``'s ACT_IN).

    The casts are bound by instructions, not bytes: 8 elements a thread a token row, so that
    a 1x16 block's scale chain is computed by 2 threads, not 4; several column blocks a
    program, so that the group search is paid once; one token a loop step where fewer
    registers let more warps hide the load latency. Each tile won a sweep on the H200:
    docs/decisions.md, "Tile choices", "Casts"."""
    if "cast" in _PINNED:
        return _PINNED["cast"]
    if INTERPRET:  # numpy: the cost is per operation, not per element -> the fewest programs
        return CastConfig(block_m=256, block_k=128, num_warps=4)
    if stacked:
        return CastConfig(block_m=64, block_k=128, num_warps=4, k_blocks=4)
    if rowwise and columnwise:  # RNE, packed (an SR or deq() row + column cast is two launches: cast_launches)
        return CastConfig(block_m=32, block_k=128, num_warps=1, k_blocks=4)
    if rowwise:
        if sr and tile_hint(cols) % 1024 == 0:  # no guard on a symbolic width
            return CastConfig(block_m=16, block_k=512, num_warps=2, k_blocks=2, token_unroll=1)
        if sr:
            return CastConfig(block_m=32, block_k=128, num_warps=1, k_blocks=4, token_unroll=1)
        return CastConfig(block_m=16, block_k=256, num_warps=1, k_blocks=2, token_unroll=1 if row_deq else 16)
    if sr:
        return CastConfig(block_m=32, block_k=64, num_warps=1, k_blocks=8)
    if act_in:
        return CastConfig(block_m=32, block_k=256, num_warps=4, k_blocks=1)
    return CastConfig(block_m=32, block_k=128, num_warps=2, k_blocks=4)


def cast_launches(rowwise: bool, columnwise: bool, sr: bool, row_deq: bool = False,
                  stacked: bool = False) -> tuple[tuple[bool, bool], ...]:
    """The (rowwise, columnwise) copies each launch of a cast writes. A row + column cast of
    a token tensor is two launches, a row-only and a column-only one, when stochastically
    rounded (in one kernel its two Philox streams spill) or when its row-wise copy is written
    as deq() values (in one kernel it spills); otherwise one. A weight stack (`stacked`)
    stays one launch: its two copies share their codes. The interpreter splits too: one path
    everywhere. Measured: docs/decisions.md, "Tile choices", "Casts"."""
    if rowwise and columnwise and (sr or (row_deq and not stacked)):
        return (True, False), (False, True)
    return ((rowwise, columnwise),)


def amax_config(rows: int, cols: int) -> AmaxConfig:
    if "amax" in _PINNED:
        return _PINNED["amax"]
    if INTERPRET:
        return AmaxConfig(block_m=256, block_k=128, k_split=1, num_warps=4)
    # the fastest tile on the H200 (docs/decisions.md, "Tile choices"). Decided on the traced
    # example's size: a dynamic token count gets no guard (no recompile at ~65k rows)
    programs = -(-tile_hint(rows) // 64)
    return AmaxConfig(block_m=64, block_k=128, k_split=1 if programs >= 1024 else 2, num_warps=4)


def dequant_config() -> DequantConfig:
    if "dequant" in _PINNED:
        return _PINNED["dequant"]
    if INTERPRET:  # numpy: few, large programs
        return DequantConfig(64, 64, 4)
    # 16 bytes in / 64 bytes out per thread: 32 x 128 bytes over 8 warps of 32 threads
    return DequantConfig(32, 128, 8)


def bf16_gemm_config(kind: str, device: torch.device, *, swiglu: bool = False) -> Bf16GemmConfig:
    """Tile config of `kind`: "fprop" / "wgrad" (the plain GEMMs), "act" / "dact" (the fused
    epilogue GEMMs of grouped_gemm_act.py / grouped_gemm_dact.py; `swiglu`: the activation
    is SwiGLU)."""
    if kind in _PINNED:
        return _PINNED[kind]
    if INTERPRET or device.type != "cuda":
        return Bf16GemmConfig(32, 32, 32, 4, 1, 2)
    # TMA loads (device-side descriptors) for the fprop-shaped kernels, pointer loads for the
    # wgrads; the fprop-shaped kernels' tiles in bands of 8 M tiles (gemm_common.tile_coords),
    # so that the tiles running at once share operands in L2. Measured on the H200:
    # docs/decisions.md, "Tile choices", "GEMMs".
    band = 8
    if kind == "dact":
        # The unsplit epilogue spills (C's, dC's and D's tiles live at once); on column
        # slices it does not
        return Bf16GemmConfig(128, 128, 64, 8, 4, tma=True, epilogue_split=2, band_m=band) if swiglu else \
            Bf16GemmConfig(128, 256, 64, 8, 3, tma=True, epilogue_split=4, band_m=band)
    if kind == "act" and swiglu:
        # two accumulators: 128x256 spills
        return Bf16GemmConfig(128, 128, 64, 8, 4, tma=True, band_m=band)
    if kind == "act":
        return Bf16GemmConfig(128, 256, 64, 8, 4, tma=True, band_m=band)
    # Inductor's grouped-mm template's tile on the H200: 128x256x64, 8 warps, 3 stages
    if kind == "fprop":
        return Bf16GemmConfig(128, 256, 64, 8, 3, tma=True, band_m=band)
    return Bf16GemmConfig(128, 256, 64, 8, 3)  # wgrad: its own schedule (gemm_common.wgrad_tile)
