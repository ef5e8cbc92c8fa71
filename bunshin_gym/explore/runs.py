"""Reading recorded runs: the step log of a run directory (``steps.jsonl``, written by
:class:`~bunshin_gym.rollout.steplog.StepLog`), its groups, their trees, and the report.

A :class:`Run` reads ``steps.jsonl`` incrementally (a run still training grows; only the
appended whole lines are read on the next look) and keeps an index by group, so a page of
groups, a group's tree or one step is a dictionary lookup, not a scan. Step lines, most of
the file, are not parsed when a run is opened: their group, member and where they were served
from are read from the line's head (the step log writes those keys first), and the whole
line is parsed when its group's tree is asked for. That is what opens a run of 10,000 steps
in a fraction of a second.

The tree of a group (:func:`build_tree`) is the trie of its members' calls by signature (two
calls are the same when the prefix cache says so): members share a node while their calls
agree and branch where they diverge. Each node counts how its steps were served (executed,
from the prefix cache, adopted from speculation).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SERVED = ("executed", "cache", "speculation")
# the head of a step line as StepLog writes it (json.dumps keeps the keys' order)
_STEP_HEAD = re.compile(rb'^\{"kind": "step", "group": "([^"\\]*)", "member": (\d+),')
_SERVED = re.compile(rb'"served": "(executed|cache|speculation)"')
_END_HEAD = re.compile(rb'^\{"kind": "end", "group": "([^"\\]*)", "member": (\d+), "reward": (-?[0-9][0-9.eE+-]*),')


@dataclass
class Group:
    id: str
    epoch: str
    task: str
    members: int
    instruction: str
    obs: dict
    time: float
    ends: dict[int, dict] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SERVED, 0))
    bad_lines: int = 0
    _raw: list[bytes] = field(default_factory=list, repr=False)  # step lines, parsed when asked for
    _steps: list[dict] = field(default_factory=list, repr=False)
    _parsed: int = 0  # how many of _raw are in _steps
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # requests run in threads

    def add_step(self, line: bytes, member: int, served: str) -> None:
        self._raw.append(line)
        self.members = max(self.members, member + 1)
        self.served[served] = self.served.get(served, 0) + 1

    @property
    def steps(self) -> list[dict]:
        """The group's step lines, parsed (once each)."""
        with self._lock:
            for line in self._raw[self._parsed:]:
                try:
                    self._steps.append(json.loads(line))
                except json.JSONDecodeError:
                    self.bad_lines += 1
            self._parsed = len(self._raw)
            return list(self._steps)

    @property
    def step_count(self) -> int:
        return len(self._raw)

    def rewards(self) -> list[float | None]:
        """Each member's final reward (its end line, else its last step's; None: no step yet)."""
        last: dict[int, float] = {}
        if len(self.ends) < self.members:  # a member still running: its last step says
            for s in self.steps:
                last[s["member"]] = s.get("reward", 0.0)
        return [self.ends[m]["reward"] if m in self.ends else last.get(m) for m in range(self.members)]

    def summary(self) -> dict:
        return {"group": self.id, "epoch": self.epoch, "task": self.task, "members": self.members,
                "rewards": self.rewards(), "steps": self.step_count, "served": dict(self.served), "time": self.time,
                "done": len(self.ends) == self.members}


def _current(method: Callable) -> Callable:
    """A query of a :class:`Run`: reads what was appended first, and holds the run's lock (the
    server answers requests from several threads)."""

    @functools.wraps(method)
    def query(self: Run, *args, **kwargs):
        with self._lock:
            self.refresh()
            return method(self, *args, **kwargs)

    return query


class Run:
    """One run directory (see the module docs)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.steps_file = self.path / "steps.jsonl"
        self.groups: dict[str, Group] = {}
        self.order: list[str] = []  # group ids, as recorded
        self.epochs: list[str] = []  # epoch labels, in first-seen order
        self.tasks: list[str] = []
        self.bad_lines = 0
        self._offset = 0
        self._lock = threading.RLock()

    @property
    def name(self) -> str:
        return self.path.name

    def refresh(self) -> None:
        """Read what was appended to ``steps.jsonl`` since the last look (whole lines only)."""
        with self._lock:
            try:
                size = self.steps_file.stat().st_size
            except FileNotFoundError:
                return
            if size < self._offset:  # rewritten from scratch: start over
                self.__init__(self.path)
            if size == self._offset:
                return
            with open(self.steps_file, "rb") as f:
                f.seek(self._offset)
                data = f.read(size - self._offset)
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next look
            self._offset += end
            for line in data[:end].splitlines():
                self._add(line)

    def _add(self, line: bytes) -> None:
        head = _STEP_HEAD.match(line)
        served = _SERVED.search(line, 0, 400) if head else None
        if head and served:  # the bulk of the file: indexed by its head, parsed later
            g = self.groups.get(head[1].decode())
            if g is None:
                self.bad_lines += 1
            else:
                g.add_step(line, int(head[2]), served[1].decode())
            return
        end = _END_HEAD.match(line)
        if end:  # a member's end: its reward is all the index needs
            g = self.groups.get(end[1].decode())
            if g is None:
                self.bad_lines += 1
            else:
                g.ends[int(end[2])] = {"member": int(end[2]), "reward": float(end[3])}
            return
        try:
            rec = json.loads(line)
            kind = rec["kind"]
        except (json.JSONDecodeError, KeyError, TypeError):
            self.bad_lines += 1  # a line cut by a crash, or not ours: skipped, counted
            return
        if kind == "group":
            g = Group(rec["group"], rec.get("epoch") or "", rec.get("task") or "", int(rec.get("members", 0)),
                      rec.get("instruction") or "", rec.get("obs") or {}, rec.get("time", 0.0))
            self.groups[g.id] = g
            self.order.append(g.id)
            if g.epoch not in self.epochs:
                self.epochs.append(g.epoch)
            if g.task not in self.tasks:
                self.tasks.append(g.task)
            return
        g = self.groups.get(rec.get("group"))
        if g is None:
            self.bad_lines += 1
            return
        if kind == "step":  # written by something else than StepLog: parsed now, kept as a line
            g.add_step(line, int(rec.get("member", 0)), str(rec.get("served", "executed")))
        elif kind == "end":
            g.ends[rec["member"]] = rec

    # queries ---------------------------------------------------------------------------
    @_current
    def page(self, *, offset: int = 0, limit: int = 50, epoch: str | None = None, task: str | None = None,
             min_reward: float | None = None, max_reward: float | None = None) -> dict:
        """A page of group summaries, newest epoch last, filtered by epoch, task and reward (a
        group matches when one of its members' rewards lies in [min_reward, max_reward])."""
        if offset < 0 or limit < 1:
            raise ValueError(f"a page needs offset >= 0 and limit >= 1, got offset={offset}, limit={limit}")
        ids = self.order
        if epoch:
            ids = [i for i in ids if self.groups[i].epoch == epoch]
        if task:
            ids = [i for i in ids if self.groups[i].task == task]
        if min_reward is not None or max_reward is not None:
            lo = float("-inf") if min_reward is None else min_reward
            hi = float("inf") if max_reward is None else max_reward
            ids = [i for i in ids if any(r is not None and lo <= r <= hi for r in self.groups[i].rewards())]
        return {"total": len(ids), "offset": offset, "limit": limit,
                "items": [self.groups[i].summary() for i in ids[offset:offset + limit]]}

    @_current
    def group(self, gid: str) -> Group:
        try:
            return self.groups[gid]
        except KeyError:
            raise KeyError(f"run {self.name} has no group {gid!r}") from None

    @_current
    def step(self, gid: str, member: int, depth: int) -> dict:
        g = self.group(gid)
        for s in g.steps:
            if s["member"] == member and s["depth"] == depth:
                return s
        raise KeyError(f"group {gid} has no step {depth} of member {member}")

    @_current
    def info(self) -> dict:
        """What the page's header and filters need: epochs, tasks, counts, and the report."""
        return {"name": self.name, "path": str(self.path), "epochs": self.epochs, "tasks": self.tasks,
                "groups": len(self.order), "steps": sum(g.step_count for g in self.groups.values()),
                "bad_lines": self.bad_lines + sum(g.bad_lines for g in self.groups.values()),
                "report": self.report() is not None}

    def report(self) -> dict | None:
        path = self.path / "report.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as e:
            log.warning("%s: not readable JSON (%s); the page shows the curves of the step log only", path, e)
            return None

    @_current
    def curves(self) -> dict:
        """Per epoch, from the step log: mean final reward, steps, share of steps served from
        the prefix cache and from speculation, tool seconds; plus the report's per-step curves
        (reward, rollout and generation time, hit rate, speculation accuracy, loss) if any."""
        rows = []
        for epoch in self.epochs:
            groups = [g for g in self.groups.values() if g.epoch == epoch]
            rewards = [r for g in groups for r in g.rewards() if r is not None]
            steps = [s for g in groups for s in g.steps]
            n = max(1, len(steps))
            rows.append({"epoch": epoch, "groups": len(groups), "episodes": len(rewards), "steps": len(steps),
                         "reward": sum(rewards) / len(rewards) if rewards else None,
                         "cache": sum(s.get("served") == "cache" for s in steps) / n,
                         "speculation": sum(s.get("served") == "speculation" for s in steps) / n,
                         "tool_s": sum(float(s.get("duration") or 0) for s in steps)})
        report = self.report() or {}
        steps = [{"step": s.get("step"), "reward": s.get("reward"), "rollout_s": s.get("rollout_s"),
                  "generate_s": s.get("generate_s"), "hit_rate": (s.get("cache") or {}).get("hit_rate"),
                  "accuracy": (s.get("speculation") or {}).get("accuracy"), "loss": s.get("loss"),
                  "workspace_mb": s.get("workspace_mb")} for s in report.get("steps", [])]
        ev = report.get("eval") or {}
        return {"epochs": rows, "report_steps": steps,
                "eval": {k: (ev.get(k) or {}).get("mean") for k in ("before", "after")}}


def build_tree(group: Group) -> dict:
    """The group's members as a tree that branches where their calls diverge (see the module
    docs). Returns ``{"root", "nodes", "hits", "served", "divergences"}``; each node has ``id``,
    ``depth``, ``action``, ``signature``, ``members``, ``steps`` ([member, depth] pairs),
    ``served`` (counts), ``duration`` (of its executed step, else the first), ``obs`` (the first
    member's), ``reward`` and ``children``; the root holds the group's first observation and
    the members' final rewards."""
    by_member: dict[int, list[dict]] = {}
    for s in group.steps:
        by_member.setdefault(s["member"], []).append(s)
    rewards = group.rewards()
    root: dict[str, Any] = {"id": "root", "depth": -1, "action": None, "signature": None,
                            "members": list(range(group.members)), "steps": [], "served": dict.fromkeys(SERVED, 0),
                            "duration": None, "obs": group.obs, "reward": None, "children": [],
                            "rewards": rewards, "instruction": group.instruction}
    index: dict[tuple, dict] = {(): root}
    count, hits, served_total = 0, 0, dict.fromkeys(SERVED, 0)
    for member in sorted(by_member):
        path: tuple = ()
        parent = root
        for s in sorted(by_member[member], key=lambda s: s["depth"]):
            path = (*path, s.get("signature") or s.get("action"))
            node = index.get(path)
            if node is None:
                count += 1
                node = {"id": f"n{count}", "depth": s["depth"], "action": s.get("action"),
                        "signature": s.get("signature"), "members": [], "steps": [], "served": dict.fromkeys(SERVED, 0),
                        "duration": s.get("duration"), "obs": s.get("obs") or {}, "reward": s.get("reward"),
                        "error": s.get("error"), "ends": [], "children": []}
                index[path] = node
                parent["children"].append(node)
            served = s.get("served", "executed")
            node["served"][served] = node["served"].get(served, 0) + 1
            served_total[served] = served_total.get(served, 0) + 1
            hits += served == "cache"
            if served == "executed" and node["served"]["executed"] == 1:
                node["duration"] = s.get("duration")  # what running it took, not serving it
            node["members"].append(member)
            node["steps"].append([member, s["depth"]])
            if s.get("terminated") or s.get("truncated"):
                node["ends"].append({"member": member, "reward": s.get("reward")})
            parent = node
    divergences = [n["id"] for n in index.values() if len(n["children"]) > 1]
    return {"root": root, "nodes": count, "hits": hits, "served": served_total, "divergences": divergences,
            "group": group.summary()}


def discover(root: str | Path) -> list[Path]:
    """Run directories under ``root`` (those with a step log or a report), newest first;
    ``root`` itself if it is one."""
    root = Path(root)
    if _is_run(root):
        return [root]
    if not root.is_dir():
        return []
    runs = [d for d in root.iterdir() if d.is_dir() and _is_run(d)]
    return sorted(runs, key=lambda d: d.stat().st_mtime, reverse=True)


def _is_run(d: Path) -> bool:
    return (d / "steps.jsonl").exists() or (d / "report.json").exists()
