"""``bunshin bench serve`` on a tiny budget: every figure is measured and nothing fails."""

from __future__ import annotations

import json

from bunshin_gym.bench import serve


def test_tiny_bench_serve(tmp_path):
    out = tmp_path / "serve.json"
    doc = serve.run(str(out), steps=4, rounds=1, desktop=False, fork_n=2, clients=4, seconds=2.0)
    assert json.loads(out.read_text())["benchmark"] == "serve"
    shell = doc["shell_step"]
    assert shell["in_process"]["n"] == shell["remote"]["n"] == 4
    assert shell["remote"]["median_ms"] > 0 and "added_median_ms" in shell
    # the default channel of a client on the server's host is the local one; the WebSocket one is measured beside it
    assert shell["channel"] == "LocalChannel" and shell["remote_websocket"]["n"] == 4
    assert shell["channel_round_trip"]["n"] == shell["websocket_round_trip"]["n"] == 4
    assert doc["fork"]["n"] == 2 and doc["fork"]["api_e2b_sdk"]["median_ms"] > 0
    t = doc["throughput"]
    assert t["errors"] == 0 and t["steps"] > 0 and t["slowest_client_steps"] > 0


def test_tiny_desktop_step_measures_blocks_and_alternated_pairs(tmp_path):
    server = serve._Server(tmp_path)
    try:
        d = serve.desktop_step(server, steps=3, rounds=1)
    finally:
        server.stop()
    for name in ("in_process", "remote", "remote_websocket", "remote_http", "remote_whole_frames"):
        assert d[name]["n"] == 3 and d[name]["median_ms"] > 0, name
    pair = d["paired"]
    assert pair["in_process"]["n"] == pair["remote"]["n"] == 3
    assert pair["median_of_ratios"] > 0 and d["ratio_median"] > 0
    draw = d["paired_drawing"]
    assert draw["in_process"]["n"] == draw["remote"]["n"] == 2  # one typed character, one erased
    assert draw["median_of_ratios"] > 0 and draw["remote_breakdown"]["server_step_ms"] > 0
    assert d["remote_breakdown"]["server_step_ms"] > 0
