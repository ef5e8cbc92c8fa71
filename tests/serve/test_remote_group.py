"""A GRPO group run on the server with the owner's prefix cache: a second group of the same
task is served from the cache the first one filled (the cache lives server-side)."""

from __future__ import annotations

import numpy as np

from bunshin_gym.remote import RemoteGroup

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
