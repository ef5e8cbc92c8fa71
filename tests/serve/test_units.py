"""The server's parts without a server: token files, quotas, task ids."""

from __future__ import annotations

import json

import pytest

from bunshin_gym.serve.auth import Principal, TokenFileError, TokenStore, token_from_headers
from bunshin_gym.serve.envs_api import check_task
from bunshin_gym.serve.registry import QuotaExceeded, Registry, ServeError


def test_token_file_errors_name_the_field(tmp_path):
    f = tmp_path / "t.json"
    for text, match in [("{", "line 1 column 2"), ("[]", "list under \"tokens\""),
                        ('{"tokens": [{"token": "short"}]}', r"tokens\[0\]: \"token\" must be"),
                        ('{"tokens": [{"token": "long-enough-1", "max_memory": "lots"}]}', r"tokens\[0\]"),
                        ('{"tokens": [{"token": "long-enough-1", "quota": 1}]}', "unknown fields"),
                        ('{"tokens": []}', "accept nobody")]:
        f.write_text(text)
        with pytest.raises(TokenFileError, match=match):
            TokenStore.load(f)
    with pytest.raises(TokenFileError, match="No such file"):
        TokenStore.load(tmp_path / "missing.json")
    f.write_text(json.dumps({"tokens": [{"token": "long-enough-1", "name": "a", "max_memory": "2G",
                                         "max_workspaces": 3}]}))
    store = TokenStore.load(f)
    assert store.authenticate("long-enough-1") == Principal("a", "long-enough-1", 3, 2 << 30)
    assert store.authenticate("long-enough-2") is None and store.authenticate(None) is None
    assert token_from_headers({"x-api-key": "k"}) == "k"
    assert token_from_headers({"authorization": "Bearer t"}) == "t"
    assert token_from_headers({"authorization": "Basic dTo="}) is None


def test_quotas_count_workspaces_and_memory():
    reg = Registry()
    p = Principal("p", "token-123456", max_workspaces=3, max_memory=4 << 30)
    reg.reserve(p, 2, 2 << 30)
    with pytest.raises(QuotaExceeded, match="holds 2 of 3 workspaces"):
        reg.reserve(p, 2, 1 << 30)
    with pytest.raises(QuotaExceeded, match="MiB of workspace memory"):
        reg.reserve(p, 1, 3 << 30)
    with pytest.raises(QuotaExceeded, match="need a memory limit"):
        reg.reserve(p, 1, 0)
    assert reg.usage(p) == (2, 2 << 30)  # refused reservations counted nothing
    reg.unreserve(p, 2, 2 << 30)
    reg.reserve(p, 3, 3 << 30)
    assert reg.usage(p) == (3, 3 << 30)


@pytest.mark.parametrize("spec", ["shell/count-files", "osworld/editor-append-item", {"id": "x"}, None])
def test_task_ids_and_dicts_pass(spec):
    check_task(spec)


@pytest.mark.parametrize("spec", ["/etc/passwd", "x.json", "shell/../../etc/passwd", "shell/a.json", 5, "noslash"])
def test_task_paths_are_refused(spec):
    with pytest.raises(ServeError, match="shipped task id"):
        check_task(spec)
