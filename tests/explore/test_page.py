"""The explorer page in a real browser (headless chromium through playwright), on runs recorded
by the real rollout engine: it loads, the trees have the right nodes and cache hits, clicking a
node shows its observation (a desktop's screenshot with the action drawn on it), the filters,
pages, curves and live workspaces work, and a 10,000-step run opens in under 2 s. Screenshots
of the page are kept in ``bench/results/explore/`` (see conftest.SHOTS)."""

from __future__ import annotations

import json
import re
import time
import uuid

from .conftest import SHELL_GROUPS, copy_run


def node_count(page) -> int:
    return page.locator("#tree .node:not(.root)").count()


def cache_hits(page) -> int:
    return sum(int(x) for x in page.locator("#tree .node").evaluate_all("ns => ns.map(n => n.dataset.cache)"))


def open_group(page, index: int) -> None:
    gid = page.locator("#group-list li").nth(index).get_attribute("data-group")
    page.locator("#group-list li").nth(index).click()
    # the tree drawn is the group's (not the previous one, still shown while the new one loads)
    page.wait_for_function(f"document.querySelector('#group-list li.selected')?.dataset.group === '{gid}' && "
                           f"document.querySelector('#tree').dataset.group === '{gid}' && "
                           "document.querySelector('#tree .node')")
    page.wait_for_function(
        "document.querySelectorAll('#tree .node:not(.root)').length == "
        "Number(document.querySelector('#tree-nodes').dataset.count)")


def test_shell_run_tree_step_filters_and_curves(shell_run, explorer, page, shots):
    run_dir, _ = shell_run
    srv = explorer(run=run_dir)
    page.goto(srv.url + "/")
    page.wait_for_selector("#tree .node[data-node=n1]")
    assert page.locator("#group-list li").count() == 3
    for i, (epoch, task, _plans, nodes, hits, rewards) in enumerate(SHELL_GROUPS):
        open_group(page, i)
        assert node_count(page) == nodes, (epoch, task)
        assert cache_hits(page) == hits, (epoch, task)
        assert page.locator("#tree-hits").get_attribute("data-count") == str(hits)
        chips = page.locator("#group-list li.selected .chip").all_inner_texts()
        assert [float(c) for c in chips] == rewards
    open_group(page, 0)
    # count-files: the members diverge at the start (ls /data vs pwd) and after ls /data
    assert page.locator("#tree .node.diverges").count() == 2
    page.screenshot(path=shots / "shell-tree.png")

    # a node: its action and observation; members served from the cache are one click away
    page.locator("#tree .node .act").filter(has_text=re.compile(r"^ls /data$")).click()
    page.wait_for_selector("#step-action")
    assert page.locator("#step-action").inner_text() == "ls /data"
    assert "f1.txt" in page.locator("#step pre.obs-output").inner_text()
    assert page.locator("#step .member-tabs button").all_inner_texts() == ["m0", "m1", "m2"]
    served = []
    for m in (0, 1, 2):
        page.locator("#step .member-tabs button", has_text=f"m{m}").click()
        page.wait_for_function(f"document.querySelector('#step-title').textContent === 'member {m}, step 0'")
        assert page.locator("#step-action").inner_text() == ("ls  /data" if m == 1 else "ls /data")  # m1's spelling
        served.append(page.locator("#step .kv .badge").inner_text())
    assert sorted(served) == ["cache", "cache", "executed"]  # one ran it, the others were served
    page.screenshot(path=shots / "shell-step.png", full_page=True)

    # filters: by task, by reward
    page.select_option("#f-task", "shell/make-dir")
    page.click("#filters button")
    page.wait_for_function("document.querySelector('#group-count').textContent === '1 groups'")
    page.select_option("#f-task", "")
    page.fill("#f-min", "0.2")
    page.fill("#f-max", "0.8")
    page.click("#filters button")
    page.wait_for_function("document.querySelector('#group-count').textContent === '0 groups'")
    assert page.locator("#tree-head").inner_text() == "no group matches"
    page.fill("#f-min", "")
    page.fill("#f-max", "")
    page.select_option("#f-epoch", "epoch 2")
    page.click("#filters button")
    page.wait_for_function("document.querySelector('#group-count').textContent === '1 groups' && "
                           "document.querySelector('#tree-hits')?.dataset.count === '11'")
    assert cache_hits(page) == 11

    # curves: interactive SVG (a tooltip on hover, series toggled from the legend)
    page.click(".tab[data-tab=curves]")
    page.wait_for_selector(".chart svg")
    charts = page.locator(".chart")
    assert charts.count() == 3  # no report.json in this run: the step log's per-epoch curves
    served = charts.filter(has_text="steps served per epoch")
    served.locator("svg").hover(position={"x": 440, "y": 100})
    tip = served.locator(".tip")
    assert "epoch 2" in tip.inner_text() and "from prefix cache: 1.000" in tip.inner_text()
    served.locator(".legend span").first.click()
    assert served.locator("g[data-series='from prefix cache']").evaluate("g => g.style.display") == "none"
    page.screenshot(path=shots / "curves.png", full_page=True)


def test_curves_from_a_training_report(shell_run, explorer, page, shots, tmp_path):
    """A run with ``bunshin train``'s report.json: its per-step curves are plotted too."""
    run_dir = copy_run(shell_run[0], tmp_path / "trained")
    steps = [{"step": i, "reward": 0.4 + 0.02 * i, "rollout_s": 5.0 - 0.1 * i, "generate_s": 1.0, "loss": 0.1,
              "cache": {"hit_rate": 0.03 * i}, "speculation": {"accuracy": 0.5}} for i in range(1, 21)]
    (run_dir / "report.json").write_text(json.dumps({"steps": steps, "eval": {"before": {"mean": 0.5},
                                                                                "after": {"mean": 0.7}}}))
    srv = explorer(run=run_dir)
    page.goto(srv.url + "/")
    page.wait_for_selector("#tree .node")
    page.click(".tab[data-tab=curves]")
    page.wait_for_selector(".chart svg")
    titles = page.locator(".chart h4").all_inner_texts()
    assert titles[:4] == ["reward per GRPO step (report)", "rollout time per step, s", "prefix cache and speculation",
                          "loss"]
    reward = page.locator(".chart").first
    assert reward.locator("g[data-series='mean env reward'] circle").count() == 20
    reward.locator("svg").hover(position={"x": 46, "y": 100})
    assert "mean env reward: 0.420" in reward.locator(".tip").inner_text()
    page.screenshot(path=shots / "curves-report.png", full_page=True)


def test_desktop_run_screenshots_marks_and_live_view(desktop_run, explorer, page, shots):
    run_dir, envs, trajs = desktop_run
    assert [t.reward for t in trajs] == [1.0, 0.0]
    srv = explorer(run=run_dir)
    page.goto(srv.url + "/")
    page.wait_for_selector("#tree .node[data-node=n1]")
    # click (m0, m1: one executed, one served from the cache) -> write -> DONE; click -> DONE
    assert node_count(page) == 4 and cache_hits(page) == 1
    thumbs = page.locator("#tree .node img.thumb")
    assert thumbs.count() == 5  # the start and every node: the screen after it
    page.wait_for_function("[...document.querySelectorAll('#tree img.thumb')].every(i => i.complete && i.naturalWidth)")
    assert thumbs.first.evaluate("i => i.naturalWidth") == 320
    page.screenshot(path=shots / "desktop-tree.png")

    page.locator("#tree .node", has_text="pyautogui.click(300, 200)").click()
    page.wait_for_function("document.querySelector('#step-shot')?.complete && "
                           "document.querySelector('#step-shot').naturalWidth > 0")
    assert page.locator("#step-shot").evaluate("i => i.naturalWidth") == 1920
    point = page.locator("#step-marks circle.mark-point")
    assert (point.get_attribute("cx"), point.get_attribute("cy")) == ("300", "200")
    assert page.locator("#step pre.obs-accessibility_tree").inner_text().strip()
    assert page.locator("#step pre.obs-terminal").count() == 1
    page.screenshot(path=shots / "desktop-step-click.png", full_page=True)

    page.locator("#tree .node", has_text="pyautogui.write").click()
    page.wait_for_selector("#step-marks text.mark-text")
    assert page.locator("#step-marks text.mark-text").text_content() == 'type "mkdir ~/projects\n"'
    assert "mkdir ~/projects" in page.locator("#step pre.obs-terminal").inner_text()
    page.screenshot(path=shots / "desktop-step-type.png", full_page=True)

    # live workspaces: the group's root desktop, its memory, and its screen, read-only
    ws_id = envs.root.unwrapped.workspace.id
    page.click(".tab[data-tab=workspaces]")
    row = page.locator(f"#ws-table tr[data-ws='{ws_id}']")
    row.wait_for()
    cells = row.locator("td").all_inner_texts()
    assert cells[2] == "running" and cells[6].endswith(" MB") and float(cells[6].split()[0]) > 10  # PSS
    row.locator("button", has_text="view screen").click()
    page.wait_for_function("document.querySelector('#screen-img').complete && "
                           "document.querySelector('#screen-img').naturalWidth > 0")
    assert page.locator("#screen-img").evaluate("i => i.naturalWidth") == 1280
    first = page.locator("#screen-img").get_attribute("src")
    page.wait_for_function(f"document.querySelector('#screen-img').getAttribute('src') !== '{first}'", timeout=10_000)
    page.screenshot(path=shots / "workspaces.png", full_page=True)
    page.click("#screen-close")


def big_run(src_dir, dst_dir, min_steps: int = 10_000) -> int:
    """A run of at least ``min_steps`` steps made of the recorded run's real groups, repeated
    as further epochs (new group ids); returns its step count."""
    records = [json.loads(line) for line in open(src_dir / "steps.jsonl")]
    dst_dir.mkdir()
    steps, epoch = 0, 0
    with open(dst_dir / "steps.jsonl", "w") as f:
        while steps < min_steps:
            epoch += 1
            ids: dict[str, str] = {}
            for r in records:
                r = dict(r, group=ids.setdefault(r["group"], uuid.uuid4().hex[:12]))
                if r["kind"] == "group":
                    r["epoch"] = f"GRPO step {epoch}"
                steps += r["kind"] == "step"
                f.write(json.dumps(r) + "\n")
    return steps


def test_ten_thousand_step_run_opens_in_under_two_seconds(shell_run, explorer, page, shots, tmp_path):
    steps = big_run(shell_run[0], tmp_path / "big-run")
    assert steps >= 10_000
    page.goto("about:blank")  # the browser is up: what is timed is opening the run
    srv = explorer(run=tmp_path / "big-run")  # a fresh server: the run is read and indexed on this open
    t0 = time.perf_counter()
    page.goto(srv.url + "/")
    page.wait_for_function("document.querySelectorAll('#tree .node').length > 1 && "
                           "document.querySelectorAll('#group-list li').length === 50")
    first_open = time.perf_counter() - t0
    assert page.locator("#run-info").inner_text().startswith(f"{steps // 29 * 3} groups, {steps} steps")
    t0 = time.perf_counter()
    page.reload()
    page.wait_for_function("document.querySelectorAll('#tree .node').length > 1")
    reopen = time.perf_counter() - t0
    # the last page, filtered
    pages = page.locator("#page-info").inner_text()
    t0 = time.perf_counter()
    page.click("#next")
    page.wait_for_function("document.querySelector('#page-info').textContent.startsWith('page 2 /')")
    next_page = time.perf_counter() - t0
    figures = {"steps": steps, "first_open_s": round(first_open, 3), "reopen_s": round(reopen, 3),
               "next_page_s": round(next_page, 3), "pages": pages}
    (shots / "open-10k-steps.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(f"10k-step run: {figures}")
    page.screenshot(path=shots / "big-run.png")
    assert first_open < 2.0, figures
    assert reopen < 2.0 and next_page < 1.0, figures


def test_a_step_adopted_from_speculation_is_marked(speculation_run, explorer, page, shots):
    srv = explorer(run=speculation_run[0])
    page.goto(srv.url + "/")
    page.wait_for_selector("#tree .node[data-node=n1]")
    slow = page.locator("#tree .node[data-node=n1]")
    assert slow.get_attribute("data-speculation") == "1" and slow.get_attribute("data-executed") == "0"
    assert slow.locator(".badge").inner_text() == "spec 1"
    slow.click()
    page.wait_for_selector("#step-action")
    assert page.locator("#step .kv .badge").inner_text() == "speculation"
    assert page.locator("#step pre.obs-output").inner_text().strip() == "done"
    assert "s in a speculative fork" in page.locator("#step .kv").first.inner_text()
    page.screenshot(path=shots / "speculation.png")
