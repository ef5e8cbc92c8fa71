"""GRPO training with TRL over bunshin envs: the ``rollout_func``, policies, the main job.

- :mod:`~bunshin_gym.train.rollout`: :class:`BunshinRollout`, TRL's ``rollout_func`` (group envs,
  prefix cache, speculation, turn-by-turn generation, ``env_mask``, env rewards);
- :mod:`~bunshin_gym.train.tools`: tool-call parser and env action adapters;
- :mod:`~bunshin_gym.train.observations`: text and screenshot-plus-text observations;
- :mod:`~bunshin_gym.train.chat`: token-level chat formatting (no re-tokenising);
- :mod:`~bunshin_gym.train.policies`: local HF model, OpenAI-compatible server, scripted;
- :mod:`~bunshin_gym.train.server`: TRL's vLLM server mode (weights pushed every step), or refusal;
- :mod:`~bunshin_gym.train.tiny`: the tiny offline policy; :mod:`~bunshin_gym.train.tiny_vl`: a tiny
  Qwen3-VL; :mod:`~bunshin_gym.train.vision`: screenshots into TRL's loss pass;
  :mod:`~bunshin_gym.train.warmstart`;
- :mod:`~bunshin_gym.train.main`: ``bunshin train``; :mod:`~bunshin_gym.train.report`.

Heavy imports (torch, transformers, trl) happen inside functions: importing this package is cheap.
"""
