"""Sampling from a server during GRPO, on-policy: TRL's vLLM server mode, weights pushed every step.

``bunshin train --server-url URL`` asks the server what it is before anything is built:

- TRL's vLLM server (``trl vllm-serve``, or ``vllm serve`` started with
  ``VLLM_SERVER_DEV_MODE=1 --weight-transfer-config '{"backend": "nccl"}'``): its
  ``/server_info`` names a weight-transfer engine. The trainer then runs with TRL's
  ``use_vllm=True, vllm_mode="server"``: TRL pushes the policy's weights to the server
  before every step's rollouts (NCCL), and :class:`TRLVLLMGenerator` samples the turns of
  bunshin's group rollouts through TRL's own client (token ids in, token ids and logprobs out);
  with ``--api environment_factory`` TRL's tool loop samples there itself.
- anything else (a plain OpenAI-compatible server, or vLLM without the weight-transfer
  engine): nothing updates its weights, so training against it is off-policy. It is refused
  unless ``--server-off-policy`` says so; then it is sampled through ``/v1/completions``
  (:class:`~bunshin_gym.train.policies.OpenAICompatibleGenerator`) with a loud warning.

TRL's side needs vLLM installed in the trainer's process (its client imports it) and a CUDA
device (its weight sync is NCCL, and it refuses any other device): both are checked first.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from bunshin_gym.train.chat import ChatFormat
from bunshin_gym.train.policies import Generation, Request, _cut

log = logging.getLogger(__name__)

TRL_VLLM = "trl-vllm"  # TRL's vLLM server: weights pushed every step
OFF_POLICY = "off-policy"  # any other server: sampled as it is


@dataclass
class ServerInfo:
    kind: str  # TRL_VLLM or OFF_POLICY
    base_url: str  # without the /v1 suffix (TRL's client adds its paths to it)
    detail: str  # why it was classified so


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def probe_server(url: str, *, timeout: float = 10.0) -> ServerInfo:
    """What serves ``url``: TRL's vLLM server with a weight-transfer engine, or a server whose
    weights nothing can update. An unreachable server is an error."""
    base = base_url(url)
    try:
        with urllib.request.urlopen(f"{base}/server_info?config_format=json", timeout=timeout) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return ServerInfo(OFF_POLICY, base, "it has no /server_info: not vLLM in development mode, which TRL's "
                                                "weight sync needs (a plain OpenAI-compatible server)")
        raise ValueError(f"--server-url {url}: /server_info answered HTTP {e.code}") from e
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"--server-url {url}: cannot reach the server ({e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"--server-url {url}: /server_info did not answer JSON") from e
    config = body.get("vllm_config") if isinstance(body, dict) else None
    if not isinstance(config, dict):
        return ServerInfo(OFF_POLICY, base, "its /server_info has no vllm_config: not a vLLM server")
    if config.get("weight_transfer_config") is None:
        return ServerInfo(OFF_POLICY, base, "vLLM without a weight-transfer engine (start it with trl vllm-serve, or "
                                            "--weight-transfer-config '{\"backend\": \"nccl\"}')")
    return ServerInfo(TRL_VLLM, base, "vLLM with a weight-transfer engine: TRL pushes the weights every step")


def trl_vllm_missing() -> list[str]:
    """What this process lacks for TRL's vLLM server mode (empty: nothing)."""
    import torch
    from trl.import_utils import is_vllm_available

    missing = []
    if not is_vllm_available():
        missing.append("vllm is not installed here (TRL's VLLMClient imports it)")
    if not torch.cuda.is_available():
        missing.append("no CUDA device (TRL pushes weights over NCCL and refuses any other device)")
    return missing


def choose(server_url: str, *, off_policy_ok: bool, factory_api: bool) -> ServerInfo | None:
    """How ``bunshin train`` samples: None (its own model), TRL's vLLM server, or an off-policy
    server (only with ``off_policy_ok``). Raises ValueError for every combination that cannot
    train on-policy and was not allowed to be off-policy."""
    if not server_url:
        return None
    info = probe_server(server_url)
    if info.kind == TRL_VLLM:
        missing = trl_vllm_missing()
        if missing:
            raise ValueError(f"--server-url {server_url} is TRL's vLLM server, but this trainer cannot push weights "
                             f"to it: {'; '.join(missing)}")
        return info
    if factory_api:
        raise ValueError(f"--server-url {server_url}: {info.detail}; with --api environment_factory TRL's tool loop "
                         "samples only from its own model or its vLLM server")
    if not off_policy_ok:
        raise ValueError(f"--server-url {server_url}: {info.detail}. Nothing would update the served weights, so "
                         "training against it is off-policy; serve the policy with `trl vllm-serve` (weights pushed "
                         "every step) or pass --server-off-policy to sample from it anyway")
    log.warning("OFF-POLICY: %s serves weights that nothing updates (%s); GRPO will train on samples of a policy "
                "other than the one it updates", server_url, info.detail)
    return info


class TRLVLLMGenerator:
    """Turns from TRL's vLLM server through the trainer's own client (``trainer.vllm_generation``),
    whose weights TRL pushed before the step's rollouts. Token-id prompts in, token ids and the
    sampled tokens' logprobs out: nothing is re-tokenised.

    Args:
        trainer: a ``GRPOTrainer`` made with ``use_vllm=True, vllm_mode="server"``.
        fmt: the chat format (its end-of-turn id stops a turn).
        temperature, top_p, top_k: sampling parameters (the trainer's).
    """

    def __init__(self, trainer: Any, fmt: ChatFormat, *, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0):
        self.client = trainer.vllm_generation.vllm_client
        self.fmt = fmt
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k

    def generate(self, requests: list[Request]) -> list[Generation]:
        if any(getattr(r.episode, "pixel_inputs", None) for r in requests):
            raise NotImplementedError("image observations go through --api environment_factory")
        out: list[Generation | None] = [None] * len(requests)
        by_len: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_len.setdefault(r.max_new, []).append(i)
        for max_new, idx in by_len.items():
            res = self.client.generate(
                prompts=[requests[i].context for i in idx], n=1, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, max_tokens=max_new, logprobs=0,
                generation_kwargs={"stop_token_ids": [self.fmt.eot_id], "skip_special_tokens": False,
                                   "include_stop_str_in_output": True})
            for j, i in enumerate(idx):
                ids = list(res["completion_ids"][j])
                lps = [float(t[0]) if t else 0.0 for t in res["logprobs"][j]] if res.get("logprobs") else None
                got, closed = _cut(ids[:max_new], self.fmt.eot_id)
                out[i] = Generation(got, lps[:len(got)] if lps is not None and len(lps) >= len(got) else None, closed)
        return out
