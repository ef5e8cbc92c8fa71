"""The server's parts without a server: token files, quotas, task ids."""

from __future__ import annotations

import json

import pytest

from bunshin_gym.serve import watch
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


def test_file_url_signature_is_the_sdk_s():
    from e2b.sandbox.signature import get_signature

    from bunshin_gym.serve.envd import signature_of

    for path, op, user, exp in [("/tmp/a b.txt", "read", None, None), ("rel/x", "write", "root", 60)]:
        sdk = get_signature(path, op, user, "tok-123", exp)
        assert signature_of(path, op, user or "", "tok-123", sdk["expiration"]) == sdk["signature"]
        assert signature_of(path, op, user or "", "tok-124", sdk["expiration"]) != sdk["signature"]


def test_watch_diff_names_each_change():
    from e2b.envd.filesystem.filesystem_pb import EventType as E

    from bunshin_gym.serve.watch import diff, parse_listing

    old = parse_listing(b"10 f 0 1.0 644 a\x0011 f 3 1.0 644 b\x0012 d 40 1.0 755 d\x0013 f 1 1.0 644 c\x00", "/w")
    new = parse_listing(b"11 f 5 2.0 644 b\x0012 f 1 2.0 644 d\x0013 f 1 1.0 600 c\x0010 f 0 1.0 644 sub dir/a2\x00"
                        b"14 f 2 2.0 644 new\x00", "/w")
    assert new["sub dir/a2"][0] == 10, "names with spaces parse"
    assert diff(old, new) == [("a", E.RENAME), ("sub dir/a2", E.CREATE), ("new", E.CREATE), ("new", E.WRITE),
                              ("b", E.WRITE), ("c", E.CHMOD), ("d", E.REMOVE), ("d", E.CREATE)]
    assert diff(new, new) == []


def test_port_hosts():
    from bunshin_gym.serve.ports import target_of

    assert target_of("8080-iabc123.localhost:49982") == (8080, "iabc123")
    assert target_of("3000-iabc.e2b.app") == (3000, "iabc")
    for host in ("127.0.0.1:49982", "localhost", "49983-iabc.e2b.app", "8080-i/x.y", "", None, "99999999-iabc.x"):
        assert target_of(host) is None, host


def test_watcher_store_round_trip_and_bad_files(tmp_path, caplog):
    store = watch.WatcherStore(tmp_path / "watchers")
    entries = {"a b": (12, "f", 3, "1700000000.5", "644"), "d": (13, "d", 0, "1", "755")}
    w = watch.Watcher("/tmp/w", True, "user", entries)
    store.save("sb-1", w)
    store.save("sb-2", watch.Watcher("/x", False, "root"))
    back = store.load("sb-1")
    assert list(back) == [w.id] and vars(back[w.id]) == vars(w)
    (tmp_path / "watchers" / "sb-1" / "broken.json").write_text('{"path": "/y"')
    assert list(store.load("sb-1")) == [w.id] and "broken" in caplog.text, "a file that cannot be read is dropped"
    store.remove("sb-1", w.id)
    assert list(store.load("sb-1")) == []
    store.keep_only({"sb-1"})
    assert store.load("sb-2") == {} and (tmp_path / "watchers" / "sb-1").is_dir()
