"""``group_cast(..., row_deq=True)``: the row-wise copy written as its deq() values (bf16),
bit for bit ``dequantize_bf16`` of the packed copy the same cast writes without it, for every
kind of launch that writes a row-wise copy: row-only RNE and SR (1 and several column
blocks, a K tail), row + column RNE (the column-wise copy unchanged), and the 2D weight
stacks (shared codes). Edge values: zero blocks, -0, values that saturate or underflow,
subnormal scales; empty groups."""

from __future__ import annotations

import pytest
import torch

from _assertions import assert_bytes_equal

triton = pytest.importorskip("triton")
from nvfp4_inductor import kernels, numerics  # noqa: E402
from nvfp4_inductor.kernels import config  # noqa: E402
from nvfp4_inductor.kernels.config import CastConfig  # noqa: E402
from nvfp4_inductor.kernels.dequantize import dequantize_bf16  # noqa: E402
from nvfp4_inductor.kernels.group_amax import group_amax  # noqa: E402
from nvfp4_inductor.kernels.group_cast import group_cast  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not kernels.available(DEVICE):
    pytest.skip(f"Triton kernels cannot run on {DEVICE}", allow_module_level=True)


def _input(tokens, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen) * torch.randn(tokens, 1, generator=gen).exp()
    x[0, :16] = 0.0  # a zero block
    x[1, :16] = -0.0
    x[2, 16:32] = torch.tensor([1e-6] + [1.0] * 15)  # underflows to 0 in its block
    x[3, :] *= 2.0**-30  # tiny blocks: subnormal E4M3 scales once the group amax is large
    x[4, 0] = 3.0e4  # saturating against the group amax
    return x.to(torch.bfloat16).to(DEVICE)


def _cast(x, sizes, amax, seed, rowwise, columnwise, sr, deq):
    cap = numerics.columnwise_capacity(x.shape[0], sizes.shape[0])
    return group_cast(x, sizes, amax, amax, seed, rowwise, columnwise, True, 0xD7E8, False, sr, cap, False,
                      deq and rowwise)


TILES = {"default": None, "32x32": CastConfig(32, 32, 4), "16x32 k2": CastConfig(16, 32, 1, k_blocks=2),
         "16x32 k2 u4": CastConfig(16, 32, 1, k_blocks=2, token_unroll=4)}
COPIES = {"row-rne": ((True, False), False), "row-sr": ((True, False), True), "row+col-rne": ((True, True), False)}


# Every copy/rounding case on the default tiles; on the other tiles the two that cover the
# rest between them (row-wise alone with SR, both copies with RNE): the interpreter takes
# 20-40 s a case at 16x32 tiles.
@pytest.mark.parametrize("copies,sr,tiles", [
    pytest.param(*COPIES[c], TILES[t], id=f"{c}-{t}") for t in TILES for c in COPIES
    if t == "default" or c != "row-rne"])
def test_row_deq_copy_equals_the_dequantized_packed_copy(copies, sr, tiles):
    x = _input(38, 80, 3)  # K = 80: a tail of 16 past the 32- and 64-column blocks
    sizes = torch.tensor([12, 0, 17, 9], device=DEVICE)  # ragged around the 16- and 32-token tiles
    pre, post = kernels.group_hadamard_amax(x, sizes)
    seed = torch.full((1,), 11, dtype=torch.int64, device=DEVICE)
    with config.override(cast=tiles):
        packed = _cast(x, sizes, post, seed, *copies, sr, False)
        deq = _cast(x, sizes, post, seed, *copies, sr, True)
    assert deq[0].dtype == torch.bfloat16 and deq[0].shape == x.shape and deq[1].numel() == 0
    assert_bytes_equal(deq[0], dequantize_bf16(packed[0], packed[1]), "row deq vs dequantized packed copy")
    for i in (2, 3, 4, 5, 6):  # the column-wise copy, offsets and amaxes do not change
        assert_bytes_equal(deq[i], packed[i], f"output {i}")


def test_row_deq_of_weight_stacks():
    """2D blocks with the codes shared by both copies (SHARED_CODES)."""
    gen = torch.Generator().manual_seed(5)
    g, n, k = 3, 32, 48
    w = (torch.randn(g * n, k, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    w[5, :] = 0.0
    amax, _ = group_amax(w, None, True, False, 0, n, True)
    packed = group_cast(w, None, amax, amax, None, True, True, False, 0, True, False, n, True, False)
    deq = group_cast(w, None, amax, amax, None, True, True, False, 0, True, False, n, True, True)
    assert_bytes_equal(deq[0], dequantize_bf16(packed[0], packed[1]), "weight stack row deq")
    for i in (2, 3):  # the column-wise copy (its codes shared with the row-wise ones) does not change
        assert_bytes_equal(deq[i], packed[i], f"weight stack output {i}")
