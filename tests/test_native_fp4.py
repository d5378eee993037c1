"""The FP4 tensor-core grouped GEMMs (kernels/grouped_gemm_fp4.py): what the CPU can prove.

* **Lowering**: both kernels, traced as on a GPU (``NATIVE`` on), compile for sm_100 with the
  installed Triton (no GPU needed: Triton compiles ahead of time and ships ptxas) to a cubin
  whose PTX multiplies with ``tcgen05.mma ... kind::mxf4nvf4`` and 16-element E4M3 block
  scales (``block16``; Triton 3.6 spells it ``scale_vec::4X``). A scale tile of the wrong
  dtype or shape would lower to ``kind::mxf4`` with 32-element E8M0 blocks, or not compile.
* **Numbers**: under the interpreter the kernel runs with its one MMA instruction replaced by
  an exact sum of each K step (module docstring: the interpreter reads E4M3 scales of
  ``dot_scaled`` as E8M0). Its outputs equal the Triton target's bf16-operand GEMMs bit for
  bit at the same BK (so tile addressing, scale addressing, schedule and epilogue are the
  proven ones), and meet the fp64 bound of tests/test_kernels_gemm_bf16.py against the
  reference (numerics.md 7's fp32-accumulation level), on random operands (every code, scales
  from subnormal to 448, uneven and empty groups, K tails) and on the real quantizers' copies
  of numerics.md 8's edge cases (zero blocks, an all-zero group, an empty group, saturated
  blocks, subnormal and underflowing scales), fprop, dgrad and wgrad.
* **Call contract**: shapes and dtypes under FakeTensorMode (nothing launched), the argument
  errors, and what the launch receives (the containers' own buffers, scales unswizzled).

What only an SM10x GPU can prove: that ``tcgen05.mma`` reads the scale tiles as Triton lays
them out, and the accumulator's precision and order (the bound above is the claim to test there).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from nvfp4_inductor import numerics
from nvfp4_inductor.tensor import Operand

from _assertions import assert_bytes_equal
from gemm_cases import Step, check_bound, fprop_case, fprop_ref, wgrad_case, wgrad_ref

triton = pytest.importorskip("triton")
from nvfp4_inductor import kernels  # noqa: E402
from nvfp4_inductor.kernels import grouped_gemm_fp4 as fp4  # noqa: E402
from nvfp4_inductor.kernels.grouped_gemm_bf16 import grouped_gemm_via_bf16, grouped_gemm_wgrad_via_bf16  # noqa: E402

if not kernels.available("cpu") and not torch.cuda.is_available():
    pytest.skip("Triton kernels cannot run here (no CUDA and TRITON_INTERPRET unset)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Pruned from test_kernels_gemm_bf16.STEPS for time (the interpreter runs two kernels a case):
# uneven sizes with empty groups and sizes off 16, and SwiGLU's doubled F with a size-1 group.
STEPS = [
    Step("uneven_empty", (5, 0, 37, 16, 22, 0), 64, 48),
    Step("swiglu_edges", (0, 1, 15, 17, 0, 33), 32, 32, swiglu=True),
]
# uneven_empty's fc2_fprop has K = 48: with the interpreter's BK = 32 its second step is a
# masked K tail (code 0, scale 0 past K)
FPROPS = ["fc1_fprop", "fc2_fprop", "fc2_dgrad", "fc1_dgrad"]
WGRADS = ["fc2_wgrad", "fc1_wgrad"]


def bits(t):
    return t.view(torch.int16)


# ---------------------------------------------------------------------------------------
# Lowering: the kernels compile to FP4 tensor-core MMAs for sm_100


_COMPILE = textwrap.dedent("""
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from nvfp4_inductor.kernels import grouped_gemm_fp4 as m

    ptrs = {"a_ptr": "*u8", "sa_ptr": "*fp8e4nv", "a_amax_ptr": "*fp32", "b_ptr": "*u8",
            "sb_ptr": "*fp8e4nv", "b_amax_ptr": "*fp32", "out_ptr": "*bf16"}
    tiles = {"BM": 128, "BN": 128, "BK": 256, "NUM_PROGRAMS": 148, "NUM_STAGES": 3, "NATIVE": True}
    kernels = {
        "fprop": (m._grouped_gemm_fp4_kernel,
                  {**ptrs, "sizes_ptr": "*i64", "N": "i32", "K": "i32", "G": "i32"},
                  {**tiles, "BLOCK_G": 8, "EVEN_K": False, "BAND": 8}),
        "wgrad": (m._grouped_gemm_wgrad_fp4_kernel,
                  {**ptrs, "offsets_ptr": "*i64", "N": "i32", "M": "i32", "P": "i32", "G": "i32"}, tiles),
    }
    found = {}
    for name, (fn, signature, constexprs) in kernels.items():
        signature = {**signature, **{c: "constexpr" for c in constexprs}}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", int(sys.argv[1]), 32), options={"num_warps": 4})
        found[name] = {
            "cubin_bytes": len(compiled.asm["cubin"]),
            "ptx_mmas": sorted(set(re.findall(r"tcgen05\\.mma[\\w.:]*", compiled.asm["ptx"]))),
            # each scaled MMA of the TTGIR: its operand formats and its scales' memory types
            "ttgir_mmas": [line.split(" lhs = ", 1)[1] for line in compiled.asm["ttgir"].splitlines()
                           if "tc_gen5_mma_scaled" in line],
        }
    print(json.dumps(found))
""")


def test_kernels_lower_to_nvfp4_tensor_core_mma_for_sm100(tmp_path):
    """A fresh process with the interpreter off (kernels decorated as on a GPU) compiles both
    kernels for sm_100 (BK = 256). Each cubin multiplies only with NVFP4 MMAs: E2M1 x E2M1
    operands whose scales sit in tensor memory as (128, 256/16) E4M3 tiles (a uint8 scale
    tile would be E8M0 there, i8), and PTX ``kind::mxf4nvf4`` with 16-element blocks."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="needs Triton's NVIDIA backend to compile for sm_100")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", _COMPILE, "100"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(found) == {"fprop", "wgrad"}, found
    for name, kernel in found.items():
        assert kernel["cubin_bytes"] > 0, f"{name}: no cubin"
        assert kernel["ptx_mmas"] and kernel["ttgir_mmas"], f"{name}: no scaled tcgen05 MMA: {kernel}"
        for mma in kernel["ptx_mmas"]:
            assert "kind::mxf4nvf4" in mma and ("block16" in mma or "scale_vec::4X" in mma), (
                f"{name}: {mma} is not an MMA of E2M1 operands with 16-element blocks")
        for op in kernel["ttgir_mmas"]:
            assert op.startswith("e2m1 rhs = e2m1") and len(re.findall(r"memdesc<128x16xf8E4M3FN", op)) == 2, (
                f"{name}: scaled MMA without E2M1 operands and two (128, 16) E4M3 scale tiles: {op[:300]}")


# ---------------------------------------------------------------------------------------
# Numbers under the interpreter: bitwise against the bf16-operand kernels, bounded against
# the reference


@pytest.mark.parametrize("which", FPROPS)
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_fprop_dgrad_equals_bf16_kernel_and_meets_bound(step, which):
    args, k = fprop_case(step, which, salt="fp4")
    out = fp4.grouped_gemm_fp4(*args)
    assert_bytes_equal(out, grouped_gemm_via_bf16(*args), f"{step}/{which}: fp4 kernel vs bf16-operand kernel")
    ref, absref = fprop_ref(*args)
    check_bound(out.cpu(), ref.cpu(), absref.cpu(), k, f"{step}/{which}")


@pytest.mark.parametrize("which", WGRADS)
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_wgrad_equals_bf16_kernel_and_meets_bound(step, which):
    args, p = wgrad_case(step, which, salt="fp4")
    out = fp4.grouped_gemm_wgrad_fp4(*args)
    assert_bytes_equal(out, grouped_gemm_wgrad_via_bf16(*args), f"{step}/{which}: fp4 kernel vs bf16-operand kernel")
    ref, absref = wgrad_ref(*args)
    check_bound(out.cpu(), ref.cpu(), absref.cpu(), p, f"{step}/{which}")
    sizes = torch.tensor(step.sizes)
    assert not out[sizes == 0].view(torch.int16).any(), "an empty group's dW must be +0"


def _edge_inputs(k, gen):
    """(T, k) bf16 activations of groups (20, 0, 17, 9) with numerics.md 8's cases: group 0
    random; group 2 holds an all-zero block, a block whose scale is subnormal (2**-10 < s <
    2**-6), one whose scale underflows to 0 (codes +-6 that dequantize to 0) and the group's
    amax (its block saturates at scale 448, code 6); group 3 is all zeros (amax 0, alpha 0);
    group 1 is empty."""
    sizes = torch.tensor([20, 0, 17, 9])
    x = torch.randn(int(sizes.sum()), k, generator=gen)
    # a block's scale is s = amax_b * 448 / A (numerics.md 2.2), A = 40 in group 2
    x[20, :16] = 0.0  # all-zero block
    x[21, :16] = torch.randn(16, generator=gen) * 3e-4  # s ~ 2**-7: an E4M3 subnormal
    x[22, :16] = torch.randn(16, generator=gen) * 1e-6  # s < 2**-10: scale 0, codes +-6
    x[23, 16] = 40.0  # the group's amax: its block's scale is 448
    x[37:] = 0.0
    return x.to(torch.bfloat16), sizes


def _edge_scales_present(q):
    """The edge cases really are in the copy: zero, subnormal (0x01-0x07) and 448 (0x7E) scales."""
    s = q.rowwise_scale.view(torch.uint8)
    assert (s == 0).any() and ((s > 0) & (s < 8)).any() and (s == 0x7E).any()


def test_edge_cases_from_the_quantizers():
    """fprop, dgrad and wgrad on copies made by the reference quantizers (numerics.md 8),
    against the reference GEMMs and bit for bit against the bf16-operand kernels."""
    gen = torch.Generator().manual_seed(8)
    h, f = 64, 48
    x, sizes = _edge_inputs(h, gen)
    w = torch.randn(4, f, h, generator=gen).to(torch.bfloat16)
    w[0] = 0.0  # group 0's expert is all zeros: amax 0, alpha 0
    xq = numerics.group_quantize_torch(x, sizes, rowwise=True, columnwise=True)
    _edge_scales_present(xq)
    wq = numerics.quantize_weights_torch(w)
    dy = torch.randn(x.shape[0], f, generator=gen).to(torch.bfloat16)
    dyq = numerics.group_quantize_torch(dy, sizes, rowwise=True, columnwise=True)
    gemms = {
        "fprop": (fp4.grouped_gemm_fp4, grouped_gemm_via_bf16, numerics.grouped_gemm_torch,
                  (xq.rowwise(), wq.rowwise(), sizes), h),
        "dgrad": (fp4.grouped_gemm_fp4, grouped_gemm_via_bf16, numerics.grouped_gemm_torch,
                  (dyq.rowwise(), wq.columnwise(), sizes), f),
        "wgrad": (fp4.grouped_gemm_wgrad_fp4, grouped_gemm_wgrad_via_bf16, numerics.grouped_gemm_wgrad_torch,
                  (dyq.columnwise(), xq.columnwise(), xq.columnwise_offsets), xq.columnwise_data.shape[1] * 2),
    }
    # outputs that must be +0: group 0 (its expert is zero), group 3 (all-zero input) in fprop;
    # group 0 in dgrad; the empty group 1's dW in wgrad
    zero_rows = {"fprop": (slice(0, 20), slice(37, 46)), "dgrad": (slice(0, 20),), "wgrad": (1,)}
    for name, (ours, bf16_kernel, reference, args, k) in gemms.items():
        out = ours(*args)
        assert_bytes_equal(out, bf16_kernel(*args), f"edge {name}: fp4 kernel vs bf16-operand kernel")
        exact, absexact = (wgrad_ref if name == "wgrad" else fprop_ref)(*args)
        check_bound(out, exact, absexact, k, f"edge {name}")
        # the reference is within the same bound of the exact value: the two within one bf16 ulp
        ref = reference(*args).double()
        ulp = 2.0**-7 * torch.maximum(ref.abs(), out.double().abs())
        assert ((out.double() - ref).abs() <= ulp + 4 * k * 2.0**-24 * absexact).all(), (
            f"edge {name}: further than one bf16 ulp (plus fp32 accumulation) from numerics' reference")
        for rows in zero_rows[name]:
            assert not bits(out[rows]).any(), f"edge {name}: rows {rows} (alpha 0 or no tokens) must be +0"


def test_deterministic():
    args, _ = fprop_case(STEPS[0], "fc1_fprop", salt="det")
    assert_bytes_equal(fp4.grouped_gemm_fp4(*args), fp4.grouped_gemm_fp4(*args), "two runs")


# ---------------------------------------------------------------------------------------
# Call contract


def test_fake_tensors_give_shapes_and_dtypes_without_launching():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t, g, n, k, m, p = 70, 5, 48, 64, 32, 160
        a = torch.empty(t, k // 2, dtype=torch.uint8)
        sa = torch.empty(t, k // 16, dtype=torch.float8_e4m3fn)
        b = torch.empty(g, n, k // 2, dtype=torch.uint8)
        sb = torch.empty(g, n, k // 16, dtype=torch.float8_e4m3fn)
        amax = torch.empty(g)
        out = fp4.grouped_gemm_fp4(Operand(a, sa, amax), Operand(b, sb, amax), torch.empty(g, dtype=torch.int64))
        assert (out.shape, out.dtype) == ((t, n), torch.bfloat16)
        out = fp4.grouped_gemm_fp4(Operand(a[:0], sa[:0], amax), Operand(b, sb, amax),
                                   torch.empty(g, dtype=torch.int64))
        assert (out.shape, out.dtype) == ((0, n), torch.bfloat16)
        wa = torch.empty(n, p // 2, dtype=torch.uint8)
        wsa = torch.empty(n, p // 16, dtype=torch.uint8)  # scales as their uint8 bits
        wb = torch.empty(m, p // 2, dtype=torch.uint8)
        wsb = torch.empty(m, p // 16, dtype=torch.float8_e4m3fn)
        out = fp4.grouped_gemm_wgrad_fp4(Operand(wa, wsa, amax), Operand(wb, wsb, amax),
                                         torch.empty(g + 1, dtype=torch.int64))
        assert (out.shape, out.dtype) == ((g, n, m), torch.bfloat16)


def _operands():
    """The fprop's arguments flattened (a's data, scale, amax, b's, group sizes), to spoil one by position."""
    (a, b, sizes), _ = fprop_case(STEPS[0], "fc1_fprop", salt="contract")
    return [*a, *b, sizes]


def _call(gemm, flat):
    """`gemm` on flattened arguments (``_operands``'s order)."""
    return gemm(Operand(*flat[:3]), Operand(*flat[3:6]), flat[6])


@pytest.mark.parametrize("position, bad, message", [
    (0, lambda a: a.view(torch.int8), "a_data must be uint8"),
    (3, lambda b: torch.zeros(*b.shape[:2], 2 * b.shape[2], dtype=torch.bfloat16), "b_data must be packed"),
    (1, lambda s: s.to(torch.float32), "a_scale must be float8_e4m3fn"),
    (4, lambda s: s[:, :, :-1], "b's scale must be"),
    (2, lambda amax: amax[:-1], "a_amax must be"),
    (6, lambda sizes: sizes[:-1], "group_sizes must be"),
], ids=["int8_data", "deq_operand", "fp32_scale", "scale_shape", "amax_shape", "group_sizes"])
def test_fprop_argument_errors_name_the_argument(position, bad, message):
    args = _operands()
    args[position] = bad(args[position])
    with pytest.raises(ValueError, match=message):
        _call(fp4.grouped_gemm_fp4, args)


def test_wgrad_argument_errors_name_the_argument():
    (a, b, offsets), _ = wgrad_case(STEPS[0], "fc2_wgrad", salt="contract")
    with pytest.raises(ValueError, match="b_amax must be"):
        fp4.grouped_gemm_wgrad_fp4(a, b._replace(amax=b.amax[:-1]), offsets)
    with pytest.raises(ValueError, match="must share P"):
        fp4.grouped_gemm_wgrad_fp4(a._replace(data=a.data[:, :-8]), b, offsets)


def test_config_refuses_partial_scale_blocks():
    with pytest.raises(ValueError, match="block_k must be a power of 2"):
        fp4.Fp4GemmConfig(32, 32, 48, 4, 1)


def test_launch_reads_the_containers_in_place(replace_launches):
    """The kernel gets the packed codes and the plain row-major E4M3 scales as the
    containers hold them (same storage: no copy, no swizzle), K in elements, and NATIVE
    off under the interpreter only."""
    calls = []
    replace_launches(lambda launch: lambda kernel, grid, **kw: calls.append((kernel, grid, kw)))
    args = _operands()
    _call(fp4.grouped_gemm_fp4, args)
    (wa, wb, offsets), p = wgrad_case(STEPS[0], "fc2_wgrad", salt="contract")
    wargs = [*wa, *wb, offsets]
    fp4.grouped_gemm_wgrad_fp4(wa, wb, offsets)
    assert [c[0] for c in calls] == [fp4._grouped_gemm_fp4_kernel, fp4._grouped_gemm_wgrad_fp4_kernel]
    (_, _, kw), (_, _, wkw) = calls
    for key, arg in zip(("a_ptr", "sa_ptr", "b_ptr", "sb_ptr", "sizes_ptr"), (0, 1, 3, 4, 6)):
        assert kw[key].data_ptr() == args[arg].data_ptr(), key
    assert kw["sa_ptr"].dtype == torch.float8_e4m3fn and kw["sa_ptr"].shape == args[1].shape
    assert kw["K"] == 2 * args[0].shape[1] and kw["N"] == args[3].shape[1] and kw["G"] == args[3].shape[0]
    assert kw["NATIVE"] is (DEVICE == "cuda")
    for key, arg in zip(("a_ptr", "sa_ptr", "b_ptr", "sb_ptr", "offsets_ptr"), (0, 1, 3, 4, 6)):
        assert wkw[key].data_ptr() == wargs[arg].data_ptr(), key
    assert wkw["P"] == p and wkw["BK"] % 32 == 0
