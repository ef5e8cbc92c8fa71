"""A tiny policy built locally and offline: a byte-level BPE tokenizer trained with
``tokenizers`` on the task set's own text, TRL's bundled Qwen3 chat template, and a
randomly initialised Qwen3 (two layers; ~0.2M parameters at the defaults).

It cannot know any shell by itself: the warm start (``bunshin_gym.train.warmstart``)
teaches it the shipped oracle solutions, and GRPO does the rest. Built in seconds; saved
as an ordinary Hugging Face model directory, so ``hf_local`` loads it like any other.

Example:
    >>> path = build_tiny_policy(shell_corpus(shipped_tasks()), "/tmp/tiny")
    >>> model, tok = load_hf_policy(path)
"""

from __future__ import annotations

import json
from pathlib import Path

from bunshin_gym.train.chat import SYSTEM
from bunshin_gym.train.tools import SHELL, ActionAdapter, call_text

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>", "<think>", "</think>"]
SHELL_WORDS = ("ls cat echo grep wc head tail sort uniq cut awk sed find mkdir cp mv rm chmod touch sqlite3 cd "
               "pwd printf test true false -l -c -n -s -r -p +x > >> < | && ; $ /home/user /data /tmp /etc "
               "answer.txt exit code error no such file or directory permission denied command not found")


def shell_corpus(tasks: list, adapter: ActionAdapter = SHELL) -> list[str]:
    """Text to train the tokenizer on: instructions, oracle calls, tool schemas, system prompt."""
    out = [SYSTEM, json.dumps(adapter.tools), SHELL_WORDS]
    for task in tasks:
        out.append(task.instruction)
        for action in adapter.env_oracle(task.oracle() or []) or []:
            out.append(call_text(*adapter.from_action(action)))
    for i in range(200):
        out.append(f"{i} [exit code {i % 3}]")
    return out


def build_tiny_policy(corpus: list[str], out_dir: str | Path, *, vocab_size: int = 1024, hidden: int = 64,
                      layers: int = 2, heads: int = 4, max_positions: int = 2048, tie_embeddings: bool = False,
                      seed: int = 0) -> Path:
    """Train a tokenizer on ``corpus``, initialise a tiny Qwen3, save both to ``out_dir``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from trl.chat_template_utils import qwen3_chat_template

    out = Path(out_dir)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL[3:])
    tok.chat_template = qwen3_chat_template
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
