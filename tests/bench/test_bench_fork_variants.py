"""bench fork's benchmarked modes: a memory mode, share+ksm, or a mode without write tracking
(the path before it, to set beside the tracked one in one run)."""

from __future__ import annotations

import pytest

from bunshin_gym.bench import fork
from bunshin_gym.workspace import fanout
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


@pytest.mark.parametrize(("label", "options", "rest"), [
    ("share", fanout.DEFAULT, "share"),
    ("share-before", fanout.BEFORE, "share"),
    ("copy-untracked-before", fanout.BEFORE, "copy-untracked"),
])
def test_a_label_ending_in_before_restores_as_forks_did_before(label, options, rest):
    assert fork._fanout_of(label) == (options, rest)
    fork._variant(rest)  # what is left is a label of its own


def test_the_phases_end_with_the_agents_answering():
    trace = fanout.FanoutTrace()
    trace.events += [("criu", "ws-a", 0.1, 0.5), ("criu", "ws-b", 0.2, 0.7), ("setup", "ws-a", 0.0, 0.1)]
    phases = fork._phases(trace, 0.9)
    assert list(phases) == ["setup", "criu", "agents"]
    assert phases["criu"] == {"clones": 2, "sum_s": 0.9, "first_s": 0.1, "last_s": 0.7}
    assert phases["agents"]["sum_s"] == 0.2
    assert "criu 0.90 (0.10-0.70)" in fork._phases_line(phases)
