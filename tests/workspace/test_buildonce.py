"""Files the controller builds on first use, asked for by many threads at once (as the first
fork of several clones on a fresh BUNSHIN_HOME does): each is built once, and every caller
gets the finished file."""

import dataclasses
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bunshin_gym.config import paths
from bunshin_gym.workspace import buildonce, kmod, runtime, uffd

THREADS = 6


def _all_at_once(fn, n: int = THREADS) -> list:
    start = threading.Barrier(n)

    def call(_):
        start.wait()
        return fn()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(call, range(n)))


def test_a_fresh_homes_monitor_asked_for_by_parallel_forks_runs_in_every_one(tmp_path):
    """The slow suite's kmod VM (a new home) failed its first fork of 4 copy clones: each clone's
    thread compiled the monitor into one shared temporary name, and one executed the result while
    another's linker still wrote it (ETXTBSY)."""
    p = dataclasses.replace(paths(), home=tmp_path / "home")

    def build_and_run():
        binary = uffd.monitor_binary(p)
        proc = subprocess.run([str(binary), "--probe-wp"], capture_output=True, text=True)
        return binary, proc.returncode

    results = _all_at_once(build_and_run)
    assert len({b for b, _ in results}) == 1
    # the probe's verdict is the kernel's; what matters is that every thread could run it
    assert len({rc for _, rc in results}) == 1, results
    binary = results[0][0]
    assert sorted(f.name for f in binary.parent.iterdir()) == [f".{binary.name}.lock", binary.name]


def test_a_fresh_homes_runtime_layer_is_built_once_for_parallel_callers(tmp_path):
    p = dataclasses.replace(paths(), home=tmp_path / "home")
    layers = _all_at_once(lambda: runtime.ensure_runtime(p))
    assert len(set(layers)) == 1
    init = layers[0] / ".bunshin" / "init"
    assert os.access(init, os.X_OK)
    assert sorted(f.name for f in p.runtime.iterdir()) == [f".{layers[0].name}.lock", layers[0].name]


def test_the_kmod_action_script_written_by_parallel_callers_is_whole_and_executable(tmp_path):
    p = dataclasses.replace(paths(), run=tmp_path / "run")
    scripts = _all_at_once(lambda: kmod.action_script(p))
    assert len(set(scripts)) == 1
    text = scripts[0].read_text()
    assert text.startswith("#!/bin/sh\n") and "kmod import main" in text
    assert os.access(scripts[0], os.X_OK)
    assert [f.name for f in p.run.iterdir() if not f.name.endswith(".lock")] == [scripts[0].name]


def test_build_once_runs_one_make_and_the_others_wait_for_it(tmp_path):
    out = tmp_path / "thing"
    made = []

    def make(target):
        made.append(target)
        target.write_text("part")
        time.sleep(0.2)  # long enough for every other thread to arrive and wait
        with open(target, "a") as f:
            f.write("+whole")

    results = _all_at_once(lambda: (buildonce.build_once(out, make), out.read_text()))
    assert len(made) == 1
    assert {r for _, r in results} == {"part+whole"}


def test_a_failed_build_leaves_nothing_and_the_next_caller_builds(tmp_path):
    out = tmp_path / "thing"

    def broken(target):
        target.write_text("half")
        raise RuntimeError("compiler failed")

    with pytest.raises(RuntimeError, match="compiler failed"):
        buildonce.build_once(out, broken)
    assert [f.name for f in tmp_path.iterdir()] == [".thing.lock"]
    assert buildonce.build_once(out, lambda t: t.write_text("ok")).read_text() == "ok"


def test_write_text_replaces_a_changed_file_and_keeps_an_equal_one(tmp_path):
    path = tmp_path / "script.sh"
    buildonce.write_text(path, "one\n", 0o755)
    inode = path.stat().st_ino
    buildonce.write_text(path, "one\n", 0o755)
    assert path.stat().st_ino == inode  # unchanged: not rewritten
    buildonce.write_text(path, "two\n", 0o755)
    assert path.read_text() == "two\n" and path.stat().st_ino != inode
    assert path.stat().st_mode & 0o777 == 0o755
