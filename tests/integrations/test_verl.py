"""verl's own AgentLoopWorker (verl 0.9.1, installed --no-deps) runs the bunshin agent loop over real
shell workspaces: a DataProto batch of two prompts repeated into GRPO groups of two goes through
verl's registry, hydra instantiation, tool-call parsing (hermes), Continuous Token building, padding
and reward placement. Only the LLM server is a stand-in (scripted tool calls, no GPU)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

# scripts/setup.sh installs verl (--no-deps): a missing verl is a set-up failure, not a skip
import verl
from conftest import leftovers
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry
from verl.protocol import DataProto
from verl.workers.rollout.replica import TokenOutput

import bunshin_gym.integrations.verl as bverl  # noqa: E402
from bunshin_gym.train.tools import call_text  # noqa: E402

# a set-up with a random value: a fresh set-up could not repeat it, only a clone shares it
NONCE_TASK = {
    "id": "shell/nonce", "instruction": "Copy /home/user/nonce to /home/user/answer.txt",
    "setup": ["head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n' > /home/user/nonce"],
    "check": "cmp /home/user/nonce /home/user/answer.txt", "max_steps": 6, "oracle": []}

# what the two members of a group say, turn by turn (None: an answer without a tool call)
SOLVER = [("shell", {"command": "cat /home/user/nonce; cat /home/user/mark"}),
          ("shell", {"command": "cp /home/user/nonce /home/user/answer.txt"}), ("done", {}),
          ("shell", {"command": "echo never-run"})]
EXPLORER = [("shell", {"cmd": "ls"}), ("shell", {"command": "echo from-explorer > /home/user/mark"}),
            ("shell", {"command": "cat /home/user/nonce; cat /home/user/mark"}), None]


class ScriptedServer:
    """Stand-in for verl's LLMServerClient (the model only): the first trajectory of each prompt
    follows SOLVER, the next EXPLORER, each turn's answer tokenized as the model would write it."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.scripts: dict[str, list] = {}  # request id -> remaining turns
        self.seen: dict[str, int] = {}  # prompt -> trajectories started
        self.calls: list[tuple[str, str]] = []  # (request id, decoded prompt)

    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict, **_) -> TokenOutput:
        text = self.tok.decode(prompt_ids)
        self.calls.append((request_id, text))
        if request_id not in self.scripts:
            row = "row-0" if "row-0" in text else "row-1"
            self.seen[row] = self.seen.get(row, 0) + 1
            self.scripts[request_id] = list(SOLVER if self.seen[row] == 1 else EXPLORER)
        turn = self.scripts[request_id].pop(0)
        answer = "I am finished." if turn is None else call_text(*turn)
        ids = self.tok(answer, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    from bunshin_gym.envs.shell.env import shipped_tasks
    from bunshin_gym.train.tiny import build_tiny_policy, shell_corpus

    return build_tiny_policy(shell_corpus(shipped_tasks()), tmp_path_factory.mktemp("tiny"), hidden=32)


def verl_config(model_path: Path, agent: str = "bunshin_shell"):
    """verl's own PPO trainer defaults, with the tiny model and the bunshin loop."""
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    cfg.actor_rollout_ref.model.path = str(model_path)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.name = "vllm"  # only names the backend; no server is started
    rollout.prompt_length, rollout.response_length = 2048, 2048
    rollout.multi_turn.format = "hermes"
    rollout.multi_turn.max_tool_response_length = 2000
    rollout.agent.default_agent_loop = agent
    return cfg


def batch_of(tasks: list, n: int) -> DataProto:
    """Rows as verl's RLHFDataset gives them, repeated n times per prompt as its trainer does."""
    rows = len(tasks)
    raw = np.empty(rows, dtype=object)
    raw[:] = [[{"role": "user", "content": f"Solve the task (row-{i}).\n\n"}] for i in range(rows)]
    extra = np.empty(rows, dtype=object)
    extra[:] = [{"task": t} for t in tasks]
    batch = DataProto.from_dict(non_tensors={"raw_prompt": raw, "extra_info": extra, "index": np.arange(rows),
                                             "uid": np.array([f"uid-{i}" for i in range(rows)], dtype=object)})
    return batch.repeat(n, interleave=True)


def test_registered_in_verls_registry():
    assert _agent_loop_registry["bunshin_shell"] == {"_target_": "bunshin_gym.integrations.verl.ShellAgentLoop"}
    assert _agent_loop_registry["bunshin_osworld"]["_target_"].endswith(".DesktopAgentLoop")
    assert _agent_loop_registry["bunshin_webarena"]["_target_"].endswith(".WebAgentLoop")


def test_worker_runs_groups_on_one_workspace_per_trajectory(tiny_path):
    worker = AgentLoopWorker(verl_config(tiny_path), llm_client=None)
    server = ScriptedServer(worker.tokenizer)
    worker.llm_client = server
    out = asyncio.run(worker.generate_sequences(batch_of([NONCE_TASK, NONCE_TASK], n=2)))
    assert bverl.BunshinAgentLoop._groups == {}  # every group's set-up closed with its last member
    # every request of a trajectory reached the server with the same id; 4 trajectories
    assert len({request_id for request_id, _ in server.calls}) == 4
    check_two_groups_of_two(out, worker.tokenizer)


def check_two_groups_of_two(out: DataProto, tokenizer) -> None:
    """What verl's batch holds after two NONCE_TASK prompts ran as groups of two."""
    info = list(out.non_tensor_batch["bunshin"])
    ids = {i["workspace"] for i in info}
    assert len(ids) == 4 and leftovers(ids) == {}  # four member workspaces, all gone now
    assert [i["task_id"] for i in info] == ["shell/nonce"] * 4

    mask = out.batch["attention_mask"][:, 2048:]  # the response half: 1 on real tokens
    responses = [tokenizer.decode(r[m.bool()]) for r, m in zip(out.batch["responses"], mask, strict=True)]
    # rows 0,0,1,1 (interleaved repeat); within a row, which trajectory the server made the solver
    # depends on scheduling, so find it by what it wrote
    nonces = []
    for row in (0, 1):
        pair = responses[2 * row: 2 * row + 2]
        solver = next(r for r in pair if "cp /home/user/nonce" in r)
        explorer = next(r for r in pair if "from-explorer >" in r)
        nonce_s = solver.split("<tool_response>\n", 1)[1][:16]
        replies = explorer.split("<tool_response>\n")
        # a call with a wrong argument gets verl's error text back and costs no step
        assert replies[1].startswith("Error executing tool 'shell'") and "'cmd'" in replies[1]
        nonce_e = replies[3][:16]
        # the same set-up: a random nonce made once per group, seen by both of its members
        assert nonce_s == nonce_e and all(c in "0123456789abcdef" for c in nonce_s)
        nonces.append(nonce_s)
        # one workspace across the explorer's calls: its second call reads what its first wrote
        assert "from-explorer\n" in replies[3]
        # the members are separate forks: the solver never sees the explorer's file
        assert "No such file" in solver.split("<tool_response>\n", 1)[1].split("</tool_response>")[0]
        # the episode ended at done(): the loop stopped, the fourth scripted call never ran
        assert "never-run" not in solver and "[episode ended]" in solver
    assert nonces[0] != nonces[1]  # two groups, two set-ups

    # the checker's score sits at the last response token, where verl's trainer reads rm_scores
    rm = out.batch["rm_scores"]
    last = mask.sum(dim=1) - 1
    scores = sorted(rm[i, last[i]].item() for i in range(4))
    assert scores == [0.0, 0.0, 1.0, 1.0] and rm.sum().item() == 2.0
    for r, score in zip(responses, rm.sum(dim=1).tolist(), strict=True):
        assert (score == 1.0) == ("cp /home/user/nonce" in r)
    # tool output is masked out of the loss, the model's own tokens are in it
    resp_mask = out.batch["response_mask"]
    assert 0 < resp_mask.sum().item() < mask.sum().item()


@pytest.mark.slow
def test_verls_agent_loop_manager_runs_the_loop_in_a_ray_actor(tiny_path, tmp_path, monkeypatch):
    """verl's AgentLoopManager: the batch goes to an AgentLoopWorker Ray actor (another process,
    which knows the loop only from the config file), the stand-in server pickled to it."""
    import ray
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    from bunshin_gym.cluster import start_local_ray

    cfg = verl_config(tiny_path, agent="bunshin_shell")
    cfg.actor_rollout_ref.rollout.agent.num_workers = 1
    cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(
        bverl.write_agent_loop_config(tmp_path / "loops.yaml"))
    # Ray's workers inherit the driver's environment: there they unpickle the stand-in server by
    # importing this test module (its package and the suite's conftest live under tests/)
    tests = str(Path(__file__).parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    start_local_ray(num_cpus=2, object_store_mb=100)
    try:
        tokenizer = AgentLoopWorker(cfg, llm_client=None).tokenizer
        manager = AgentLoopManager.create(config=cfg, llm_client=ScriptedServer(tokenizer))
        out = manager.generate_sequences(batch_of([NONCE_TASK, NONCE_TASK], n=2))
        check_two_groups_of_two(out, tokenizer)
        assert out.meta_info["timing"]["agent_loop/tool_calls/max"] > 0
    finally:
        ray.shutdown()


def test_loops_named_in_verls_config_file_are_built_by_verl(tiny_path, tmp_path):
    """The way a Ray worker finds them: verl's agent_loop_config_path, hydra's _target_ import."""
    import hydra
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

    from bunshin_gym.integrations.trl import DesktopEnvironment, ShellEnvironment, WebEnvironment, tool_methods

    cfg = verl_config(tiny_path)
    cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(
        bverl.write_agent_loop_config(tmp_path / "loops.yaml"))
    saved = dict(_agent_loop_registry)
    _agent_loop_registry.clear()  # only the file may register them
    try:
        worker = AgentLoopWorker(cfg, llm_client=None)
        assert set(_agent_loop_registry) == {"bunshin_shell", "bunshin_osworld", "bunshin_webarena"}
        for name, family in [("bunshin_shell", ShellEnvironment), ("bunshin_osworld", DesktopEnvironment),
                             ("bunshin_webarena", WebEnvironment)]:
            # the same call verl's worker makes for every trajectory
            loop = hydra.utils.instantiate(
                config=_agent_loop_registry[name], trainer_config=DictConfigWrap(config=cfg), server_manager=None,
                tokenizer=worker.tokenizer, processor=None, hf_model_type=None, dataset_cls=worker.dataset_cls,
                data_config=DictConfigWrap(cfg.data), tools=ToolListWrap(worker.tools))
            assert isinstance(loop, bverl.BunshinAgentLoop) and loop.family is family
            assert set(loop.tools) == {m.__name__ for m in tool_methods(family())}
            assert [s["function"]["name"] for s in loop.tool_schemas] == list(loop.tools)
    finally:
        _agent_loop_registry.clear()
        _agent_loop_registry.update(saved)


def test_a_row_without_task_fails_clearly_and_leaks_nothing(tiny_path):
    worker = AgentLoopWorker(verl_config(tiny_path), llm_client=None)
    worker.llm_client = ScriptedServer(worker.tokenizer)
    batch = batch_of(["shell/hello-file"], n=1)
    batch.non_tensor_batch["extra_info"] = np.array([{"split": "train"}], dtype=object)
    with pytest.raises(ValueError, match=r"needs the row's task: extra_info\['task'\]"):
        asyncio.run(worker.generate_sequences(batch))
    assert bverl.BunshinAgentLoop._groups == {}


def test_a_set_up_that_fails_fails_every_member_and_leaks_nothing(tiny_path):
    worker = AgentLoopWorker(verl_config(tiny_path), llm_client=None)
    worker.llm_client = ScriptedServer(worker.tokenizer)
    with pytest.raises(Exception, match="no-such-task"):
        asyncio.run(worker.generate_sequences(batch_of(["shell/no-such-task"], n=2)))
    assert bverl.BunshinAgentLoop._groups == {}
