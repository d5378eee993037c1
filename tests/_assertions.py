"""Bit-exact comparison helpers for NVFP4 tests and scripts (no pytest import).

"Bit-exact means bytes": every comparison here views both tensors as
raw bytes, uses zero tolerance, and reports how many of how many bytes differ, with a
label and the first few differing positions. Usable from pytest, from benchmark
scripts and from GPU kernel tests alike: inputs may live on any device and are moved
to the CPU only to build the failure message.

    assert_bytes_equal(actual, expected, label)      any two tensors, dtype and shape too
    assert_nvfp4_equal(a, b, label)                  every field of two NVFP4Tensor /
                                                     NVFP4GroupedTensor (None must match None)
    count_differing_bytes(actual, expected) -> (n_differ, n_total)
    with dtypes_kept_for_backward() as kept: ...   the dtypes autograd saved inside the block
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch

__all__ = ["as_bytes", "count_differing_bytes", "assert_bytes_equal", "assert_nvfp4_equal",
           "dtypes_kept_for_backward"]

_MAX_REPORTED = 8  # differing positions listed in a failure message


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as uint8, shape (*t.shape, itemsize) (a copy on the CPU).

    float8 scales and uint8 codes have itemsize 1; fp32 amaxes compare by their 4 bytes
    (so -0.0 != +0.0 and NaN payloads count, as they would in memory)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    itemsize = t.element_size()
    if t.dim() == 0:
        t = t.reshape(1)
        return t.view(torch.uint8).reshape(itemsize)
    return t.view(torch.uint8).reshape(*t.shape, itemsize)


def count_differing_bytes(actual: torch.Tensor, expected: torch.Tensor) -> tuple[int, int]:
    """(number of differing bytes, total bytes) of two tensors of equal dtype and shape."""
    a, e = as_bytes(actual), as_bytes(expected)
    return int((a != e).sum()), a.numel()


def _element_repr(t: torch.Tensor, index: tuple[int, ...]) -> str:
    value = t.detach().cpu()[index] if t.dim() else t.detach().cpu()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return f"0x{int(value.view(torch.uint8)):02x} ({float(value.float())!r})"
    if t.dtype == torch.uint8:
        v = int(value)
        return f"0x{v:02x} (nibbles lo={v & 0xF} hi={v >> 4})"
    if t.is_floating_point():
        return repr(float(value))
    return repr(value.item())


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    """Raise AssertionError unless the tensors have equal dtype, shape and bytes.

    The message reads e.g. ``rowwise_data: 3 of 512 bytes differ; first at (0, 5): actual
    0x17 (nibbles lo=7 hi=1), expected 0x16 (nibbles lo=6 hi=1); ...``."""
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(f"{label}: expected two tensors, got {type(actual).__name__} and {type(expected).__name__}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{label}: dtype {actual.dtype} != expected {expected.dtype}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{label}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = as_bytes(actual), as_bytes(expected)
    differ = a != e
    n_differ, n_total = int(differ.sum()), a.numel()
    if n_differ == 0:
        return
    element_differ = differ.reshape(*a.shape[:-1], -1).any(dim=-1) if actual.dim() else differ.any().reshape(())
    positions = element_differ.nonzero().tolist() if actual.dim() else [[]]
    shown = []
    for pos in positions[:_MAX_REPORTED]:
        index = tuple(pos)
        shown.append(f"at {index}: actual {_element_repr(actual, index)}, expected {_element_repr(expected, index)}")
    more = f"; ... {len(positions) - _MAX_REPORTED} more elements" if len(positions) > _MAX_REPORTED else ""
    raise AssertionError(
        f"{label}: {n_differ} of {n_total} bytes differ ({len(positions)} of {max(actual.numel(), 1)} elements); "
        + "; ".join(shown)
        + more
    )


def _fields(obj) -> list[str]:
    if not dataclasses.is_dataclass(obj):
        raise AssertionError(f"expected an NVFP4Tensor / NVFP4GroupedTensor dataclass, got {type(obj).__name__}")
    return [f.name for f in dataclasses.fields(obj)]


def assert_nvfp4_equal(actual, expected, label: str, *, fields: Optional[list[str]] = None) -> None:
    """Compare every field (or only `fields`) of two quantized tensors byte for byte.

    Both must be the same dataclass type; a field that is None in one must be None in the
    other. All differing fields are reported together, each as ``label.field: ...``."""
    if type(actual) is not type(expected):
        raise AssertionError(f"{label}: type {type(actual).__name__} != expected {type(expected).__name__}")
    names = _fields(expected) if fields is None else fields
    problems = []
    for name in names:
        a, e = getattr(actual, name), getattr(expected, name)
        if a is None or e is None:
            if not (a is None and e is None):
                problems.append(
                    f"{label}.{name}: actual is {'None' if a is None else 'a tensor'}, "
                    f"expected {'None' if e is None else 'a tensor'}"
                )
            continue
        try:
            assert_bytes_equal(a, e, f"{label}.{name}")
        except AssertionError as err:
            problems.append(str(err))
    if problems:
        raise AssertionError("\n".join(problems))


@contextlib.contextmanager
def dtypes_kept_for_backward() -> Iterator[list]:
    """Yields a list that gets the dtype of every tensor autograd saves for backward inside
    the block. Zero-size tensors are not counted: they hold nothing (the min-cut partition
    may save a fused op's empty stand-in output rather than make it again)."""
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            kept.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept
