"""Capturing the random streams: what cannot be captured is named, not a bare unpacking error."""

from __future__ import annotations

import numpy as np
import pytest

import shardpoint as sp
from shardpoint.state import rng


def test_a_numpy_global_stream_other_than_mt19937_is_named():
    """``np.random.set_bit_generator`` makes ``get_state()`` a dict: the save names the generator and the fix."""
    saved = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(0))
    try:
        with pytest.raises(sp.CheckpointError, match=r"PCG64, not MT19937.*keep numpy's default bit generator"):
            rng.capture()
    finally:
        np.random.set_bit_generator(saved)
    assert rng.capture()["numpy"]["name"] == "MT19937"
