"""A tiny vision-language policy built locally and offline: the tiny policy's byte-level BPE
(with Qwen's vision tokens added), TRL's bundled Qwen3-VL chat template, Qwen's image
processor capped at a few patches per screenshot, and a randomly initialised Qwen3-VL (a
one-block vision tower, two text layers).

It is the smallest model of a family transformers ships whose images TRL carries into its
loss pass: TRL rebuilds the image inputs of multimodal tool results (screenshots after each
action) from the processor's image processor, and marks their places by ``<|image_pad|>``
(see :mod:`bunshin_gym.train.vision`). Saved as an ordinary Hugging Face model directory.

Example:
    >>> path = build_tiny_vl_policy(shell_corpus(tasks, DESKTOP), "/tmp/tiny-vl")
    >>> model, processor = load_vl_policy(path)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bunshin_gym.train.tiny import SPECIAL

#: Qwen's vision tokens: the chat template writes them, the processor expands ``<|image_pad|>``
VISION_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
#: pixels of a screenshot after the image processor's resize, at most: with 16-pixel patches merged
#: 2x2, a 4:3 screen becomes a 10x8-patch grid, 20 image tokens (an 800x600 screen has 1,875 patches)
MAX_PIXELS = 16 * 16 * 80
MIN_PIXELS = 16 * 16 * 16


def build_tiny_vl_policy(corpus: list[str], out_dir: str | Path, *, vocab_size: int = 1024, hidden: int = 64,
                         layers: int = 2, heads: int = 4, vision_hidden: int = 32, vision_depth: int = 1,
                         max_pixels: int = MAX_PIXELS, min_pixels: int = MIN_PIXELS, seed: int = 0) -> Path:
    """Train a tokenizer on ``corpus``, initialise a tiny Qwen3-VL, save it with its processor."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessorPil,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )
    from trl.chat_template_utils import qwen3_vl_chat_template

    out = Path(out_dir)
    special = SPECIAL + VISION_SPECIAL
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=special[3:])
    tok.chat_template = qwen3_vl_chat_template
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    # the PIL backend: the default one needs torchvision, which nothing else here does; no video
    # processor for the same reason (screens are images)
    image_processor = Qwen2VLImageProcessorPil(size=size, patch_size=16, merge_size=2, temporal_patch_size=2,
                                               image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor = screen_processor_class()(image_processor=image_processor, tokenizer=tok,
                                         chat_template=qwen3_vl_chat_template)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_SPECIAL}
    torch.manual_seed(seed)
    cfg = Qwen3VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "num_hidden_layers": layers, "num_attention_heads": heads,
                     "num_key_value_heads": max(1, heads // 2), "head_dim": hidden // heads,
                     "max_position_embeddings": 4096, "pad_token_id": tok.pad_token_id,
                     "eos_token_id": tok.eos_token_id,
                     # M-RoPE splits each head's rotary half into time, height, width sections
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": _mrope_section(hidden // heads),
                                         "mrope_interleaved": True}},
        vision_config={"depth": vision_depth, "hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden,
                       "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "out_hidden_size": hidden, "num_position_embeddings": 256,
                       "deepstack_visual_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    model = Qwen3VLForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _mrope_section(head_dim: int) -> list[int]:
    half = head_dim // 2
    hw = half * 3 // 8
    return [half - 2 * hw, hw, hw]


def screen_processor_class() -> type:
    """Qwen3-VL's processor without its video processor: transformers' video processors need
    torchvision, which nothing else here needs (and whose PyPI wheel is a CUDA build); screens
    are images. The processor's sub-processors are the parameters of its ``__init__``."""
    from transformers import Qwen3VLProcessor

    global _ScreenProcessor
    if _ScreenProcessor is None:
        def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                     **kwargs: Any) -> None:
            Qwen3VLProcessor.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        _ScreenProcessor = type("Qwen3VLScreenProcessor", (Qwen3VLProcessor,),
                                {"__init__": __init__, "__module__": __name__})
    return _ScreenProcessor


_ScreenProcessor: type | None = None


def load_vl_policy(path: str | Path, *, dtype: str = "float32") -> tuple[Any, Any]:
    """An image-text-to-text model and its processor from a local path."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=getattr(torch, dtype))
    config = json.loads((Path(path) / "processor_config.json").read_text()) \
        if (Path(path) / "processor_config.json").exists() else {}
    if config.get("processor_class") == "Qwen3VLScreenProcessor":
        processor = screen_processor_class().from_pretrained(str(path))
    else:
        processor = AutoProcessor.from_pretrained(str(path))
    if not hasattr(processor, "image_processor"):
        raise ValueError(f"{path}: its processor has no image processor; not a vision-language model")
    return model, processor


def is_vl_model_dir(path: str | Path) -> bool:
    """A local model directory whose processor has an image processor (a vision-language model)."""
    p = Path(path)
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = p / name
        if f.is_file():
            config = json.loads(f.read_text())
            if name == "preprocessor_config.json" or "image_processor" in config:
                return True
    return False
