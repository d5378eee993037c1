"""nvfp4_inductor.kernels (Triton) against numerics.py: zero tolerance on codes, scales,
amaxes and offsets.

On a machine without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 before Triton is
imported and the kernels run in the interpreter on CPU tensors (small shapes, large tiles,
so each call is one or two programs). `@pytest.mark.gpu` tests run the big shapes on a
CUDA device (``pytest -m gpu``); they are skipped, with the reason, without one.

Cases are data: ``GROUP_CASES`` / ``SINGLE_CASES`` name the input, the
group sizes and the options. Pruned on purpose: fp32 inputs with RHT (numerics.md 3: RHT needs
bf16) and block_2d with RHT (weights are never transformed; the kernels raise).
"""

from __future__ import annotations

import dataclasses
import zlib
import subprocess
import sys
import warnings

import pytest
import torch

from nvfp4_inductor import numerics
from nvfp4_inductor.formats import e2m1_encode, e4m3_encode

from _assertions import assert_bytes_equal, assert_nvfp4_equal

triton = pytest.importorskip("triton")
from nvfp4_inductor import kernels  # noqa: E402
from nvfp4_inductor.kernels import config  # noqa: E402
from nvfp4_inductor.kernels.config import CastConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not kernels.available(DEVICE):
    pytest.skip(f"Triton kernels cannot run on {DEVICE} (no CUDA and TRITON_INTERPRET unset)", allow_module_level=True)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
warnings.filterwarnings("ignore", message="divide by zero", category=RuntimeWarning)  # 1/0 -> inf is meant


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(DEVICE)


# ---------------------------------------------------------------------------------------
# Inputs


def random_input(tokens: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) * torch.exp(torch.randn(tokens, 1, generator=g))
    return _bf16(x)


def edge_input(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(96, 64) bf16 with every numerics.md edge case in its own group, and its group sizes:
    empty groups front/middle/end, an all-zero group, an outlier next to blocks whose scale
    underflows to 0 (codes +-6), blocks with subnormal E4M3 scales, a group whose amax is
    so small that S_enc clamps to FLT_MAX, exact zeros and -0.0, sizes not multiples of 16."""
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 16, 20, 0, 27, 17, 16, 0]
    parts = [torch.zeros(16, 64)]  # all-zero group
    trap = torch.randn(20, 64, generator=g)
    trap[0, 0] = 30000.0  # outlier: the block holding the amax gets scale 448
    trap[1:9, 16:48] = torch.randn(8, 32, generator=g) * 1e-5  # scale underflows to 0
    trap[9:, 48:] = 0.0  # zero blocks (row-wise and column-wise)
    parts.append(trap)
    sub = torch.randn(27, 64, generator=g) * 2e-5  # subnormal E4M3 scales ...
    sub[3, 5] = 1.0  # ... relative to this amax
    sub[10:, :16] = torch.randn(17, 16, generator=g) * 4e-6
    parts.append(sub)
    mixed = torch.randn(17, 64, generator=g)
    mixed[::2, ::3] = -0.0
    mixed[1::2, ::5] = 0.0
    parts.append(mixed)
    parts.append(torch.randn(16, 64, generator=g) * 1e-38)  # S_enc = min(inf, FLT_MAX)
    x = torch.cat(parts)
    return _bf16(x), torch.tensor(sizes, device=DEVICE)


@dataclasses.dataclass(frozen=True)
class GroupCase:
    id: str
    tokens: int
    k: int
    sizes: tuple
    options: dict = dataclasses.field(default_factory=dict)
    supplied_amax: bool = False


_RHT = dict(rowwise=True, columnwise=True, rht=True)
_ROW_ONLY = dict(rowwise=True, columnwise=False)
GROUP_CASES = [
    GroupCase("rht_mask_default", 100, 128, (0, 37, 0, 50, 13, 0), _RHT),
    GroupCase("rht_mask0", 100, 128, (0, 37, 0, 50, 13, 0), dict(_RHT, sign_mask=0)),
    GroupCase("rht_sr", 100, 128, (5, 0, 48, 47), dict(_RHT, stochastic_rounding=True, seed=1234)),
    GroupCase("rht_sr_mask0", 64, 64, (16, 33, 15), dict(_RHT, sign_mask=0, stochastic_rounding=True, seed=2**40 + 7)),
    GroupCase("col_only_rht", 80, 64, (31, 0, 49), dict(rowwise=False, columnwise=True, rht=True)),
    GroupCase("col_no_rht", 80, 64, (31, 0, 49), dict(rowwise=True, columnwise=True)),
    GroupCase("row_only", 80, 64, (17, 63), dict(rowwise=True)),
    GroupCase("row_only_sr", 80, 64, (17, 63), dict(rowwise=True, stochastic_rounding=True, seed=99)),
    # supplied amaxes, half the true ones for some groups: scales saturate at 448, v clamps at 6
    GroupCase("supplied_amax_rht", 100, 64, (20, 0, 40, 40), _RHT, supplied_amax=True),
    GroupCase("supplied_amax_no_rht", 100, 64, (20, 0, 40, 40), dict(rowwise=True, columnwise=True), supplied_amax=True),
    GroupCase("one_group", 48, 32, (48,), _RHT),
]


def _supplied(x, sizes, options):
    pre, post = numerics.group_hadamard_amax_torch(x, sizes, options.get("sign_mask", 0xD7E8))
    factor = torch.tensor([0.5, 1.0, 2.0, 1.0] * 4, device=x.device)[: sizes.numel()]
    return dict(rowwise_amax=pre * factor, columnwise_amax=(post if options.get("rht") else pre) * factor)


@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: c.id)
def test_group_quantize_matches_reference(case: GroupCase):
    x = random_input(case.tokens, case.k, seed=zlib.crc32(case.id.encode()) % 1000)
    sizes = torch.tensor(case.sizes, device=DEVICE)
    options = dict(case.options)
    if case.supplied_amax:
        options.update(_supplied(x, sizes, options))
    actual = kernels.group_quantize(x, sizes, **options)
    expected = numerics.group_quantize_torch(x, sizes, **options)
    assert_nvfp4_equal(actual, expected, f"group_quantize[{case.id}]")


@pytest.mark.parametrize(
    "cfg",
    [CastConfig(block_m=16, block_k=32, num_warps=1), CastConfig(block_m=32, block_k=64, num_warps=2, max_registers=128),
     CastConfig(block_m=64, block_k=16, num_warps=1, k_blocks=4), CastConfig(block_m=64, block_k=32, num_warps=1, k_blocks=2),
     CastConfig(block_m=32, block_k=32, num_warps=1, k_blocks=2, token_unroll=4),
     CastConfig(block_m=16, block_k=64, num_warps=1, token_unroll=1)],
    ids=["one_run_narrow", "two_runs_register_cap", "four_column_blocks", "two_column_blocks_k_tail",
         "row_tokens_in_fours", "row_tokens_one_at_a_time"],
)
def test_cast_tiles_change_no_bit(cfg):
    """Tiles that split groups across programs, leave K unaligned (96 % 64), cap the
    registers, walk several column blocks per program (96 = 6 blocks of 16: programs of
    4 and 2; 3 blocks of 32: programs of 2 and 1), or walk a run's tokens in a loop of 4 or
    1 at a time in row-only casts (groups of 37 and 13 tokens end inside a step) give the
    reference's bits: RNE and SR, row and column, row only, and 2D weight stacks."""
    x = random_input(100, 96, seed=5)
    sizes = torch.tensor([0, 37, 50, 13], device=DEVICE)
    for options in (_RHT, dict(_RHT, stochastic_rounding=True, seed=9), _ROW_ONLY):
        with config.override(cast=cfg):
            actual = kernels.group_quantize(x, sizes, **options)
        assert_nvfp4_equal(actual, numerics.group_quantize_torch(x, sizes, **options), f"tiles {cfg} {options}")
    w = random_input(3 * 48, 96, seed=6).reshape(3, 48, 96)
    with config.override(cast=cfg):
        actual = kernels.quantize_weights(w)
    assert_nvfp4_equal(actual, numerics.quantize_weights_torch(w), f"tiles {cfg} weights")


def test_register_cap_is_a_launch_option():
    assert CastConfig(32, 128, 1).launch_options() == dict(num_warps=1)
    assert CastConfig(32, 128, 1, max_registers=168).launch_options() == dict(num_warps=1, maxnreg=168)


def test_token_unroll_must_divide_a_run():
    with pytest.raises(ValueError, match="token_unroll"):
        CastConfig(32, 128, 1, token_unroll=3)


@pytest.mark.parametrize("sign_mask", [0xD7E8, 0], ids=["mask_d7e8", "mask0"])
@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
def test_group_quantize_edge_cases(sign_mask, sr):
    x, sizes = edge_input()
    for copies in (_RHT, _ROW_ONLY):  # row-only casts take their own path (one token at a time)
        options = dict(copies, sign_mask=sign_mask, stochastic_rounding=sr, seed=77 if sr else None)
        actual = kernels.group_quantize(x, sizes, **options)
        expected = numerics.group_quantize_torch(x, sizes, **options)
        assert_nvfp4_equal(actual, expected, f"group_quantize[edge, {options}]")


def test_group_quantize_all_zero():
    x = torch.zeros(64, 32, dtype=torch.bfloat16, device=DEVICE)
    sizes = torch.tensor([0, 30, 34, 0], device=DEVICE)
    for sr in (False, True):
        options = dict(_RHT, stochastic_rounding=sr, seed=5)
        actual = kernels.group_quantize(x, sizes, **options)
        assert_nvfp4_equal(actual, numerics.group_quantize_torch(x, sizes, **options), f"all-zero sr={sr}")
        assert int(actual.columnwise_data.count_nonzero()) == 0


def test_stochastic_rounding_same_seed_same_bits():
    x = random_input(64, 64, seed=3)
    sizes = torch.tensor([21, 43], device=DEVICE)
    a = kernels.group_quantize(x, sizes, **_RHT, stochastic_rounding=True, seed=42)
    b = kernels.group_quantize(x, sizes, **_RHT, stochastic_rounding=True, seed=42)
    c = kernels.group_quantize(x, sizes, **_RHT, stochastic_rounding=True, seed=43)
    assert_nvfp4_equal(a, b, "same seed")
    assert not torch.equal(a.rowwise_data, c.rowwise_data), "a different seed should change some codes"
    with pytest.raises(ValueError, match="needs a seed"):  # seeds are drawn by the ops, never here
        kernels.group_quantize(x, sizes, **_RHT, stochastic_rounding=True)
    e = kernels.group_quantize(x, sizes, **_RHT, stochastic_rounding=True, seed=torch.tensor(42, device=DEVICE))
    assert_nvfp4_equal(e, a, "a device-tensor seed gives the int seed's bits")


# ---------------------------------------------------------------------------------------
# Single tensors and weight stacks

SINGLE_CASES = {
    "row": dict(),
    "row_col_rht": _RHT,
    "row_col_rht_mask0_sr": dict(_RHT, sign_mask=0, stochastic_rounding=True, seed=8),
    "col_no_rht": dict(rowwise=False, columnwise=True),
    "block_2d": dict(rowwise=True, columnwise=True, block_2d=True),
    "block_2d_sr": dict(rowwise=True, columnwise=True, block_2d=True, stochastic_rounding=True, seed=3),
    "supplied_row_amax_no_rht": dict(rowwise=True, columnwise=True, rowwise_amax=torch.tensor(1.5)),
    "supplied_both_rht": dict(_RHT, rowwise_amax=torch.tensor(2.0), columnwise_amax=torch.tensor(0.75)),
}


@pytest.mark.parametrize("rht", [False, True], ids=["plain", "rht"])
@pytest.mark.parametrize("supplied", [False, True], ids=["computed", "supplied"])
def test_group_quantize_outputs_alias_nothing(rht, supplied):
    """Like the reference (numerics._owned), the Triton twin returns amaxes that alias
    neither a supplied amax nor each other: the nvfp4:: ops may return no alias (torch
    checks it on CUDA). Without RHT both copies use the same pre-RHT amax values."""
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEVICE)
    sizes = torch.tensor([10, 0, 30], device=DEVICE)
    given = torch.rand(3, device=DEVICE) + 1 if supplied else None
    q = kernels.group_quantize(x, sizes, rowwise=True, columnwise=True, rht=rht, rowwise_amax=given)
    outs = [t for t in q.as_tuple()[:7] if t is not None and t.numel()]
    ptrs = [t.untyped_storage().data_ptr() for t in outs]
    assert len(set(ptrs)) == len(ptrs), "two outputs share storage"
    assert given is None or given.untyped_storage().data_ptr() not in ptrs, "an output aliases the supplied amax"
    if DEVICE == "cuda":  # the op runs this twin there, and torch raises if an output aliases
        torch.ops.nvfp4.group_quantize(x, sizes, True, True, rht, 0xD7E8, False, given, None)


def test_cast_op_writes_amax_outputs_that_alias_nothing():
    """The cast op's amax outputs are its own copies of the amaxes it was given (one tensor
    for both here): equal values, and through the dispatcher, which rejects an output that
    aliases an input or another output."""
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEVICE)
    sizes = torch.tensor([10, 0, 30], device=DEVICE)
    amax = torch.rand(3, device=DEVICE) + 1
    *_, row, col = torch.ops.nvfp4_kernels.group_cast(x, sizes, amax, amax, None, True, True, False, 0, False,
                                                      False, 64, False)
    assert_bytes_equal(row, amax, "row-wise amax output")
    assert_bytes_equal(col, amax, "column-wise amax output")


def test_supplied_amaxes_cost_no_torch_copy(monkeypatch):
    """group_quantize with both amaxes supplied (the fused ops' casts of D): no torch op
    besides allocations and views -- each would be a launch of its own on CUDA. The cast
    kernel writes the returned amaxes (launches stubbed here: only the host code runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nvfp4_inductor.kernels import group_amax, group_cast

    for module in (group_amax, group_cast):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, **kw: None)
    class Ops(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not (func.is_view or func.__name__.split(".")[0] in ("empty", "new_empty", "empty_strided")):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(40, 32).bfloat16().to(DEVICE)
    sizes = torch.tensor([10, 0, 30], device=DEVICE)
    row, col, seed = torch.rand(3, device=DEVICE), torch.rand(3, device=DEVICE), torch.tensor(7, device=DEVICE)
    with Ops() as ops:
        kernels.group_quantize(x, sizes, rowwise=True, columnwise=True, rht=True, stochastic_rounding=True,
                               rowwise_amax=row, columnwise_amax=col, seed=seed)
    assert ops.seen == [], ops.seen


@pytest.mark.parametrize("name", list(SINGLE_CASES))
def test_quantize_matches_reference(name):
    x = random_input(48, 64, seed=len(name))
    options = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in SINGLE_CASES[name].items()}
    assert_nvfp4_equal(kernels.quantize(x, **options), numerics.quantize_torch(x, **options), f"quantize[{name}]")


def test_quantize_edge_cases():
    x, _ = edge_input(seed=1)
    for options in (_RHT, dict(_RHT, stochastic_rounding=True, seed=9), dict(rowwise=True, columnwise=True, block_2d=True),
                    _ROW_ONLY, dict(_ROW_ONLY, stochastic_rounding=True, seed=9)):
        assert_nvfp4_equal(kernels.quantize(x, **options), numerics.quantize_torch(x, **options), f"quantize[edge {options}]")


def test_quantize_rejects_2d_rht():
    with pytest.raises(NotImplementedError, match="never transformed"):
        kernels.quantize(random_input(16, 16, 0), columnwise=True, rht=True, block_2d=True)


@pytest.mark.parametrize("block_2d", [True, False], ids=["2d", "1x16"])
def test_quantize_weights_matches_reference(block_2d):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 32, 48, generator=g)
    w[1] *= 1e-3
    w[2, :16, :16] = 0.0
    w = _bf16(w)
    actual = kernels.quantize_weights(w, block_2d=block_2d)
    assert_nvfp4_equal(actual, numerics.quantize_weights_torch(w, block_2d=block_2d), f"weights[{block_2d=}]")


@pytest.mark.parametrize("shape", [(0, 32, 48), (2, 0, 32), (1, 16, 16), (4, 512, 64), (8, 48, 32)],
                         ids=["no_experts", "no_rows", "one", "more_rows_than_a_program", "experts_share_programs"])
def test_quantize_weights_of_empty_and_single_stacks(shape):
    # (4, 512, 64): the stack's 2048 rows span several amax and cast programs (256 rows each
    # in the interpreter), so a grid sized by one expert's rows leaves experts at amax 0;
    # (8, 48, 32): one program holds several experts, each of 3 runs of 16 rows
    w = _bf16(torch.randn(*shape, generator=torch.Generator().manual_seed(5)))
    assert_nvfp4_equal(kernels.quantize_weights(w), numerics.quantize_weights_torch(w), f"weights{shape}")


@pytest.mark.parametrize("sign_mask", [0xD7E8, 0], ids=["mask_d7e8", "mask0"])
def test_group_hadamard_amax_matches_reference(sign_mask):
    x, sizes = edge_input(seed=2)
    for actual, expected, label in zip(
        kernels.group_hadamard_amax(x, sizes, sign_mask),
        numerics.group_hadamard_amax_torch(x, sizes, sign_mask),
        ("pre-RHT amax", "post-RHT amax"),
    ):
        assert_bytes_equal(actual, expected, label)


# ---------------------------------------------------------------------------------------
# Device functions, tables


@triton.jit
def _probe_kernel(f_ptr, i_ptr, out_i_ptr, out_f_ptr, seed, N: tl.constexpr, WHICH: tl.constexpr):
    offs = tl.arange(0, N)
    f = tl.load(f_ptr + offs)
    i = tl.load(i_ptr + offs)
    if WHICH == 0:
        tl.store(out_i_ptr + offs, e4m3_encode_nonneg(f))
        tl.store(out_f_ptr + offs, e4m3_decode(i & 0x7F))
    elif WHICH == 1:
        tl.store(out_i_ptr + offs, e2m1_rne(f))
        tl.store(out_f_ptr + offs, bf16_round(f))
    elif WHICH == 2:
        tl.store(out_i_ptr + offs, e2m1_stochastic(f, i))
    else:
        w0, w1, w2, w3 = philox_words(seed, i, 1)
        tl.store(out_i_ptr + offs, w0.to(tl.int64))
        tl.store(out_i_ptr + N + offs, w1.to(tl.int64))
        tl.store(out_i_ptr + 2 * N + offs, w2.to(tl.int64))
        tl.store(out_i_ptr + 3 * N + offs, w3.to(tl.int64))


import triton.language as tl  # noqa: E402

from nvfp4_inductor.kernels._nvfp4 import (  # noqa: E402
    bf16_round,
    e2m1_rne,
    e2m1_stochastic,
    e4m3_decode,
    e4m3_encode_nonneg,
    philox_words,
)


def _probe(which, f, i, seed=0, out_dtype=torch.int32, out_len=None):
    n = f.numel()
    out_i = torch.zeros(out_len or n, dtype=out_dtype, device=DEVICE)
    out_f = torch.zeros(n, dtype=torch.float32, device=DEVICE)
    _probe_kernel[(1,)](f, i, out_i, out_f, seed, N=n, WHICH=which)
    return out_i, out_f


def test_e4m3_encoder_every_code_and_midpoint():
    codes = torch.arange(0x7F)
    values = numerics.e4m3_decode(codes.to(torch.uint8))
    mids = (values[:-1] + values[1:]) / 2
    extra = torch.tensor([448.0, 449.0, 463.9, 464.0, 1e30, float("inf"), 2.0**-10, 2.0**-10 * 1.0001, 2.0**-11, 0.0])
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(4096 - 127 - 126 - extra.numel(), generator=g) * 2.0 ** torch.randint(-14, 10, (1,), generator=g)
    f = torch.cat((values, mids, extra, rand)).float().to(DEVICE)
    i = torch.arange(4096, dtype=torch.int32, device=DEVICE) % 0x7F
    out_i, out_f = _probe(0, f, i)
    assert_bytes_equal(out_i.to(torch.uint8), e4m3_encode(f), "e4m3 encode")
    assert_bytes_equal(out_f, numerics.e4m3_decode((i % 0x7F).to(torch.uint8)), "e4m3 decode")


_PAST_SIX = torch.tensor([6.0001, 6.5, 7.0, 7.99, 8.0, 1e30, float("inf")])


def test_e2m1_rne_ties_and_bf16_rounding():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    g = torch.Generator().manual_seed(1)
    vals = torch.cat((grid, ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(9.0)), torch.tensor([-0.0])))
    # the encoder takes x * enc unclamped and saturates itself: values past 6, up to inf
    vals = torch.cat((vals, _PAST_SIX))
    vals = torch.cat((vals, -vals[:-1], (torch.rand(1024 - 2 * vals.numel() + 1, generator=g) * 16 - 8)))
    f = vals.float().to(DEVICE)
    out_i, out_f = _probe(1, f, torch.zeros(1024, dtype=torch.int32, device=DEVICE))
    assert_bytes_equal(out_i.to(torch.uint8), e2m1_encode(f.clamp(-6.0, 6.0)), "e2m1 RNE")
    assert_bytes_equal(out_f, f.to(torch.bfloat16).float(), "bf16 RNE")


def test_e2m1_stochastic_matches_reference():
    g = torch.Generator().manual_seed(2)
    f = (torch.rand(2048, generator=g) * 16 - 8)
    f[:8] = torch.tensor([6.0, -6.0, 0.0, -0.0, 0.5, 1.75, 4.0, 5.0])
    f[8:8 + _PAST_SIX.numel()] = _PAST_SIX
    # every byte against the grid points, their neighbours and the interval midpoints
    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 2.0**-10, 2.0**-9])
    probes = torch.cat((grid, grid.nextafter(torch.tensor(0.0)), grid.nextafter(torch.tensor(9.0))))
    f[64:64 + 256] = probes.repeat(6)[:256]
    r = torch.randint(0, 256, (2048,), generator=g, dtype=torch.int32)
    r[64:64 + 256] = torch.arange(256, dtype=torch.int32)
    out_i, _ = _probe(2, f.to(DEVICE), r.to(DEVICE))
    expected = numerics.e2m1_round_stochastic(f.clamp(-6.0, 6.0), r.to(torch.uint8))
    assert_bytes_equal(out_i.to(torch.uint8).cpu(), expected, "e2m1 stochastic")


def test_e2m1_stochastic_at_every_threshold():
    """For each grid interval and each byte r: the exact threshold lo + (r + 0.5) / 256 * step
    (stays down) and its fp32 neighbours on both sides (down, up)."""
    lo = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0], dtype=torch.float64)
    step = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0], dtype=torch.float64)
    r = torch.arange(256, dtype=torch.float64)
    at = (lo[:, None] + (r[None, :] + 0.5) / 256 * step[:, None]).float().flatten()  # exact in fp32
    f = torch.cat((at, at.nextafter(torch.tensor(0.0)), at.nextafter(torch.tensor(9.0))))
    f = torch.cat((f, -f, torch.zeros(16384 - 2 * f.numel())))
    rb = torch.arange(256, dtype=torch.int32).repeat(7 * 3 * 2)
    rb = torch.cat((rb, torch.zeros(16384 - rb.numel(), dtype=torch.int32)))
    out_i, _ = _probe(2, f.to(DEVICE), rb.to(DEVICE))
    expected = numerics.e2m1_round_stochastic(f, rb.to(torch.uint8))
    assert_bytes_equal(out_i.to(torch.uint8).cpu(), expected, "e2m1 stochastic thresholds")


@pytest.mark.parametrize("seed", [0, 1234, 2**40 + 5, 2**63 - 2])
def test_philox_matches_reference(seed):
    counters = torch.cat((torch.arange(1000), torch.tensor([2**31 - 1, 2**31, 2**32 - 1]))).to(torch.int64)
    counters = torch.cat((counters, torch.zeros(1024 - counters.numel(), dtype=torch.int64)))
    out_i, _ = _probe(3, torch.zeros(1024, device=DEVICE), counters.to(DEVICE), seed=seed, out_dtype=torch.int64, out_len=4096)
    expected = torch.cat(numerics.philox4x32(seed, counters, 1))
    assert_bytes_equal(out_i.cpu(), expected, f"philox words seed={seed}")


# ---------------------------------------------------------------------------------------
# Ops: registration, fake impls, torch.compile


def test_ops_registered_with_fake_impls():
    for name in ("group_amax", "group_cast"):
        assert hasattr(torch.ops.nvfp4_kernels, name), name
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(40, 32, dtype=torch.bfloat16, device=DEVICE)
        sizes = torch.empty(3, dtype=torch.int64, device=DEVICE)
        out = torch.ops.nvfp4_kernels.group_cast(x, sizes, torch.empty(3), torch.empty(3), None,
                                                 True, True, True, 0xD7E8, False, False, 96, False)
        assert [tuple(t.shape) for t in out] == [(40, 16), (40, 2), (32, 48), (32, 6), (4,), (3,), (3,)]
        pre, post = torch.ops.nvfp4_kernels.group_amax(x, sizes, True, True, 0xD7E8, 96)
        assert pre.shape == post.shape == (3,)


def test_group_quantize_under_torch_compile():
    x = random_input(64, 32, seed=5)
    sizes = torch.tensor([10, 0, 54], device=DEVICE)

    def fn(x, sizes):
        return kernels.group_quantize(x, sizes, **_RHT, stochastic_rounding=True, seed=21).as_tuple()

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for actual, expected in zip(compiled(x, sizes), fn(x, sizes)):
        assert_bytes_equal(actual, expected, "compiled vs eager")


def test_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import importlib.util, pathlib\n"
        "spec = importlib.util.spec_from_file_location('k', pathlib.Path('nvfp4_inductor/kernels/__init__.py'),"
        " submodule_search_locations=[])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert m.available('cpu') is False\n"
        "try:\n    m.quantize(None)\nexcept NotImplementedError as e:\n    print('raised', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_repo_root())
    assert out.returncode == 0 and "raised" in out.stdout and "Triton" in out.stdout, out.stderr


def _repo_root():
    import pathlib

    return str(pathlib.Path(__file__).resolve().parents[1])


# ---------------------------------------------------------------------------------------
# GPU: big shapes (pytest -m gpu)

GPU_GROUPS = [0, 9000, 127, 0, 20000, 1, 15937, 20471]  # sums to 65536; empty, odd, not multiples of 128


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "tokens,k,options",
    [
        (65536, 4096, _RHT),
        (65536, 4096, dict(_RHT, stochastic_rounding=True, seed=2024)),
        (16384, 2048, dict(_RHT, sign_mask=0)),
        (16384, 2048, dict(rowwise=True, columnwise=True)),
    ],
    ids=["65536x4096_rht", "65536x4096_rht_sr", "16384x2048_mask0", "16384x2048_no_rht"],
)
def test_gpu_group_quantize_big(tokens, k, options):
    x = random_input(tokens, k, seed=tokens + k)
    sizes = GPU_GROUPS if tokens == 65536 else [s // 4 for s in GPU_GROUPS[:-1]] + [16384 - sum(s // 4 for s in GPU_GROUPS[:-1])]
    sizes = torch.tensor(sizes, device=DEVICE)
    actual = kernels.group_quantize(x, sizes, **options)
    expected = numerics.group_quantize_torch(x, sizes, **options)
    assert_nvfp4_equal(actual, expected, f"gpu group_quantize {tokens}x{k} {options}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_quantize_and_weights_big():
    x = random_input(16384, 2048, seed=1)
    for options in (_RHT, dict(_RHT, stochastic_rounding=True, seed=5), dict(rowwise=True, columnwise=True, block_2d=True)):
        assert_nvfp4_equal(kernels.quantize(x, **options), numerics.quantize_torch(x, **options), f"gpu quantize {options}")
    w = random_input(8 * 1024, 2048, seed=2).reshape(8, 1024, 2048)
    assert_nvfp4_equal(kernels.quantize_weights(w), numerics.quantize_weights_torch(w), "gpu weights")
    # many experts of a few runs each: programs hold runs of several experts
    w = random_input(128 * 48, 256, seed=3).reshape(128, 48, 256)
    for block_2d in (True, False):
        assert_nvfp4_equal(kernels.quantize_weights(w, block_2d=block_2d),
                           numerics.quantize_weights_torch(w, block_2d=block_2d), f"gpu weights 128 experts {block_2d=}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: c.id)
def test_gpu_small_cases(case):
    """The CPU cases again, compiled for the GPU (catches FMA contraction, FTZ, approx div);
    one test each, so a time-limited GPU run reports how far it got."""
    test_group_quantize_matches_reference(case)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sign_mask", [0xD7E8, 0], ids=["mask_d7e8", "mask0"])
@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
def test_gpu_edge_cases(sign_mask, sr):
    test_group_quantize_edge_cases(sign_mask, sr)
    if sign_mask == 0xD7E8 and not sr:
        test_quantize_edge_cases()


@pytest.mark.gpu
@needs_cuda
def test_gpu_encoder_tables():
    """The device-function tables compiled for the GPU: one small kernel, a few seconds
    (the case sweep above compiles a kernel per option set and takes minutes)."""
    test_e4m3_encoder_every_code_and_midpoint()
    test_e2m1_rne_ties_and_bf16_rounding()
    test_e2m1_stochastic_matches_reference()
    test_e2m1_stochastic_at_every_threshold()
    for seed in (0, 2**40 + 5):
        test_philox_matches_reference(seed)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cast_amax_outputs():
    """The cast kernel's amax outputs (program (0, 0) copies them) compiled for the GPU, and
    through triton_op; supplied amaxes against the reference there."""
    test_cast_op_writes_amax_outputs_that_alias_nothing()
    for rht in (False, True):
        test_group_quantize_outputs_alias_nothing(rht, True)
    for name in ("supplied_row_amax_no_rht", "supplied_both_rht"):
        test_quantize_matches_reference(name)
