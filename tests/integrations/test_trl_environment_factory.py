"""TRL's ``environment_factory`` over real shell workspaces: the group's members start from one
set-up workspace (clones of the first), tools are exactly the env's actions, get_reward is the
checker's score, and a 2-step GRPO run through TRL's own GRPOTrainer on a tiny offline model."""

from __future__ import annotations

import inspect
import os

import pytest
from conftest import leftovers

from bunshin_gym.integrations.trl import (
    DesktopEnvironment,
    ShellEnvironment,
    WebEnvironment,
    first_call_examples,
    task_rows,
)

torch = pytest.importorskip("torch")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# a set-up with a random value and a background process: a fresh set-up could not repeat either
NONCE_TASK = {
    "id": "shell/nonce", "instruction": "Copy /home/user/nonce to /home/user/answer.txt",
    "setup": ["head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n' > /home/user/nonce",
              "setsid sleep 1000 > /dev/null 2>&1 < /dev/null & echo $! > /home/user/sleeper"],
    "check": "cmp /home/user/nonce /home/user/answer.txt", "max_steps": 6, "oracle": []}


def trl_tools(cls: type) -> set[str]:
    """The methods TRL exposes as tools (its rule: public functions of the class but reset, get_reward)."""
    return {n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if n not in ("reset", "get_reward") and not n.startswith("_")}


def test_tools_are_the_actions_and_no_lifecycle_method():
    assert trl_tools(ShellEnvironment) == {"shell", "done"}
    assert trl_tools(DesktopEnvironment) == {"click", "type_text", "press", "hotkey", "scroll", "done", "fail"}
    assert trl_tools(WebEnvironment) == {"click", "type_text", "goto", "go_back", "scroll", "stop"}
    assert trl_tools(ShellEnvironment.configure(cache=None)) == {"shell", "done"}
    from transformers.utils import get_json_schema

    schema = get_json_schema(ShellEnvironment().shell)["function"]
    assert schema["parameters"]["properties"]["command"] == {"type": "string", "description": "the command line."}


def test_group_members_are_clones_of_the_first_set_up():
    cls = ShellEnvironment.configure()
    a, b, c, other = cls(), cls(), cls(), cls()
    try:
        first = a.reset(prompt=[], task=NONCE_TASK)
        assert "Copy /home/user/nonce" in first
        nonce = a.shell("cat /home/user/nonce")
        sleeper = a.shell("cat /home/user/sleeper").split()[0]
        a.shell("echo from-a > /home/user/mark")  # after the set-up: other members must not see it
        b.reset(prompt=[], task=NONCE_TASK)
        c.reset(prompt=[], task=NONCE_TASK)
        for member in (b, c):
            assert member.env.unwrapped._owned is a.env.unwrapped._owned  # same lineage: a clone
            assert member.shell("cat /home/user/nonce") == nonce  # same set-up, not a new one
            assert member.shell(f"tr '\\0' ' ' < /proc/{sleeper}/cmdline").startswith("sleep 1000")
            assert "No such file" in member.shell("cat /home/user/mark")
        assert b.env.unwrapped.workspace.id != c.env.unwrapped.workspace.id
        b.shell("cp /home/user/nonce /home/user/answer.txt")
        assert b.done().endswith("[episode ended]") and b.get_reward() == 1.0
        assert c.get_reward() == 0.0  # unfinished: ended with FAIL, still scored by the checker
        assert c.shell("ls").startswith("The episode has ended")
        # another row: a new set-up, not a clone
        other.reset(prompt=[], task="shell/hello-file")
        assert other.env.unwrapped._owned is not a.env.unwrapped._owned
        other.shell("echo hello world > /home/user/hello.txt")
        assert other.get_reward() == 1.0  # solved without saying done: the give-up still scores it
        ids = {x.env.unwrapped.workspace.id for x in (a, b, c, other)}
        b.reset(prompt=[], task="shell/make-dir")  # a reset closes the member's previous workspace
        ids.add(b.env.unwrapped.workspace.id)
    finally:
        cls.close_all()
    assert all(x.env is None for x in (a, b, c, other))
    assert len(ids) == 5 and leftovers(ids) == {}


def test_a_row_without_task_is_a_clear_error():
    env = ShellEnvironment()
    with pytest.raises(ValueError, match="needs a 'task' column.*prompt"):
        env.reset(prompt=[{"role": "user", "content": "hi"}])
    with pytest.raises(RuntimeError, match="reset"):
        env.shell("ls")


@pytest.fixture(scope="module")
def tiny_tool_policy(tmp_path_factory):
    """The tiny offline policy, fitted for a few steps to answer TRL's tool prompt with a shell call."""
    from bunshin_gym.envs.shell.env import shipped_tasks
    from bunshin_gym.train.policies import load_hf_policy
    from bunshin_gym.train.tiny import build_tiny_policy, shell_corpus
    from bunshin_gym.train.tools import SHELL
    from bunshin_gym.train.warmstart import warm_start

    path = build_tiny_policy(shell_corpus(shipped_tasks()), tmp_path_factory.mktemp("tiny"), hidden=32)
    model, tok = load_hf_policy(str(path))
    tasks = {t.id: t for t in shipped_tasks() if t.id in ("shell/hello-file", "shell/make-dir")}
    examples = first_call_examples(ShellEnvironment, tok, tasks, SHELL.from_action)
    assert [e.task_id for e in examples] == list(tasks)
    assert tok.decode(examples[0].completion_ids).startswith('<tool_call>\n{"name": "shell"')
    losses = warm_start(model, examples, steps=150, lr=5e-3, pad_id=tok.pad_token_id, target_loss=0.02)
    assert losses[-1] < 0.5
    return model, tok


def test_two_grpo_steps_through_environment_factory(tiny_tool_policy, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    from bunshin_gym.rollout import PrefixCache

    model, tok = tiny_tool_policy
    cache = PrefixCache(tmp_path / "cache")
    cls = ShellEnvironment.configure(cache=cache)
    start = [p.detach().clone() for p in model.parameters()]
    config = GRPOConfig(output_dir=str(tmp_path / "trl"), max_steps=2, learning_rate=1e-3,
                        per_device_train_batch_size=4, num_generations=2, max_completion_length=96,
                        temperature=1.0, beta=0.0, logging_steps=1, save_strategy="no", report_to="none",
                        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
                        max_tool_calling_iterations=2)
    trainer = GRPOTrainer(model=model, args=config, processing_class=tok, environment_factory=cls,
                          train_dataset=task_rows(["shell/hello-file", "shell/make-dir"]))
    try:
        trainer.train()
        members = list(cls._instances)
        assert len(members) == 4  # one per rollout of a step, reused (reset) across steps
        # the group's two members share one lineage; the two groups do not
        lineages = {id(m.env.unwrapped._owned) for m in members}
        assert len(lineages) == 2
    finally:
        cls.close_all()
        cache.clear()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    assert sum(h["tools/call_frequency"] for h in logs) > 0  # the policy called the env's tools
    rewards = [h["rewards/ShellEnvironment/mean"] for h in logs]  # get_reward, under the class name
    assert all(0.0 <= r <= 1.0 for r in rewards) and max(rewards) > 0.0
    assert any(h["loss"] != 0 for h in logs)  # some group's rewards differed
    assert sum(float((p.detach() - q).abs().sum()) for p, q in zip(model.parameters(), start, strict=True)) > 0


def test_train_api_is_checked_and_reads_trl_metrics(tmp_path):
    from bunshin_gym.train.main import Args, factory_steps, main

    with pytest.raises(ValueError, match="--api must be"):
        main(Args(api="callbacks", out_dir=str(tmp_path), quiet=True))
    logs = [{"loss": 0.5, "rewards/ShellEnvironment/mean": 0.75, "step_time": 2.0, "tools/call_frequency": 1.5}]
    (step,) = factory_steps(logs, ["ShellEnvironment"])
    assert (step["reward"], step["rollout_s"], step["tool_calls"], step["loss"]) == (0.75, 2.0, 1.5, 0.5)
