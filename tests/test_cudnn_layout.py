"""Layout adapters of the cuDNN target (lowerings/cudnn_layout.py): exact round trips, and
each layout checked against a formula derived independently (offsets by enumeration,
torch's own ``to_blocked`` for the 32x4x4 form, the frontend tests' gate/up indexing)."""

import pytest
import torch

from nvfp4_inductor import numerics
from nvfp4_inductor.lowerings import cudnn_layout as L


def _scales(lead, mn, sfk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (lead, mn, sfk), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("lead,mn,sfk", [(1, 128, 4), (2, 200, 6), (3, 37, 1), (1, 256, 8)])
def test_swizzle_offsets_by_enumeration(lead, mn, sfk):
    """cuBLAS's 128x4 layout, written out: 512-byte tiles in (row tile, column tile) order,
    inside a tile byte (r % 32) * 16 + ((r % 128) // 32) * 4 + k % 4."""
    s = _scales(lead, mn, sfk)
    flat = L.swizzle_scales(s).reshape(lead, -1)
    rk = -(-sfk // 4)
    for l in range(lead):
        for r in range(mn):
            for k in range(sfk):
                offset = ((r // 128) * rk + k // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + k % 4
                assert flat[l, offset] == s[l, r, k]
    rm = -(-mn // 128)
    assert flat.shape[1] == rm * rk * 512
    # everything not written is a zero scale
    assert int((flat != 0).sum()) == lead * mn * sfk


@pytest.mark.parametrize("lead,mn,sfk", [(1, 128, 4), (2, 200, 6), (3, 37, 1)])
def test_swizzle_round_trip_and_kernel_view(lead, mn, sfk):
    s = _scales(lead, mn, sfk, seed=1)
    tiled = L.swizzle_scales(s)
    assert tiled.shape == (lead, -(-mn // 128), -(-sfk // 4), 32, 4, 4) and tiled.is_contiguous()
    assert torch.equal(L.unswizzle_scales(tiled, mn, sfk), s)
    view = L.kernel_view(tiled)  # (32, 4, rm, 4, rk, L): row r -> (r % 32, (r // 32) % 4, r // 128)
    for r in sorted({0, 31, 32, 127, mn - 1} & set(range(mn))):
        for k in range(sfk):
            assert view[r % 32, (r // 32) % 4, r // 128, k % 4, k // 4, lead - 1] == s[lead - 1, r, k]


def to_blocked(m):
    """torch's own statement of the layout (torch/testing/_internal/common_quantized.py,
    ``to_blocked``, transcribed: that module needs expecttest to import)."""
    rows, cols = m.shape
    nr, nc = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros((nr * 128, nc * 4), dtype=m.dtype)
    padded[:rows, :cols] = m
    blocks = padded.view(nr, 128, nc, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def test_torch_blocked_form_is_torchs_to_blocked():
    for mn, sfk in ((128, 4), (300, 10), (16, 1)):
        s = _scales(1, mn, sfk, seed=2)[0]
        assert torch.equal(L.torch_blocked_scales(s), to_blocked(s).reshape(-1))


@pytest.mark.parametrize("sizes", [[10, 0, 300, 256], [0, 0], [1], [256, 512, 0, 3]])
def test_padded_offsets_and_rows_by_enumeration(sizes):
    sizes_t = torch.tensor(sizes)
    tokens, groups = sum(sizes), len(sizes)
    capacity = L.padded_capacity(tokens, groups)
    offsets = L.padded_offsets(sizes_t, tokens)
    rows = L.padded_rows(sizes_t, tokens)
    # enumerate: expert g's block starts at the sum of the earlier sizes rounded up to 256
    expected_rows, expected_ends, start = [], [], 0
    for m in sizes:
        expected_rows += list(range(start, start + m))
        start += -(-m // 256) * 256
        expected_ends.append(start)
    expected_ends[-1] = capacity
    assert offsets.dtype == torch.int32 and offsets.tolist() == expected_ends
    assert rows.tolist() == expected_rows
    assert capacity % 256 == 0 and capacity >= start
    assert all(e % 256 == 0 for e in offsets.tolist())
    x = torch.randn(tokens, 3)
    padded = L.pad_rows(x, rows, capacity)
    assert torch.equal(L.unpad_rows(padded, rows), x)
    assert float(padded.abs().sum()) == pytest.approx(float(x.abs().sum()))


def test_prob_view():
    sizes = torch.tensor([3, 0, 2])
    rows = L.padded_rows(sizes, 5)
    cap = L.padded_capacity(5, 3)
    probs = torch.rand(5, dtype=torch.bfloat16)
    view = L.prob_view(probs, rows, cap)
    assert view.shape == (cap, 1, 1) and view.dtype == torch.float32
    assert torch.equal(view.view(-1)[rows], probs.float()) and float(view.sum()) == float(probs.float().sum())
    ones = L.prob_view(None, rows, cap).view(-1)
    assert torch.equal(ones[rows], torch.ones(5)) and float(ones.sum()) == 5


def test_glu_interleave_matches_the_frontend_tests_indexing():
    """The frontend's tests take gate = 32-column blocks 0, 2, 4, ... and up = 1, 3, 5, ..."""
    f = 96
    w = torch.arange(2 * 2 * f * 3).reshape(2, 2 * f, 3)
    inter = L.interleave_glu(w)
    blocks = inter.reshape(2, 2 * f // 32, 32, 3)
    assert torch.equal(blocks[:, 0::2].reshape(2, f, 3), w[:, :f])  # gate
    assert torch.equal(blocks[:, 1::2].reshape(2, f, 3), w[:, f:])  # up
    assert torch.equal(L.deinterleave_glu(inter), w)
    c = torch.randn(5, 2 * f)
    assert torch.equal(L.deinterleave_glu(L.interleave_glu(c, dim=-1), dim=-1), c)
    with pytest.raises(ValueError, match="2F % 64 == 0"):
        L.interleave_glu(torch.zeros(1, 96, 2))


def test_alphas():
    a = torch.tensor([3.5, 0.0, 1e-3, 448.0])
    b = torch.tensor([2.0, 5.0, 7e2, 6.0])
    assert torch.equal(L.alpha(a, b), numerics.gemm_alpha(a, b))
    expected = torch.tensor([(x * y) ** 0.5 / 2688 for x, y in zip(a.tolist(), b.tolist())])
    torch.testing.assert_close(L.dglu_alpha(a, b), expected, rtol=1e-6, atol=0)
    # alpha^2 is the product's alpha only up to fp32 rounding: a named contract difference
    torch.testing.assert_close(L.dglu_alpha(a, b) ** 2, numerics.gemm_alpha(a, b), rtol=1e-6, atol=0)


def test_operands():
    torch.manual_seed(0)
    sizes = torch.tensor([5, 0, 20])
    x = torch.randn(25, 64, dtype=torch.bfloat16)
    q = numerics.group_quantize_torch(x, sizes)
    rows = L.padded_rows(sizes, 25)
    cap = L.padded_capacity(25, 3)
    a, sfa = L.activation_operand(q.rowwise_data, q.rowwise_scale, rows, cap)
    assert a.dtype == torch.float4_e2m1fn_x2 and a.shape == (cap, 32)
    assert sfa.dtype == torch.float8_e4m3fn and sfa.shape == (1, cap // 128, 1, 32, 4, 4)
    assert torch.equal(L.unpad_rows(a.view(torch.uint8), rows), q.rowwise_data)
    assert torch.equal(L.unpad_rows(L.unswizzle_scales(sfa.view(torch.uint8), cap, 4)[0], rows),
                       q.rowwise_scale.view(torch.uint8))
    w = numerics.quantize_weights_torch(torch.randn(3, 128, 64, dtype=torch.bfloat16))
    b, sfb = L.weight_operand(w.rowwise_data, w.rowwise_scale, glu=True)
    assert b.shape == (3, 128, 32) and sfb.shape == (3, 1, 1, 32, 4, 4)
    assert torch.equal(L.deinterleave_glu(b.view(torch.uint8)), w.rowwise_data)
    assert torch.equal(L.deinterleave_glu(L.unswizzle_scales(sfb.view(torch.uint8), 128, 4)),
                       w.rowwise_scale.view(torch.uint8))


def test_wgrad_layout_moves_each_group_to_a_256_aligned_expert():
    """Our 16-aligned column-wise copy -> the wgrad wrapper's token-major operand: each
    group's 16-token blocks (the RHT-mixed tail included) at its expert's 256-aligned start,
    zeros elsewhere; the last expert takes the slack up to a capacity from shapes alone."""
    torch.manual_seed(0)
    sizes = torch.tensor([18, 0, 300, 5])
    x = torch.randn(int(sizes.sum()), 160, dtype=torch.bfloat16)
    q = numerics.group_quantize_torch(x, sizes, columnwise=True)
    p = q.columnwise_data.shape[1] * 2
    rows, capacity, ends = L.wgrad_layout(q.columnwise_offsets, p)
    assert capacity == L.padded_capacity(p, 4) and ends.dtype == torch.int32
    assert ends.tolist() == [256, 256, 768, capacity]
    a, sfa = L.wgrad_operand(q.columnwise_data, q.columnwise_scale, rows, capacity, ends)
    assert a.dtype == torch.float4_e2m1fn_x2 and a.shape == (160, capacity // 2)
    assert sfa.dtype == torch.float8_e4m3fn and sfa.shape == (256, capacity // 16)
    data, ours = a.view(torch.uint8), q.columnwise_data
    starts = [0, 256, 256, 768]
    for g, (p0, p1) in enumerate(zip(q.columnwise_offsets[:-1].tolist(), q.columnwise_offsets[1:].tolist())):
        width = (p1 - p0) // 2
        assert torch.equal(data[:, starts[g] // 2:starts[g] // 2 + width], ours[:, p0 // 2:p1 // 2])
    assert int((data != 0).sum()) == int((ours != 0).sum())  # nothing else written


def test_expert_tiled_scales_are_the_frontend_tests_assembly():
    """Each expert's (rows, tokens_e / 16) scales in the 128x4 layout, experts back to back
    (the frontend tests' ``_wgrad_assemble_scales_2d2d``: ``to_blocked`` per expert,
    concatenated), not one 128x4 layout over all columns."""
    s = _scales(1, 200, 48, seed=3)[0]
    ends = torch.tensor([256, 256, 768], dtype=torch.int32)  # 16, 0 and 32 scale columns
    tiled = L.expert_tiled_scales(s, ends)
    assert tiled.shape == (256, 48)
    expected = torch.cat([to_blocked(s[:, :16]), to_blocked(s[:, 16:16]), to_blocked(s[:, 16:])])
    assert torch.equal(tiled.reshape(-1), expected)
    assert not torch.equal(expected, to_blocked(s))


def test_batch_view_has_the_strides_the_strict_wrappers_check():
    """(M, N) -> (M, N, 1) with strides (N, 1, M*N): what 1.32's Hadamard fc1 and dGLU
    wrappers require of A and C (they read strides as given); found by compiling those
    wrappers for sm_100a on a CPU, where ``unsqueeze(-1)``'s (N, 1, 1) was refused."""
    t = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    v = L.batch_view(t)
    assert v.shape == (6, 8, 1) and v.stride() == (8, 1, 48)
    assert torch.equal(v[:, :, 0], t) and v.data_ptr() == t.data_ptr()
