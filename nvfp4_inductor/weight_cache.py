"""The expert weights' NVFP4 copies made once per optimizer step, reused by every micro-batch.

Under gradient accumulation the weights do not change between the micro-batches of one
optimizer step, yet every forward casts them again: per weight stack one amax pass and one
cast pass (round to nearest even, no random bits), the same bits every time. Inside a
``reuse_weight_casts()`` block the first forward that casts a stack keeps its packed copies
(row-wise and column-wise, 1.125 bytes per weight element: 56% of the bf16 weights) and
later forwards take them from there, as TransformerEngine does with ``is_first_microbatch``::

    with nvfp4_inductor.reuse_weight_casts() as reuse:
        for batch in micro_batches:
            model(batch).backward()
    optimizer.step()
    print(reuse.casts, reuse.reuses)

Results are bit for bit those of casting every time. Each forward gets copies of its own
(a clone of what is kept): a compiled graph may write into a buffer it was given once its
last reader is done (Inductor's buffer reuse, AOTAutograd's donated saved tensors), and the
kept copies must outlive every graph.

The block's contract is that the weights do not change inside it. What a step can see is
checked on every use: a weight stack whose version counter moved (any in-place PyTorch op
on it or on a view of it, e.g. an optimizer step) or whose storage or address changed is
cast again. Where a compiled site's stack is made anew at every step from parameters (a
bf16 copy of fp32 master weights under autocast; torchtitan's gate and up weights
concatenated), the copies are keyed on those parameters, checked the same way, and on how
the stack is made from them (``nvfp4::quantize_weights_from``). Writes that bypass the
version counter (through ``param.data``, or a collective writing into the storage) cannot
be seen; do not make them inside the block.

Where the copies come from: the eager ``GroupedMLP`` / ``grouped_mlp`` take them through the
block whenever one is active. A model compiled with ``backend="nvfp4"`` does so with the
backend option ``reuse_weight_casts=True``, which makes each weight stack's cast one opaque
op in the compiled graph (``nvfp4::quantize_weights_from``), so that the check runs on every step
instead of kernels launched by Inductor's code. Under CUDA-graph capture the block is not
consulted (a replay runs no Python, so it would read copies kept at capture after the
weights had changed): a graph captured by hand casts at every replay. The backend refuses
the option together with Inductor's CUDA graph trees (``mode="reduce-overhead"``), whose
warm-up runs in their own memory pool (``compiler/backend.py``, ``REUSE_UNDER_CUDA_GRAPHS``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from typing import Callable, Iterator, Optional

import torch

from .tensor import NVFP4WeightStack


@dataclasses.dataclass(eq=False)
class _Kept:
    # per tensor the copies were keyed on: its storage (whose death drops this entry), its
    # version counter and its address when cast
    storages: tuple[weakref.ref, ...]
    versions: tuple[int, ...]
    data_ptrs: tuple[int, ...]
    copies: NVFP4WeightStack

    def current(self, keyed: tuple[torch.Tensor, ...]) -> bool:
        return all(ref() is t.untyped_storage() for ref, t in zip(self.storages, keyed)) and (
            self.versions == tuple(t._version for t in keyed) and self.data_ptrs == tuple(t.data_ptr() for t in keyed))


def _place(t: torch.Tensor) -> tuple:
    return id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


@dataclasses.dataclass(eq=False)
class WeightCastReuse:
    """The state of one ``reuse_weight_casts`` block.

    casts:      weight stacks cast inside the block (each stack's first use, or after it changed)
    reuses:     forwards that took a stack's copies from the block instead of casting it
    kept_bytes: the memory the kept copies hold
    """

    casts: int = 0
    reuses: int = 0
    _kept: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def kept_bytes(self) -> int:
        """Device memory the kept copies hold now (freed when the block ends)."""
        return sum(t.nbytes for kept in self._kept.values() for t in kept.copies.as_tuple())

    def copies(self, w: torch.Tensor, block_2d: bool, cast: Callable[[], NVFP4WeightStack],
               sources: Optional[list[torch.Tensor]] = None, derivation: str = "") -> NVFP4WeightStack:
        """`w`'s packed copies: kept ones where what they were keyed on is unchanged since
        they were made, else ``cast()``'s, kept. Keyed on `w` itself, or, where `w` is made
        anew at every step from graph inputs (``sources``: a bf16 copy of fp32 master
        weights, a concatenation of gate and up weights), on those inputs and the
        `derivation` that names how `w` is made from them. Returned as new tensors (the
        module docstring says why). Inference tensors (made under ``torch.inference_mode``)
        keep no version counter: those are cast every time."""
        keyed = tuple(sources) if sources else (w,)
        if any(t.is_inference() for t in keyed):
            self.casts += 1
            return cast()
        key = (derivation, block_2d, tuple(w.shape), w.dtype, tuple(_place(t) for t in keyed))
        kept = self._kept.get(key)
        if kept is not None and kept.current(keyed):
            self.reuses += 1
        else:
            def drop(_, key=key):
                self._kept.pop(key, None)

            kept = _Kept(tuple(weakref.ref(t.untyped_storage(), drop) for t in keyed), tuple(t._version for t in keyed),
                         tuple(t.data_ptr() for t in keyed), cast())
            self._kept[key] = kept
            self.casts += 1
        return NVFP4WeightStack(*(t.clone() for t in kept.copies.as_tuple()))


_ACTIVE: Optional[WeightCastReuse] = None


@contextlib.contextmanager
def reuse_weight_casts() -> Iterator[WeightCastReuse]:
    """Inside the block each expert weight stack is cast to NVFP4 once and its copies are
    reused by later forwards (the module docstring: the contract and what is checked).
    Yields the block's counters; the kept copies are freed when it ends."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("reuse_weight_casts: blocks do not nest; one is already active")
    _ACTIVE = WeightCastReuse()
    try:
        yield _ACTIVE
    finally:
        block, _ACTIVE = _ACTIVE, None
        block._kept.clear()
    if block.casts + block.reuses == 0:
        warnings.warn("reuse_weight_casts: no NVFP4 weight cast went through this block; a model compiled with "
                      "backend='nvfp4' takes part only with the backend option reuse_weight_casts=True",
                      stacklevel=3)


def weight_copies(w: torch.Tensor, block_2d: bool, cast: Callable[[], NVFP4WeightStack],
                  sources: Optional[list[torch.Tensor]] = None, derivation: str = "") -> NVFP4WeightStack:
    """`w`'s packed NVFP4 copies: through the active block where there is one and the stream
    is not being captured into a CUDA graph (``WeightCastReuse.copies``), else ``cast()``."""
    if _ACTIVE is None or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return cast()
    return _ACTIVE.copies(w, block_2d, cast, sources, derivation)
