"""A GRPO group run on the server with the owner's prefix cache: a second group of the same
task is served from the cache the first one filled (the cache lives server-side)."""

from __future__ import annotations

import numpy as np
import pytest

from bunshin_gym.remote import RemoteError, RemoteGroup

from .conftest import ALICE, leases

ORACLE = ["ls /data | wc -l > /home/user/answer.txt", "DONE"]


def test_group_with_prefix_cache_on_the_server(server, opts):
    stats = []
    for _ in range(2):
        group = RemoteGroup("Bunshin-Shell-v0", 3, server.url, token=ALICE, prefix_cache=True)
        try:
            obs, info = group.reset(options={"task": "shell/count-files"})
            assert info["task_id"] == "shell/count-files" and len(obs["instruction"]) == 3
            for action in ORACLE:
                obs, rewards, terms, truncs, infos = group.step([action] * 3)
            assert np.array_equal(rewards, [1.0, 1.0, 1.0]) and terms.all()
            assert not infos["active"].any()
            stats.append(group.cache_stats)
        finally:
            group.close()
    assert stats[1]["hits"] > stats[0]["hits"], f"the second group was not served from the cache: {stats}"
    assert leases(server) == []


def test_group_speculation_on_the_server(server, opts):
    """speculation=True: the server trains a selector on the owner's trajectory log (written by
    its prefix-cached groups) and runs each member's predicted next call in a fork while the
    client thinks; the step adopts it."""
    import time

    # a task of its own (the owner's log holds the other test's calls too); past the 0.3 s threshold
    task, slow = "shell/make-dir", ["sleep 0.8; echo made > /home/user/made.txt", "DONE"]
    first = RemoteGroup("Bunshin-Shell-v0", 1, server.url, token=ALICE, prefix_cache=True)
    try:  # one member: a second one's cache hit would halve the call's recorded median time
        first.reset(options={"task": task})
        for action in slow:
            _, alone, *_ = first.step([action])
    finally:
        first.close()
    group = RemoteGroup("Bunshin-Shell-v0", 2, server.url, token=ALICE, speculation=True)
    try:
        group.reset(options={"task": task})
        time.sleep(6)  # the policy's think time
        _, rewards, terms, _, infos = group.step([slow[0]] * 2)
        assert [i.get("speculation") for i in infos["member_info"]] == ["hit", "hit"], infos
        assert group.speculation_stats["matched"] == 2
        _, rewards, terms, _, _ = group.step(["DONE"] * 2)
        assert np.array_equal(rewards, [alone[0]] * 2) and terms.all()  # as without speculation
    finally:
        group.close()
    with pytest.raises(RemoteError, match="speculation must be true or false"):
        RemoteGroup("Bunshin-Shell-v0", 2, server.url, token=ALICE, speculation="yes")
    assert leases(server) == []
