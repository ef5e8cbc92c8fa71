"""The Spec Tool Selector: a small classifier that predicts an agent's next tool calls.

It chooses among tool calls recorded in the trajectory log (so a prediction is always a
call that can be executed as is), from features of the trajectory so far: the task, the
depth, the last three signatures (alone and as n-grams) and words of the last
observation, hashed into a fixed-size sparse vector. The model is multinomial logistic
regression trained with Adam on the log; candidates are restricted to calls seen for the
same task. It saves to and loads from one ``.npz`` file.

Example:
    >>> sel = SpecToolSelector.train(TrajectoryLog.load("trajectories.jsonl"))
    >>> sel.predict("shell/count-files", ["sh(ls /data)"], k=2)
    [('sh(ls /data | wc -l > answer.txt)', 'ls /data | wc -l > answer.txt', 0.91), ...]
    >>> sel.save("selector.npz"); SpecToolSelector.load("selector.npz")
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bunshin_gym.rollout.trajlog import TrajectoryLog

_WORD = re.compile(r"[A-Za-z0-9_./-]{2,}")


def _h(token: str, dim: int) -> int:
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=4).digest(), "little") % dim


def features(task: str, history: list[str], observation: str = "", dim: int = 4096) -> np.ndarray:
    """Indices of the active hashed features for one decision point."""
    last = history[-3:]
    toks = [f"task={task}", f"depth={min(len(history), 12)}", "bias"]
    for i, sig in enumerate(reversed(last)):
        toks.append(f"prev{i}={sig}")
        toks.append(f"task+prev{i}={task}|{sig}")
    if len(last) >= 2:
        toks.append(f"bigram={last[-2]}|{last[-1]}")
    toks += [f"obs={w}" for w in _WORD.findall(observation[-2000:])[:64]]
    return np.unique(np.array([_h(t, dim) for t in toks], dtype=np.int64))


class SpecToolSelector:
    """Predicts the next tool calls (see the module docs)."""

    def __init__(self, vocab: list[tuple[str, Any]], task_calls: dict[str, list[int]], dim: int = 4096,
                 weights: np.ndarray | None = None, bias: np.ndarray | None = None):
        self.vocab = vocab  # (signature, action) of every recorded call
        self.index = {sig: i for i, (sig, _) in enumerate(vocab)}
        self.task_calls = task_calls  # task -> vocab indices seen for it
        self.dim = dim
        self.W = weights if weights is not None else np.zeros((dim, len(vocab)), dtype=np.float32)
        self.b = bias if bias is not None else np.zeros(len(vocab), dtype=np.float32)

    # training --------------------------------------------------------------------------
    @classmethod
    def train(cls, entries: list[dict], *, dim: int = 4096, epochs: int = 30, lr: float = 0.05,
              seed: int = 0) -> SpecToolSelector:
        """Fit on a trajectory log (entries of :class:`TrajectoryLog`)."""
        vocab: dict[str, Any] = {}
        task_calls: dict[str, set[int]] = defaultdict(set)
        samples = []
        for ep in TrajectoryLog.episodes(entries):
            hist: list[str] = []
            for e in ep:
                sig = e["signature"]
                if sig not in vocab:
                    vocab[sig] = e.get("action")
                samples.append((e.get("task", ""), list(hist), e.get("observation", ""), sig))
                hist.append(sig)
        sigs = list(vocab)
        sel = cls([(s, vocab[s]) for s in sigs], {}, dim)
        for task, _, _, sig in samples:
            task_calls[task].add(sel.index[sig])
        sel.task_calls = {t: sorted(v) for t, v in task_calls.items()}
        if not samples:
            return sel
        X = [features(t, h, o, dim) for t, h, o, _ in samples]
        y = np.array([sel.index[s] for *_, s in samples])
        rng = np.random.default_rng(seed)
        W, b = sel.W, sel.b
        mW, vW, mb, vb = np.zeros_like(W), np.zeros_like(W), np.zeros_like(b), np.zeros_like(b)
        step = 0
        for _ in range(epochs):
            for i in rng.permutation(len(X)):
                step += 1
                cand = sel._candidates(samples[i][0])
                logits = W[X[i]].sum(0)[cand] + b[cand]
                p = np.exp(logits - logits.max())
                p /= p.sum()
                grad = p
                grad[np.searchsorted(cand, y[i])] -= 1.0  # softmax cross-entropy over candidates
                gW = np.zeros_like(W[X[i]][:, cand]) + grad  # every active feature gets the same row
                for param, m, v, g, rows in ((W, mW, vW, gW, X[i]), (b, mb, vb, grad, None)):
                    idx = np.ix_(rows, cand) if rows is not None else cand
                    m[idx] = 0.9 * m[idx] + 0.1 * g
                    v[idx] = 0.999 * v[idx] + 0.001 * g * g
                    mhat = m[idx] / (1 - 0.9 ** step)
                    vhat = v[idx] / (1 - 0.999 ** step)
                    param[idx] -= lr * mhat / (np.sqrt(vhat) + 1e-8)
        return sel

    def _candidates(self, task: str) -> np.ndarray:
        ids = self.task_calls.get(task)
        return np.array(ids if ids else range(len(self.vocab)), dtype=np.int64)

    # prediction ------------------------------------------------------------------------
    def probabilities(self, task: str, history: list[str], observation: str = "") -> list[tuple[str, Any, float]]:
        if not self.vocab:
            return []
        cand = self._candidates(task)
        x = features(task, history, observation, self.dim)
        logits = self.W[x].sum(0)[cand] + self.b[cand]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        order = np.argsort(-p)
        return [(self.vocab[cand[i]][0], self.vocab[cand[i]][1], float(p[i])) for i in order]

    def predict(self, task: str, history: list[str], observation: str = "", k: int = 1) -> list[tuple[str, Any, float]]:
        """The most likely next ``k`` calls as a chain: each conditioned on the ones before."""
        chain, hist = [], list(history)
        for _ in range(k):
            ranked = self.probabilities(task, hist, observation if not chain else "")
            if not ranked:
                break
            chain.append(ranked[0])
            hist.append(ranked[0][0])
        return chain

    def accuracy(self, entries: list[dict]) -> float:
        """Top-1 accuracy of next-call prediction over a log."""
        right = total = 0
        for ep in TrajectoryLog.episodes(entries):
            hist: list[str] = []
            for e in ep:
                pred = self.predict(e.get("task", ""), hist, e.get("observation", ""), 1)
                right += bool(pred) and pred[0][0] == e["signature"]
                total += 1
                hist.append(e["signature"])
        return right / total if total else 0.0

    # persistence -----------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        meta = json.dumps({"vocab": self.vocab, "task_calls": self.task_calls, "dim": self.dim}, default=str)
        np.savez_compressed(path, W=self.W, b=self.b, meta=np.array(meta))

    @classmethod
    def load(cls, path: str | Path) -> SpecToolSelector:
        data = np.load(path, allow_pickle=False)
        meta = json.loads(str(data["meta"]))
        return cls([tuple(v) for v in meta["vocab"]], meta["task_calls"], meta["dim"], data["W"], data["b"])
