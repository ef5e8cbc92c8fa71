"""The host's X client: what it makes of the pixels the X server sends."""

from __future__ import annotations

import numpy as np

from bunshin_gym.envs.osworld.xclient import bgrx_to_rgb


def test_bgrx_to_rgb_gives_what_reversing_the_channels_gives():
    rng = np.random.default_rng(3)
    for h, w in ((1080, 1920), (7, 5), (1, 1)):
        bgrx = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
        rgb = bgrx_to_rgb(bgrx)
        assert rgb.shape == (h, w, 3) and rgb.dtype == np.uint8
        assert rgb.flags["C_CONTIGUOUS"] and rgb.flags["WRITEABLE"]  # torch.from_numpy takes it as is
        assert np.array_equal(rgb, bgrx[:, :, 2::-1])
        assert not np.shares_memory(rgb, bgrx)


def test_bgrx_to_rgb_of_a_received_buffer():
    raw = bytearray(bytes([10, 20, 30, 0, 1, 2, 3, 255]))  # two pixels, BGRX as the server sends them
    rgb = bgrx_to_rgb(np.frombuffer(raw, np.uint8).reshape(1, 2, 4))
    assert rgb.tolist() == [[[30, 20, 10], [3, 2, 1]]]
