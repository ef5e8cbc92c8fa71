"""`--server-url`: TRL's vLLM server mode (weights pushed every step) or a refused / loudly
off-policy plain server.

vLLM cannot run on this machine (its PyPI wheels are CUDA builds pinned to another torch, a CPU
build is a long source build, and TRL pushes weights over NCCL, which it refuses on any device
but CUDA). So the server here is a stand-in over HTTP that speaks what TRL's client asks of
vLLM (/health, /v1/models, /server_info, /get_world_size, /v1/completions with token ids and
logprobs, the weight-update endpoints), backed by a copy of the tiny policy. TRL's real
``VLLMClient`` and ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` drive it; only two
things are replaced, in the tests that say so: vLLM's import gate, and the NCCL transport of
the weights (they travel in the HTTP body instead)."""

from __future__ import annotations

import io
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bunshin_gym.train import server as srv

torch = pytest.importorskip("torch")
pytest.importorskip("trl")


class StandIn(BaseHTTPRequestHandler):
    """A vLLM server in miniature. ``info`` is what /server_info answers (None: 404, as a plain
    OpenAI-compatible server); ``model`` is the served model; ``pushes`` the weights received."""

    info: dict | None = None
    model = None
    pushes: list = []
    completions: list = []

    def _send(self, code: int, obj: dict | None = None) -> None:
        data = json.dumps(obj or {}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/health":
            self._send(200)
        elif path == "/v1/models":
            self._send(200, {"data": [{"id": "tiny"}]})
        elif path == "/server_info" and self.info is not None:
            self._send(200, self.info)
        elif path == "/get_world_size":
            self._send(200, {"world_size": 1})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/update_weights":
            state = torch.load(io.BytesIO(body), weights_only=True)
            type(self).pushes.append(state)
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(state[name])
            self._send(200)
        elif self.path == "/v1/completions":
            self._send(200, self._complete(json.loads(body)))
        else:  # init_weight_transfer_engine, start/finish_weight_update, reset_prefix_cache
            self._send(200)

    def _complete(self, req: dict) -> dict:
        type(self).completions.append(req)
        choices = []
        for i, prompt in enumerate(req["prompt"]):
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), max_new_tokens=req["max_tokens"], do_sample=True,
                                          temperature=req["temperature"], eos_token_id=req["stop_token_ids"],
                                          pad_token_id=0)
                new = out[0, len(prompt):].tolist()
                lp = (self.model(out).logits[0, len(prompt) - 1:-1] / req["temperature"]).log_softmax(-1)
            choices.append({"index": i, "prompt_token_ids": prompt, "token_ids": new,
                            "logprobs": {"tokens": [f"token_id:{t}" for t in new],
                                         "token_logprobs": [float(lp[j, t]) for j, t in enumerate(new)],
                                         "top_logprobs": [None] * len(new)}})
        return {"choices": choices}

    def log_message(self, *args):
        pass


TRL_INFO = {"vllm_config": {"weight_transfer_config": {"backend": "nccl"},
                            "model_config": {"logprobs_mode": "processed_logprobs"}}}


@pytest.fixture
def stand_in():
    StandIn.info, StandIn.model, StandIn.pushes, StandIn.completions = None, None, [], []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    t.join()


def test_the_server_is_asked_what_it_is(stand_in):
    info = srv.probe_server(stand_in + "/v1")  # a plain OpenAI-compatible server: no /server_info
    assert info.kind == srv.OFF_POLICY and info.base_url == stand_in and "plain OpenAI" in info.detail
    StandIn.info = {"vllm_config": {"weight_transfer_config": None}}
    info = srv.probe_server(stand_in)
    assert info.kind == srv.OFF_POLICY and "weight-transfer" in info.detail
    StandIn.info = TRL_INFO
    info = srv.probe_server(stand_in + "/v1/")
    assert info.kind == srv.TRL_VLLM and info.base_url == stand_in
    with pytest.raises(ValueError, match="cannot reach"):
        srv.probe_server("http://127.0.0.1:1/v1", timeout=2)


def test_a_plain_server_is_refused_or_loudly_off_policy(stand_in, caplog, tmp_path):
    url = stand_in + "/v1"
    with pytest.raises(ValueError, match="off-policy.*trl vllm-serve.*--server-off-policy"):
        srv.choose(url, off_policy_ok=False, factory_api=False)
    with pytest.raises(ValueError, match="environment_factory"):
        srv.choose(url, off_policy_ok=True, factory_api=True)
    with caplog.at_level(logging.WARNING, logger="bunshin_gym.train.server"):
        assert srv.choose(url, off_policy_ok=True, factory_api=False).kind == srv.OFF_POLICY
    assert "OFF-POLICY" in caplog.text and url in caplog.text
    assert srv.choose("", off_policy_ok=False, factory_api=False) is None
    # bunshin train refuses before it builds anything
    from bunshin_gym.train.main import Args, main

    with pytest.raises(ValueError, match="off-policy"):
        main(Args(server_url=url, out_dir=str(tmp_path / "run"), quiet=True))
    assert not (tmp_path / "run").exists()


def test_trl_vllm_server_needs_vllm_and_cuda_here(stand_in):
    StandIn.info = TRL_INFO
    missing = srv.trl_vllm_missing()
    if missing:  # this machine: no vllm, no CUDA
        with pytest.raises(ValueError, match="cannot push weights"):
            srv.choose(stand_in, off_policy_ok=False, factory_api=False)
    else:
        assert srv.choose(stand_in, off_policy_ok=False, factory_api=False).kind == srv.TRL_VLLM
    from bunshin_gym.train.main import trl_vllm_options

    opts = trl_vllm_options(srv.ServerInfo(srv.TRL_VLLM, stand_in, ""))
    assert opts == {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": stand_in, "use_cpu": False}
    assert trl_vllm_options(None) == {"use_cpu": True}


@pytest.fixture
def without_vllm_gate_and_nccl(monkeypatch):
    """Lets TRL's client run here: vLLM's import gate opened (its client code needs none of vLLM for
    generation), and the weights sent in the HTTP body instead of over NCCL."""
    import trl.generation.vllm_client as client_mod
    import trl.generation.vllm_generation as generation_mod

    monkeypatch.setattr(client_mod, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(generation_mod, "is_vllm_available", lambda *a, **k: True)

    def init_communicator(self, device=0):
        assert self.get_server_info()["weight_transfer_config"] is not None
        self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": {}})

    def update_named_params(self, metadata, named_params):
        buf = io.BytesIO()
        torch.save({name: t.detach().cpu().clone() for name, t in named_params}, buf)
        self._start_weight_update()
        resp = self.session.post(f"{self.base_url}/update_weights", data=buf.getvalue())
        assert resp.status_code == 200
        self._finish_weight_update()

    monkeypatch.setattr(client_mod.VLLMClient, "init_communicator", init_communicator)
    monkeypatch.setattr(client_mod.VLLMClient, "update_named_params", update_named_params)


def _tiny(tmp_path, seed=0):
    from bunshin_gym.envs.shell.env import shipped_tasks
    from bunshin_gym.train.chat import COMPACT_SYSTEM, ChatFormat
    from bunshin_gym.train.policies import load_hf_policy
    from bunshin_gym.train.tiny import build_tiny_policy, shell_corpus

    path = build_tiny_policy(shell_corpus(shipped_tasks()), tmp_path / "tiny", hidden=32, seed=seed)
    model, tok = load_hf_policy(str(path))
    return model, tok, ChatFormat(tok, tools=None, system=COMPACT_SYSTEM)


def _length_reward(completions, **kwargs):
    # differs within a group whatever the random policy writes: the step moves the weights
    return [float(len(str(c))) for c in completions]


def test_grpo_pushes_weights_to_the_server_every_step_and_samples_from_them(stand_in, tmp_path,
                                                                            without_vllm_gate_and_nccl):
    """GRPOTrainer in TRL's vLLM server mode with bunshin's rollout_func on real shell workspaces:
    before each step TRL pushes the policy's weights, and every turn is sampled by the server."""
    import copy

    from trl import GRPOConfig, GRPOTrainer

    from bunshin_gym.train.main import trl_vllm_options
    from bunshin_gym.train.rewards import env_reward
    from bunshin_gym.train.rollout import BunshinRollout, tasks_dataset

    model, tok, fmt = _tiny(tmp_path)
    served = copy.deepcopy(model)
    with torch.no_grad():  # the server starts with other weights than the trainer's
        for p in served.parameters():
            p.mul_(0.0)
    StandIn.info, StandIn.model = TRL_INFO, served
    rollout = BunshinRollout(fmt, num_generations=2, max_turns=2, max_turn_tokens=16, max_completion_tokens=64)
    options = trl_vllm_options(srv.ServerInfo(srv.TRL_VLLM, stand_in, ""))
    options["use_cpu"] = True  # the stand-in needs no CUDA (TRL's own weight sync does)
    config = GRPOConfig(output_dir=str(tmp_path / "trl"), max_steps=2, learning_rate=1e-2,
                        per_device_train_batch_size=2, num_generations=2, max_completion_length=64, temperature=1.0,
                        beta=0.0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                        dataloader_num_workers=0, **options)
    trainer = GRPOTrainer(model=model, reward_funcs=[env_reward, _length_reward], args=config,
                          train_dataset=tasks_dataset(["shell/make-dir"]), processing_class=tok,
                          rollout_func=rollout)
    weights = []  # the trainer's weights before each step's rollouts

    class Snap:
        def __call__(self, prompts, trainer_):
            weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
            return rollout(prompts, trainer_)

    trainer.rollout_func = Snap()
    try:
        trainer.train()
    finally:
        rollout.close()
    assert len(StandIn.pushes) == 2 == len(weights)  # one push per step, before its rollouts
    for pushed, held in zip(StandIn.pushes, weights, strict=True):
        assert all(torch.equal(pushed[n], held[n]) for n in held)
    assert any(not torch.equal(StandIn.pushes[0][n], StandIn.pushes[1][n]) for n in weights[0])  # step 1 moved them
    final = dict(model.named_parameters())
    assert any(not torch.equal(StandIn.pushes[1][n], final[n].detach()) for n in final)  # step 2 did too
    # every turn was sampled by the server from token ids, stopped at the end of turn
    assert StandIn.completions and all(req["stop_token_ids"] == [fmt.eot_id] for req in StandIn.completions)
    assert all(isinstance(p, list) and all(isinstance(t, int) for t in p)
               for req in StandIn.completions for p in req["prompt"])
    assert len(rollout.history) == 2 and all(e.sampled_logprobs for r in rollout.history for e in r.episodes)
