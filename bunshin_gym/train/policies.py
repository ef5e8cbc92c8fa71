"""Policies: who writes the model turns of an episode.

- :func:`load_hf_policy`: a local Hugging Face causal LM (and its tokenizer or processor)
  from a path; the tiny model (``bunshin_gym.train.tiny``) is saved as one.
- :class:`LocalGenerator`: samples turns from an in-process model (the trainer's own model
  during GRPO), batched across every episode waiting for a turn.
- :class:`OpenAICompatibleGenerator`: samples from an OpenAI-compatible server (vLLM,
  SGLang, ...) through ``/v1/completions`` with token-id prompts, and reads back token ids
  (``return_tokens_as_token_ids``) and logprobs, so nothing is re-tokenised.
- :class:`ScriptedGenerator`: writes given texts (oracle solutions for the warm start).

A generator takes :class:`Request` s and returns one :class:`Generation` each.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bunshin_gym.train.chat import ChatFormat


@dataclass
class Request:
    context: list[int]  # prompt + completion so far
    max_new: int
    episode: Any = None  # the Episode asking (task, turn, pixel inputs)


@dataclass
class Generation:
    ids: list[int]  # the sampled ids, the end-of-turn id included when the model wrote it
    logprobs: list[float] | None = None
    closed: bool = True  # the turn ended with the end-of-turn id (else it hit max_new)


def load_hf_policy(path: str, *, dtype: str = "float32") -> tuple[Any, Any]:
    """A causal LM and its processing class (processor for multimodal models) from a local path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    try:
        proc = AutoProcessor.from_pretrained(path)
        if not hasattr(proc, "image_processor"):
            proc = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        proc = AutoTokenizer.from_pretrained(path)
    return model, proc


def _cut(ids: list[int], eot: int) -> tuple[list[int], bool]:
    if eot in ids:
        return ids[:ids.index(eot) + 1], True
    return ids, False


class LocalGenerator:
    """Sampling from an in-process model (left-padded batch, KV cache, stop at end-of-turn).

    Args:
        model: a causal LM (``trainer.accelerator.unwrap_model(trainer.model)`` in training).
        fmt: the chat format (end-of-turn and pad ids).
        temperature, top_p, top_k: sampling parameters (``top_k=0``: off).
    """

    def __init__(self, model: Any, fmt: ChatFormat, *, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0):
        self.model, self.fmt = model, fmt
        self.sampling = {"do_sample": temperature > 0, "temperature": temperature or None, "top_p": top_p,
                         "top_k": top_k or None}

    def generate(self, requests: list[Request]) -> list[Generation]:
        import torch

        plain = [i for i, r in enumerate(requests) if not getattr(r.episode, "pixel_inputs", None)]
        out: list[Generation | None] = [None] * len(requests)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                if plain:
                    for i, g in zip(plain, self._batch([requests[i] for i in plain]), strict=True):
                        out[i] = g
                for i, r in enumerate(requests):
                    if out[i] is None:  # with images: one at a time, with its pixel inputs
                        out[i] = self._batch([r], r.episode.pixel_inputs)[0]
        finally:
            self.model.train(was_training)
        return out

    def _batch(self, reqs: list[Request], extra: list[dict] | None = None) -> list[Generation]:
        import torch

        width = max(len(r.context) for r in reqs)
        dev = next(self.model.parameters()).device
        ids = torch.full((len(reqs), width), self.fmt.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.context):] = torch.tensor(r.context)
            mask[i, width - len(r.context):] = 1
        kwargs = {}
        for d in extra or []:
            for k, v in d.items():
                kwargs[k] = torch.cat([kwargs[k], v]) if k in kwargs else v
        gen = self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                  max_new_tokens=max(r.max_new for r in reqs), eos_token_id=self.fmt.eot_id,
                                  pad_token_id=self.fmt.pad_id, **self.sampling,
                                  **{k: v.to(dev) for k, v in kwargs.items()})
        new = gen[:, width:].tolist()
        result = []
        for r, row in zip(reqs, new, strict=True):
            got, closed = _cut(row[:r.max_new], self.fmt.eot_id)
            result.append(Generation(got, None, closed))
        return result


class OpenAICompatibleGenerator:
    """Turns from an OpenAI-compatible server's ``/v1/completions`` (token-id prompts in,
    token ids and logprobs out). Nothing updates the served weights, so its rollouts are
    off-policy: ``bunshin train`` uses it only with ``--server-off-policy``; TRL's vLLM server
    (weights pushed every step) goes through :mod:`bunshin_gym.train.server`.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model's name.
        fmt: the chat format of the same tokenizer.
        temperature, top_p: sampling parameters.
        api_key: sent as a bearer token when given.
        timeout: seconds per request.
    """

    def __init__(self, base_url: str, model: str, fmt: ChatFormat, *, temperature: float = 1.0,
                 top_p: float = 1.0, api_key: str | None = None, timeout: float = 300.0):
        self.url = base_url.rstrip("/") + "/completions"
        self.model, self.fmt = model, fmt
        self.temperature, self.top_p = temperature, top_p
        self.api_key, self.timeout = api_key, timeout

    def generate(self, requests: list[Request]) -> list[Generation]:
        if any(getattr(r.episode, "pixel_inputs", None) for r in requests):
            raise NotImplementedError("image observations through /v1/completions are not supported yet")
        out: list[Generation | None] = [None] * len(requests)
        by_len: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_len.setdefault(r.max_new, []).append(i)
        for max_new, idx in by_len.items():
            for i, g in zip(idx, self._post([requests[i].context for i in idx], max_new), strict=True):
                out[i] = g
        return out

    def _post(self, prompts: list[list[int]], max_new: int) -> list[Generation]:
        body = {"model": self.model, "prompt": prompts, "max_tokens": max_new, "temperature": self.temperature,
                "top_p": self.top_p, "logprobs": 1, "stop_token_ids": [self.fmt.eot_id], "skip_special_tokens": False,
                "include_stop_str_in_output": True, "return_tokens_as_token_ids": True}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                data = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.url}: HTTP {e.code}: {e.read()[:500]!r}") from e
        choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise RuntimeError(f"{self.url}: {len(choices)} choices for {len(prompts)} prompts")
        return [self._parse(c, max_new) for c in choices]

    def _parse(self, choice: dict, max_new: int) -> Generation:
        lp = choice.get("logprobs") or {}
        tokens, logprobs = lp.get("tokens"), lp.get("token_logprobs")
        if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            ids = [int(t.split(":", 1)[1]) for t in tokens]
        else:  # a server without token ids: only the turn's own text is tokenised
            ids, logprobs = self.fmt.tokenizer(choice.get("text", ""), add_special_tokens=False)["input_ids"], None
        logprobs = [float(x) if x is not None else 0.0 for x in logprobs] if logprobs else None
        if logprobs is not None and len(logprobs) != len(ids):
            logprobs = None
        ids, closed = _cut(ids[:max_new], self.fmt.eot_id)
        if not closed and choice.get("finish_reason") == "stop":  # the server dropped the stop token
            ids, closed = ids + [self.fmt.eot_id], True
            logprobs = logprobs + [0.0] if logprobs is not None else None
        if logprobs is not None:
            logprobs = logprobs[:len(ids)]
        return Generation(ids, logprobs, closed)


class ScriptedGenerator:
    """Writes ``script(episode) -> text`` as the model's turn (the warm start's oracle; tests).
    Like a model, a text longer than the turn's cap is cut there and left unclosed."""

    def __init__(self, script: Callable[[Any], str], fmt: ChatFormat):
        self.script, self.fmt = script, fmt

    def generate(self, requests: list[Request]) -> list[Generation]:
        out = []
        for r in requests:
            ids = self.fmt.tokenizer(self.script(r.episode), add_special_tokens=False)["input_ids"]
            ids.append(self.fmt.eot_id)
            fits = len(ids) <= r.max_new
            out.append(Generation(ids if fits else ids[:r.max_new], None, fits))
        return out
