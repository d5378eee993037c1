"""kernels/config.py: one context manager pins the tile config of every kernel kind."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nvfp4_inductor.kernels import config  # noqa: E402
from nvfp4_inductor.kernels.config import AmaxConfig, Bf16GemmConfig, CastConfig, DequantConfig  # noqa: E402

CPU = torch.device("cpu")


def _current():
    return {
        "cast": config.cast_config(64, 64, rht=True), "amax": config.amax_config(64, 64),
        "dequant": config.dequant_config(),
        **{kind: config.bf16_gemm_config(kind, CPU) for kind in ("fprop", "wgrad", "act", "dact")},
    }


PINS = {
    "cast": CastConfig(16, 32, 1), "amax": AmaxConfig(16, 32, 2, 1), "dequant": DequantConfig(8, 16, 1),
    "fprop": Bf16GemmConfig(16, 16, 32, 4, 1, 3), "wgrad": Bf16GemmConfig(16, 32, 32, 4, 1, 3),
    "act": Bf16GemmConfig(32, 16, 32, 4, 1, 3), "dact": Bf16GemmConfig(16, 16, 64, 4, 1, 3),
}


def test_override_pins_every_kind_and_restores():
    before = _current()
    with config.override(**PINS):
        assert _current() == PINS
    assert _current() == before


def test_override_nests_and_none_keeps():
    before = _current()
    with config.override(fprop=PINS["fprop"], cast=PINS["cast"]):
        with config.override(fprop=PINS["wgrad"], cast=None):
            now = _current()
            assert now["fprop"] == PINS["wgrad"] and now["cast"] == PINS["cast"]
            assert now["wgrad"] == before["wgrad"]
        assert _current()["fprop"] == PINS["fprop"]
    assert _current() == before


def test_override_errors():
    with pytest.raises(TypeError, match="unknown kind 'gemm'"):
        with config.override(gemm=PINS["fprop"]):
            pass
    with pytest.raises(TypeError, match="fprop must be a Bf16GemmConfig"):
        with config.override(fprop=PINS["cast"]):
            pass
    assert _current()["fprop"] == config.bf16_gemm_config("fprop", CPU)


def test_cast_launches():
    """Which copies each launch of a cast writes: a token tensor's row + column cast is split
    when stochastically rounded or when its row-wise copy is deq() values; a weight stack's
    (shared codes) and a packed RNE one are one launch; a single copy is one launch."""
    both, row, col = (True, True), (True, False), (False, True)
    assert config.cast_launches(True, True, sr=True) == (row, col)
    assert config.cast_launches(True, True, sr=False) == (both,)
    assert config.cast_launches(True, True, sr=False, row_deq=True) == (row, col)
    assert config.cast_launches(True, True, sr=False, row_deq=True, stacked=True) == (both,)
    assert config.cast_launches(True, False, sr=True, row_deq=True) == (row,)
    assert config.cast_launches(False, True, sr=True) == (col,)
