"""bench fork's benchmarked modes: a memory mode, share+ksm, or a mode without write tracking
(the path before it, to set beside the tracked one in one run)."""

from __future__ import annotations

import pytest

from bunshin_gym.bench import fork
from bunshin_gym.workspace.memory import MemoryMode


@pytest.mark.parametrize(("label", "mode", "env"), [
    ("copy", MemoryMode.COPY, {}),
    ("copy-untracked", MemoryMode.COPY, {"BUNSHIN_WRITE_TRACKING": "0"}),
    ("ksm-untracked", MemoryMode.KSM, {"BUNSHIN_WRITE_TRACKING": "0"}),
    ("share+ksm", MemoryMode.SHARE, {"BUNSHIN_SHARE_KSM": "1"}),
])
def test_a_label_names_a_mode_and_the_environment_its_clones_need(label, mode, env):
    assert fork._variant(label) == (mode, env)


def test_an_unknown_label_is_refused():
    with pytest.raises(ValueError):
        fork._variant("copy-untraced")
