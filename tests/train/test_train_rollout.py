"""The rollout_func over real shell workspaces: token records of multi-turn episodes (malformed
turns, truncated turns, observations), rewards, prefix cache and speculation, and a 2-step GRPO
run through TRL that changes the weights."""

from __future__ import annotations

import pytest

from bunshin_gym.envs.shell.env import shipped_tasks
from bunshin_gym.train.chat import COMPACT_SYSTEM, ChatFormat
from bunshin_gym.train.tools import call_text

torch = pytest.importorskip("torch")
pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from bunshin_gym.train.policies import load_hf_policy
    from bunshin_gym.train.tiny import build_tiny_policy, shell_corpus

    path = build_tiny_policy(shell_corpus(shipped_tasks()), tmp_path_factory.mktemp("tiny"), hidden=32)
    model, tok = load_hf_policy(str(path))
    return model, tok, ChatFormat(tok, tools=None, system=COMPACT_SYSTEM)


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a 0/1 mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


MKDIR = call_text("shell", {"command": "mkdir -p /home/user/projects/alpha"})
LONG = call_text("shell", {"command": "echo " + "word " * 60})  # longer than a turn's cap
DONE = call_text("done", {})
SCRIPTS = {  # member -> its turns
    0: ["I think I should make a directory.", LONG, MKDIR, DONE],  # malformed, truncated, good, done: reward 1
    1: [DONE],  # gives up at once: reward 0
}


def test_rollout_func_records_multi_turn_episodes(tiny, tmp_path):
    from bunshin_gym.rollout import PrefixCache, SpecToolSelector, Speculation, TrajectoryLog
    from bunshin_gym.train.policies import ScriptedGenerator
    from bunshin_gym.train.rollout import BunshinRollout

    _, tok, fmt = tiny
    log = TrajectoryLog(tmp_path / "log.jsonl")
    cache = PrefixCache(tmp_path / "cache", log=log)
    spec = Speculation(SpecToolSelector.train([]), min_duration=0.0)
    texts: dict[int, list[str]] = {}

    def script(ep):
        member = ep.index % 2
        text = SCRIPTS[member][ep.turns]
        texts.setdefault(ep.index, []).append(text)
        return text

    rollout = BunshinRollout(fmt, num_generations=2, cache=cache, speculation=spec, max_turns=6, max_turn_tokens=40,
                             max_completion_tokens=400, generator=ScriptedGenerator(script, fmt))
    try:
        prompts = ["shell/make-dir"] * 2 + ["shell/hello-file"] * 2
        out = rollout(prompts, None)  # TRL's call: the generator is given, the trainer is not needed
        second = rollout(prompts, None)
    finally:
        rollout.close()
        cache.clear()
    assert out["env_reward"] == [1.0, 0.0, 0.0, 0.0]  # hello-file: the make-dir script does not solve it
    assert out["task_id"] == ["shell/make-dir"] * 2 + ["shell/hello-file"] * 2
    assert out["logprobs"] is None  # scripted turns have none; TRL computes them
    assert out["malformed"] == [2, 0, 2, 0] and out["turns"] == [4, 1, 4, 1]
    instr = {"shell/make-dir": "Create the directory /home/user/projects/alpha."}
    assert out["prompt_ids"][0] == fmt.prompt_ids(instr["shell/make-dir"])[0] == out["prompt_ids"][1]
    for ids, mask in zip(out["completion_ids"], out["env_mask"], strict=True):
        assert len(ids) == len(mask) and ids[-1] == fmt.eot_id and mask[-1] == 1

    ids, mask = out["completion_ids"][0], out["env_mask"][0]
    spans = _spans(mask)
    # model turn, error, truncated turn (+ forced close), error, model turn, observation, model turn
    assert [v for v, _, _ in spans] == [1, 0, 1, 0, 1, 0, 1]
    decoded = [fmt.decode(ids[a:b]) for _, a, b in spans]
    assert decoded[0] == SCRIPTS[0][0] + "<|im_end|>"
    assert decoded[1].startswith("\n<|im_start|>user\n<tool_response>\nerror: no tool call found")
    # the truncated turn: exactly max_turn_tokens model ids, then the forced end-of-turn with mask 0
    a, b = spans[2][1], spans[2][2]
    assert b - a == 40 and ids[b - 1] != fmt.eot_id and ids[b] == fmt.eot_id
    assert LONG.startswith(fmt.decode(ids[a:b]))
    assert decoded[3].startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\nerror: the tool call is not closed")
    assert decoded[4] == MKDIR + "<|im_end|>"
    assert decoded[5] == fmt.suffix_text("[exit code 0]")  # the env's observation of mkdir
    assert decoded[6] == DONE + "<|im_end|>"
    # never re-tokenised: the ids are exactly prompt + what each party appended
    assert fmt.decode(ids) == "".join(decoded)
    assert fmt.decode(out["completion_ids"][1]) == DONE + "<|im_end|>"

    # the second epoch's tool calls are all served by the prefix cache, with the same outcome
    assert second["env_reward"] == out["env_reward"] and second["completion_ids"] == out["completion_ids"]
    stats = rollout.history[1].cache
    assert stats["hits"] == 6 and stats["misses"] == 0
    assert [e["served"] for e in TrajectoryLog.load(log.path)].count("cache") == 6


def test_token_budget_ends_the_episode_and_the_env_still_scores_it(tiny):
    from bunshin_gym.train.policies import ScriptedGenerator
    from bunshin_gym.train.rollout import BunshinRollout

    _, tok, fmt = tiny
    rollout = BunshinRollout(fmt, num_generations=1, max_turns=3, max_turn_tokens=60, max_completion_tokens=400,
                             generator=ScriptedGenerator(lambda ep: MKDIR if ep.turns == 0 else "no call", fmt))
    try:
        res = rollout.run(["shell/make-dir"], rollout.generator)
    finally:
        rollout.close()
    (ep,) = res.episodes
    # mkdir, then two malformed turns use up the 3 turns: the adapter's FAIL ends it, the checker scores it
    assert ep.turns == 3 and ep.malformed == 2 and ep.ran_out and ep.actions == [MKDIR_CMD, "FAIL"]
    assert ep.reward == 1.0
    assert ep.env_mask[-1] == 1 and ep.completion_ids[-1] == fmt.eot_id


MKDIR_CMD = "mkdir -p /home/user/projects/alpha"


def test_two_grpo_steps_through_the_real_env_change_the_weights(tmp_path):
    from bunshin_gym.train.main import Args, main

    # a warm start to a low loss sampled hot: some turns well-formed, some not, so the format reward
    # varies within groups and GRPO has a non-zero loss
    # (default groups_per_step: one group per task, so each step holds both tasks once; default
    # negative_advantages 0: only the episodes above their group's mean push the weights)
    args = Args(tasks="shell/make-dir,shell/hello-file", steps=2, num_generations=4, lr_warmup_steps=0,
                warm_start_steps=150, warm_start_loss=0.05, eval_episodes=0, tiny_hidden=64, max_turns=3,
                learning_rate=1e-3, format_reward=0.2, temperature=1.3, out_dir=str(tmp_path / "run"),
                quiet=True, seed=3)
    report = main(args)
    assert len(report["steps"]) == 2
    assert report["totals"]["update_norm"] > 0  # the GRPO steps moved the weights
    for step in report["steps"]:
        assert set(step["per_task"]) == {"shell/make-dir", "shell/hello-file"}  # every task, every step
        assert 0.0 <= step["reward"] <= 1.0 and step["rollout_s"] > 0
    assert report["warm_start"]["oracle_reward"] == [1.0, 1.0]
    assert (tmp_path / "run" / "report.json").exists() and (tmp_path / "run" / "report.png").stat().st_size > 0
    assert report["totals"]["peak_rss_mb"] > 0
