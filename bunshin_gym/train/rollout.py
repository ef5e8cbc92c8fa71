"""The ``rollout_func`` for TRL's ``GRPOTrainer``: every GRPO group runs in a group vector env.

``prompts`` holds each prompt ``num_generations`` (G) times in a row; a prompt names the task
(``"shell/count-files"``). Each run of G prompts becomes one group: a
:class:`~bunshin_gym.rollout.group.GroupVectorEnv` (G forks of one workspace) with the prefix
cache and speculation wrappers, driven by :meth:`GroupVectorEnv.run_group`, one thread per
member. The policy of a member generates turn by turn:

1. the episode's prompt (system, tools, instruction) is tokenised once;
2. each turn, the member asks the shared :class:`Batcher` for a turn; the batcher samples the
   turns of every waiting episode in one batched call once all running episodes wait;
3. the turn's ids are appended (``env_mask`` 1); a turn that hit its token cap is closed with
   the end-of-turn id (``env_mask`` 0: the policy did not write it);
4. the tool call is parsed: malformed output appends an error observation and the model
   tries again (no env step); a good call is the env action;
5. the env's observation is appended as the chat template's suffix ids (``env_mask`` 0),
   never re-tokenising the history.

An episode ends when the env ends it (DONE, FAIL, the task's step cap) or when the turn or
token budget runs out, in which case the adapter's give-up action is sent so the env still
scores the final state. The env's reward reaches the reward function as ``env_reward``.

Example:
    >>> rollout = BunshinRollout(ChatFormat(tok, SHELL.tools), num_generations=4, cache=cache)
    >>> GRPOTrainer(model, reward_funcs=[env_reward], args=cfg, train_dataset=tasks_dataset(ids),
    ...             processing_class=tok, rollout_func=rollout)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym

import bunshin_gym  # noqa: F401  (registers the envs)
from bunshin_gym.train.chat import ChatFormat
from bunshin_gym.train.observations import IMAGE_KEYS, TREE_KEYS, render
from bunshin_gym.train.policies import Generation, LocalGenerator, Request
from bunshin_gym.train.tools import ActionAdapter, ToolCallError, adapter_for, parse_tool_call


@dataclass
class Episode:
    """One member's token record (what TRL gets) and its outcome."""

    index: int
    task_id: str
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled_logprobs: bool = True  # every turn came with logprobs
    pixel_inputs: list[dict] = field(default_factory=list)
    actions: list = field(default_factory=list)
    turns: int = 0
    malformed: int = 0
    truncated_turns: int = 0
    ran_out: bool = False
    reward: float = 0.0
    done: bool = False

    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add_model(self, gen: Generation, eot_id: int) -> None:
        self.completion_ids += gen.ids
        self.env_mask += [1] * len(gen.ids)
        if gen.logprobs is None:
            self.sampled_logprobs = False
            self.logprobs += [0.0] * len(gen.ids)
        else:
            self.logprobs += list(gen.logprobs)
        if not gen.closed:  # force-close a truncated turn; the policy did not write this id
            self.completion_ids.append(eot_id)
            self.env_mask.append(0)
            self.logprobs.append(0.0)
            self.truncated_turns += 1
        self.turns += 1

    def add_env(self, ids: list[int], pixel_inputs: dict | None = None) -> None:
        self.completion_ids += ids
        self.env_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        if pixel_inputs:
            self.pixel_inputs.append(pixel_inputs)


class Batcher:
    """Batches the turn requests of concurrently running episodes: a batch is sampled once
    every running episode waits for a turn (deterministic batches: same seed, same run)."""

    def __init__(self, generator: Any):
        self.generator = generator
        self.cv = threading.Condition()
        self.running = 0
        self.pending: list[tuple[Request, dict]] = []
        self.busy = False
        self.error: BaseException | None = None
        self.calls = 0
        self.gen_s = 0.0

    def join(self, n: int = 1) -> None:
        with self.cv:
            self.running += n

    def leave(self) -> None:
        with self.cv:
            self.running -= 1
            self.cv.notify_all()

    def abort(self, error: BaseException) -> None:
        with self.cv:
            self.error = error
            self.cv.notify_all()

    def generate(self, request: Request) -> Generation:
        slot: dict = {}
        with self.cv:
            self.pending.append((request, slot))
            self.cv.notify_all()
            while "result" not in slot:
                if self.error is not None:
                    raise RuntimeError("rollout aborted") from self.error
                if not self.busy and self.pending and len(self.pending) >= self.running:
                    batch = sorted(self.pending, key=lambda p: getattr(p[0].episode, "index", 0))
                    self.pending, self.busy = [], True
                    self.cv.release()
                    try:
                        t0 = time.perf_counter()
                        results = self.generator.generate([r for r, _ in batch])
                        self.gen_s += time.perf_counter() - t0
                        self.calls += 1
                    except BaseException as e:  # noqa: BLE001 - handed to every waiter
                        results, self.error = None, e
                    finally:
                        self.cv.acquire()
                        self.busy = False
                    if results is not None:
                        for (_, s), res in zip(batch, results, strict=True):
                            s["result"] = res
                    self.cv.notify_all()
                    continue
                self.cv.wait(timeout=1.0)
            return slot["result"]


@dataclass
class RolloutResult:
    episodes: list[Episode]
    wall_s: float
    generate_s: float
    cache: dict
    speculation: dict
    workspace_mb: float

    def as_trl(self) -> dict:
        eps = self.episodes
        return {
            "prompt_ids": [e.prompt_ids for e in eps],
            "completion_ids": [e.completion_ids for e in eps],
            "logprobs": [e.logprobs for e in eps] if all(e.sampled_logprobs for e in eps) else None,
            "env_mask": [e.env_mask for e in eps],
            "env_reward": [e.reward for e in eps],
            "task_id": [e.task_id for e in eps],
            "turns": [e.turns for e in eps],
            "malformed": [e.malformed for e in eps],
        }

    @property
    def mean_reward(self) -> float:
        return sum(e.reward for e in self.episodes) / max(1, len(self.episodes))


def task_of(prompt: Any) -> str:
    """The task a prompt names: a string, or a conversation whose last message is the id."""
    if isinstance(prompt, list):
        prompt = prompt[-1]["content"]
    if isinstance(prompt, dict):
        prompt = prompt.get("task") or prompt.get("content")
    return str(prompt).strip()


class BunshinRollout:
    """A ``rollout_func`` over bunshin group envs (see the module docs).

    Args:
        fmt: the policy's chat format.
        env_id: the env (``Bunshin-Shell-v0``, ...).
        num_generations: G, the group size (TRL's ``num_generations``).
        cache: a ``PrefixCache`` shared by every group, or None.
        speculation: a ``Speculation`` shared by every group, or None.
        retrain_selector: refit speculation's selector on the trajectory log after each call.
        generator: who writes turns; default the trainer's own model (``LocalGenerator``).
        adapter: tool calls <-> env actions (default: the env family's).
        max_turns: model turns per episode (malformed ones included).
        max_turn_tokens: ids per model turn.
        max_completion_tokens: ids per episode after the prompt (model and env).
        obs_chars: characters of an observation shown to the model (its tail).
        max_groups: groups run at once (each holds a root workspace and its forks).
        env_kwargs: passed to ``gym.make_vec``.
    """

    def __init__(self, fmt: ChatFormat, *, env_id: str = "Bunshin-Shell-v0", num_generations: int = 4,
                 cache: Any = None, speculation: Any = None, retrain_selector: bool = True, generator: Any = None,
                 adapter: ActionAdapter | None = None, max_turns: int = 6, max_turn_tokens: int = 64,
                 max_completion_tokens: int = 384, obs_chars: int = 600, max_groups: int = 4,
                 env_kwargs: dict | None = None):
        self.fmt, self.env_id, self.G = fmt, env_id, num_generations
        self.cache, self.speculation, self.retrain_selector = cache, speculation, retrain_selector
        self.generator = generator
        self.adapter = adapter or adapter_for(env_id)
        self.max_turns, self.max_turn_tokens = max_turns, max_turn_tokens
        self.max_completion_tokens, self.obs_chars = max_completion_tokens, obs_chars
        self.max_groups = max_groups
        self.env_kwargs = dict(env_kwargs or {})
        self.envs: dict[tuple[int, int], Any] = {}  # (slot, G) -> group env, reused across calls
        self.history: list[RolloutResult] = []

    # TRL entry point ---------------------------------------------------------------------
    def __call__(self, prompts: list, trainer: Any) -> dict:
        if len(prompts) % self.G:
            raise ValueError(f"{len(prompts)} prompts are not whole groups of num_generations={self.G}")
        tasks = []
        for g in range(0, len(prompts), self.G):
            ids = {task_of(p) for p in prompts[g:g + self.G]}
            if len(ids) != 1:
                raise ValueError(f"a GRPO group mixes tasks: {sorted(ids)}")
            tasks.append(ids.pop())
        generator = self.generator
        if generator is None and getattr(trainer, "use_vllm", False):
            from bunshin_gym.train.server import TRLVLLMGenerator

            # TRL pushed the policy's weights to its vLLM server before calling this rollout_func
            args = trainer.args
            generator = TRLVLLMGenerator(trainer, self.fmt, temperature=args.temperature, top_p=args.top_p,
                                         top_k=args.top_k or 0)
        elif generator is None:
            args = trainer.args
            generator = LocalGenerator(trainer.accelerator.unwrap_model(trainer.model), self.fmt,
                                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0)
        return self.run(tasks, generator).as_trl()

    # rollouts ------------------------------------------------------------------------------
    def run(self, tasks: list[str], generator: Any, group_size: int | None = None) -> RolloutResult:
        """Roll out one group of ``group_size`` (default G) episodes per task in ``tasks``."""
        G = group_size or self.G
        t0 = time.perf_counter()
        cache0 = self.cache.stats.as_dict() if self.cache is not None else {}
        spec0 = self.speculation.stats.as_dict() if self.speculation is not None else {}
        episodes = [Episode(i, t) for i, t in enumerate(x for x in tasks for _ in range(G))]
        gen_s, ws_mb = 0.0, 0.0
        for w in range(0, len(tasks), self.max_groups):
            wave = list(range(w, min(len(tasks), w + self.max_groups)))
            batcher = Batcher(generator)
            batcher.join(len(wave) * G)  # every episode of the wave counts from the start
            with ThreadPoolExecutor(len(wave), thread_name_prefix="group") as ex:
                futs = [ex.submit(self._group, slot, G, episodes[g * G:(g + 1) * G], batcher)
                        for slot, g in enumerate(wave)]
                errors = [f.exception() for f in futs]
            gen_s += batcher.gen_s
            ws_mb = max(ws_mb, self._workspace_mb(len(wave)))
            if any(errors):  # the root cause, not the other groups' "rollout aborted"
                raise batcher.error or next(e for e in errors if e)
        if self.cache is not None:
            self.cache.save()
        result = RolloutResult(episodes, time.perf_counter() - t0, gen_s, _delta(self.cache, cache0),
                               _delta(self.speculation, spec0), ws_mb)
        self._refit_selector()
        self.history.append(result)
        return result

    def _env(self, slot: int, G: int) -> Any:
        """The group env of a slot for groups of G (kept for the whole run: closing envs while
        other groups run costs time and races with their snapshots)."""
        key = (slot, G)
        if key not in self.envs:
            self.envs[key] = gym.make_vec(self.env_id, num_envs=G, vectorization_mode="vector_entry_point",
                                          cache=self.cache, speculation=self.speculation, **self.env_kwargs)
        return self.envs[key]

    def _group(self, slot: int, G: int, eps: list[Episode], batcher: Batcher) -> None:
        try:
            envs = self._env(slot, G)
            obs, info = envs.reset(options={"task": eps[0].task_id})
            first = self._first_view(obs, G)
            text = info.get("instruction") or ""
            if first is not None and first.text:
                text = f"{text}\n\n{first.text}"
            for ep in eps:
                ep.prompt_ids, px = self.fmt.prompt_ids(text, first.images if first else None)
                if px:
                    ep.pixel_inputs.append(px)

            def policy(i: int, obs: Any, history: list) -> Any:
                return self._turn(eps[i], obs, history, batcher)

            def on_step(i: int, step: Any) -> None:
                if (step.terminated or step.truncated) and not eps[i].done:
                    eps[i].done = True
                    batcher.leave()

            trajs = envs.run_group(policy, on_step=on_step)
            if batcher.error is not None:  # its members ended as failed: the run stops, as before
                raise batcher.error
            for ep, traj in zip(eps, trajs, strict=True):
                ep.reward = float(traj.reward)
        except BaseException as e:
            batcher.abort(e)
            raise

    def _first_view(self, obs: Any, G: int) -> Any:
        """What the first observation adds to the instruction (a desktop's screen; nothing for a
        fresh shell)."""
        one = _member(obs, 0)
        if isinstance(one, dict) and any(k in one for k in IMAGE_KEYS + TREE_KEYS):
            return render(one, multimodal=self.fmt.multimodal, max_chars=self.obs_chars)
        return None

    def _turn(self, ep: Episode, obs: Any, history: list, batcher: Batcher) -> Any:
        """One env action of a member: append the last observation, then sample turns until one
        holds a well-formed tool call."""
        if history:
            view = render(obs, multimodal=self.fmt.multimodal, max_chars=self.obs_chars)
            ids, px = self.fmt.suffix_ids(view.text, view.images)
            if not self._room(ep, ids):
                return self._give_up(ep)
            ep.add_env(ids, px)
        while True:
            room = self.max_completion_tokens - len(ep.completion_ids) - 1
            gen = batcher.generate(Request(ep.context(), min(self.max_turn_tokens, room), ep))
            ep.add_model(gen, self.fmt.eot_id)
            call = parse_tool_call(self.fmt.decode(gen.ids))
            action = call if isinstance(call, ToolCallError) else self.adapter.to_action(call)
            if not isinstance(action, ToolCallError):
                ep.actions.append(action)
                return action
            ep.malformed += 1
            ids, _ = self.fmt.suffix_ids(f"error: {action.message}")
            if not self._room(ep, ids):
                return self._give_up(ep)
            ep.add_env(ids)

    def _room(self, ep: Episode, next_ids: list[int]) -> bool:
        """Whether another turn fits after ``next_ids``: turn cap, and 8 ids of room at least."""
        left = self.max_completion_tokens - len(ep.completion_ids) - len(next_ids) - 1
        return ep.turns < self.max_turns and left >= min(8, self.max_turn_tokens)

    def _give_up(self, ep: Episode) -> Any:
        ep.ran_out = True
        ep.actions.append(self.adapter.give_up)
        return self.adapter.give_up

    def _workspace_mb(self, n_slots: int) -> float:
        """Distinct resident memory of the groups' live workspaces (roots and forks), in MB."""
        from bunshin_gym.workspace.memstat import group_memory

        pids = []
        for (slot, _), envs in self.envs.items():
            if slot >= n_slots:
                continue
            for env in [envs.root, *envs.members]:
                ws = env.unwrapped._ws
                if ws is not None and not ws.closed:
                    try:
                        pids += ws.pids()
                    except Exception:  # noqa: BLE001 - a workspace going away is not counted
                        pass
        return group_memory(pids).unique / 2**20 if pids else 0.0

    def _refit_selector(self) -> None:
        spec = self.speculation
        log = getattr(self.cache, "log", None)
        if spec is None or log is None or not self.retrain_selector:
            return
        from bunshin_gym.rollout import SpecToolSelector, TrajectoryLog

        entries = TrajectoryLog.load(log.path)[-3000:]
        if entries:
            spec.durations = TrajectoryLog.durations(entries)
            spec.selector = SpecToolSelector.train(entries, epochs=8)

    def close(self) -> None:
        for envs in self.envs.values():
            envs.close()
        self.envs = {}


def _member(obs: Any, i: int) -> Any:
    if isinstance(obs, dict):
        return {k: _member(v, i) for k, v in obs.items()}
    try:
        return obs[i]
    except (TypeError, IndexError, KeyError):
        return obs


def _delta(counter: Any, before: dict) -> dict:
    if counter is None:
        return {}
    now = counter.stats.as_dict()
    out = {k: round(v - before.get(k, 0), 4) for k, v in now.items() if isinstance(v, int | float)}
    for rate, (num, den) in {"hit_rate": ("hits", ("hits", "misses")),
                             "accuracy": ("matched", ("matched", "mismatched"))}.items():
        if rate in now:
            total = sum(out.get(k, 0) for k in den)
            out[rate] = round(out.get(num, 0) / total, 3) if total else 0.0
    return out


def tasks_dataset(task_ids: list[str], repeats: int = 1) -> Any:
    """A TRL train dataset whose prompts are task ids."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [t for _ in range(repeats) for t in task_ids]})


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0
