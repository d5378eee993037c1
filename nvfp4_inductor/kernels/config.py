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

    8 elements per thread per token row (R * BK / (32 * warps)): every 1x16 row block
    spans 2 threads, so the per-block scale chain (two IEEE divisions) is computed by 2
    threads, not 4 -- ~20% fewer instructions than 4 per thread (SASS count, ptxas sm_90a:
    row+col 58 vs 72 per element, row-only 29 vs 42), at ~250 registers and no spills.
    RNE row + column: 32x128, 1 warp (H200 sweep of run Q3, 65536 x 4096: 863 us vs 885 for
    32x256 2 warps; register caps lose, run Q6), 4 column blocks per program: the group
    search and the rest of a program's setup are paid once for 4 blocks. sm_90a SASS per
    element (benchmarks/cast_sass.py with Triton 3.6, the H200's; G = 8 / 128 groups): row +
    column 60.4 / 67.5 -> 52.9 / 54.7, 2D weight stacks 40.9 -> 37.1 (16 bytes of spills).
    Single-copy casts (run W1, H200; S1 x 16384 x 4096 / S4 x 65536 x 2048 / S4 h 65536 x 768):
    RNE row-only 16x256 1 warp, 2 blocks: 111 / 238 / 142 us against 32x128's 123 / 267 / 145;
    RNE column-only 64x128 2 warps, 4 blocks (until run K2): 127 / 245 / 144 against 143 /
    287 / 154; SR row-only 32x128 1 warp: 161 / 462 / 178 against 16x256 2 warps at 128
    registers' 172 / 593 / 225; SR column-only 32x128 1 warp, 4 blocks: 164 / 317 / 131
    against 167 / 359 / 147. SR row + column casts are two launches (``cast_launches``).
    SR row-only where K % 1024 == 0: 16x512, 2 blocks (at 1 warp, 16 elements per thread:
    one thread owns a 1x16 block and its Philox call; SASS per element 50.4 -> 35.0; 2 warps
    since run K4). Runs X1/X2 (benchmarks/cast_tiles.py), 1 warp: S1 x 147 us, S4 x 360
    against 32x128's 160 / 465. At K = 768 (S4 h) a program's 1024 columns are a quarter
    masked: 16x512 lost (212 vs 178 us at one block); there 32x128 at 4 blocks was fastest
    in W1 and X2 (158 / 160 us against one block's 178). (At K = 4096, S1 x, 4 blocks took
    280 us against 160: that width now takes 16x512.)
    Runs K2 + K4 (H200, cast_tiles.py), RNE column-only: 32x128 2 warps, 4 blocks, S1 x 113 /
    S4 x 224 / S4 h 92 us against 64x128's 124 / 241 / 99 (64x128 4 warps 120 / 239 / 100,
    128x128 8 warps 132 / 290 / 121). SR row-only 16x512 at 2 warps: S1 x 140 / S4 x 287
    against 1 warp's 143 / 359 (1 block: 130 / 449; 32x128 2 warps 514 / 602).
    Weight stacks, both copies with the row-wise one as deq() values (the forward's launch):
    64x128 4 warps, 4 blocks, runs K1 + K2: S4 W1 349 us, S4 W2 350, S1 W1 127 against the
    token tiles' (32x128 1 warp) 467 / 461 / 174 -- 255 registers with 120 B of spills at 1
    warp; 2 warps 368 / 380 / 149, 8 warps 407 / - / 144, 2 blocks 348 / - / 124. Stacks of
    1x16 blocks (``block_2d=False``) take the same tiles, unmeasured.
    SR column-only: 32x64 1 warp, 8 blocks (run G3, cast_tiles.py --tiles): S1 x 135 / S4 x 267
    / S4 h 110 us against 32x128's 172 / 348 / 139 -- half the columns a program, so 4 of a
    thread's elements per token instead of 8: 196 registers and no spills against 255 with
    488 B (sm_90a SASS, local Triton 3.9), more warps resident an SM. 16-row tiles of the
    same registers did not gain (16x128 1 warp 164 / 349 / 141); RNE column-only at 32x64
    ties 32x128 2 warps (112 / 225 / 94).
    SR row-only, one token a step of a loop over a run's 16 (``token_unroll`` 1; run H1,
    cast_tiles.py --tiles, every candidate's bits equal): 16x512 w2 k2 S1 x 134 -> 106 us,
    S4 x 279 -> 241; 32x128 w1 k4 at S4 h 153 -> 142 (4 tokens a step: 134 / 281 / 145).
    52 registers instead of 118 (sm_90a SASS): more warps resident hide the load latency
    better than unrolling does, and the kernel compiles in a tenth of the time.
    RNE row-only (run H2, 16x256 w1 k2, one token a step against unrolled): with deq() stores
    (x, D in the forward) S1 x 120 -> 106 us, S4 x 249 -> 210, S4 h 100 -> 88; packed (the
    recompute-off D) 230 -> 240 and 96 -> 99 at S4: only the deq() casts take the loop.
    RNE column-only with D made from C in the cast (the SReLU recompute's D, the backward's
    ``activation_quantize``): 32x256, 4 warps, 1 block (run A3,
    benchmarks/results/act_cast_run_A3.log: us replayed from CUDA graphs, bits equal):
    S4 h 227.7 -> 115.1, S1 h (16384 x 2048) 123.4 -> 75.3, S3 h (32768 x 768) 94.3 -> 58.1;
    the activation kernel + the plain column cast take 147.0 / 94.5 / 73.9. At the plain
    column cast's tiles (32x128 w2 k4) the prologue made the fused launch slower than the
    two it replaced, 227.7 / 123.4 / 94.3, and 32x64 / 64x64 tiles did not beat them either
    (172-184 / 99-122 / 76-93). The plain column casts do not gain from 32x256 (run A4: S4
    x 241 -> 305 us)."""
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
    rounded or when its row-wise copy is written as deq() values (`row_deq`); otherwise one.
    SR: in one kernel its two Philox streams and 16 token tiles cost 98 SASS instructions
    per element with 192 bytes of spills (128-register cap), apart 48 + 37
    (benchmarks/cast_sass.py, sm_90a, 8 groups); run W1 (H200), the two launches against
    the one: 0.93 (S1 x), 0.84 (S4 x), 0.88 (S4 h) of the time. RNE with packed copies: the
    one launch is as fast or faster (1.04 / 0.95 / 1.35). RNE with the row-wise copy as
    deq(): the one launch reaches 255 registers with 40 bytes of spills (61.8 SASS per
    element at 128 groups; the row-only deq() cast 36.1 at 72 registers, none) and took 0.16x
    / 0.15x longer than with packed copies (run Y2: S1 x 239 -> 278 us, S4 x 537 -> 620),
    while a row-only cast's deq() stores cost ~5% (S4 D 94 -> 99 us). Two launches, run Z1:
    S1 x 121 + 121 = 242 us, S4 x 258 + 245 = 503 us. A weight stack (`stacked`) stays one
    launch: its two copies share their codes. The interpreter splits too: one path
    everywhere."""
    if rowwise and columnwise and (sr or (row_deq and not stacked)):
        return (True, False), (False, True)
    return ((rowwise, columnwise),)


def amax_config(rows: int, cols: int) -> AmaxConfig:
    if "amax" in _PINNED:
        return _PINNED["amax"]
    if INTERPRET:
        return AmaxConfig(block_m=256, block_k=128, k_split=1, num_warps=4)
    # measured on the H200 (run 2, 65536 x 4096): (64, 128, split 1, 4 warps) 191 us beat
    # (32, 256, 1, 2 warps) 212 us and (32, 256, 2, 2 warps) 219 us. Decided on the traced
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
    # TMA loads (device-side descriptors) for the fprop-shaped kernels: benchmarks/grouped_gemm.py,
    # run O1 (H200, the six GEMMs of a step at S1-S4, both activations), against pointer loads
    # of the same tiles: 3-19% faster at S1/S2 (fc1 fprop + act at S2 srelu 4.94 -> 4.07 ms,
    # fc1 dgrad 4.21 -> 3.77) and 0-11% at S3/S4; a whole S2 srelu step 28.75 -> 27.22 ms. The
    # wgrads keep pointers: TMA was 1-5% slower at S1, S3 and S4 and 2% faster at S2.
    # Tiles in bands of 8 M tiles (gemm_common.tile_coords) for the fprop-shaped kernels:
    # grouped_gemm.py, run P4, against a group's whole M at S2 (64 M tiles a group, a token
    # operand larger than L2): srelu act / fprop / dact / dgrad 3.82 / 3.62 / 4.67 / 3.63 ->
    # 3.74 / 3.44 / 4.01 / 3.50 ms, swiglu 8.18 / 3.75 / 5.40 / 6.99 -> 7.89 / 3.51 / 4.86 /
    # 6.56 (bands of 4 and 16 no better on the sum); within 2% at S1, S3, S4 but for S3's
    # srelu act (0.208 -> 0.219). Whole steps at S2: srelu 27.21 -> 26.26 ms, swiglu 40.63 -> 39.28
    band = 8
    if kind == "dact":
        # The unsplit epilogue spills (C's, dC's and D's tiles live at once; sm_90a code,
        # benchmarks/epilogue_sass.py); on column slices it does not. epilogue_tiles.py, run
        # Z1 (H200), ms at S4 / S1 against the unsplit 128x128 w8 s4: SReLU 128x256 w8 s3 in
        # quarters 0.545 / 0.497 (0.645 / 0.617), SwiGLU 128x128 in halves 0.764 / 0.660
        # (1.144 / 0.882; quarters 0.773 / 0.674, 128x256 in quarters 1.30 / 0.90). O1, TMA
        # against pointers, S1 / S2 / S3 / S4: SReLU 0.464 / 4.24 / 0.255 / 0.524 against
        # 0.477 / 4.51 / 0.249 / 0.546; SwiGLU 0.586 / 5.43 / 0.325 / 0.674 against 0.648 /
        # 6.03 / 0.341 / 0.710 (one stage more: no better on the sum)
        return Bf16GemmConfig(128, 128, 64, 8, 4, tma=True, epilogue_split=2, band_m=band) if swiglu else \
            Bf16GemmConfig(128, 256, 64, 8, 3, tma=True, epilogue_split=4, band_m=band)
    if kind == "act" and swiglu:
        # two accumulators: 128x256 spills. Run EP1 (S1), 128x256 w8 s3 -> 128x128 w8 s4:
        # 1.54 -> 1.23 ms; run Z1: 3.97 -> 1.11 (S1), 3.98 -> 1.11 (S4). O1 with TMA, S1 / S2 /
        # S3 / S4: 0.947 / 9.49 / 0.480 / 1.002 against pointers' 1.058 / 10.43 / 0.525 / 1.109
        return Bf16GemmConfig(128, 128, 64, 8, 4, tma=True, band_m=band)
    if kind == "act":
        # O1: TMA over 4 stages 0.404 / 4.13 / 0.213 / 0.422 ms, 3 stages 0.415 / 4.07 / 0.219 /
        # 0.459, pointers (3 stages) 0.504 / 4.94 / 0.258 / 0.490
        return Bf16GemmConfig(128, 256, 64, 8, 4, tma=True, band_m=band)
    # Inductor's grouped-mm template on the H200: 128x256x64, 8 warps, 3 stages. O1, fc2
    # fprop / fc1 dgrad at S1 srelu: TMA 0.414 / 0.454 ms against pointers' 0.447 / 0.494
    if kind == "fprop":
        return Bf16GemmConfig(128, 256, 64, 8, 3, tma=True, band_m=band)
    return Bf16GemmConfig(128, 256, 64, 8, 3)  # wgrad: its own schedule (gemm_common.wgrad_tile)
