"""Vision-language policies on desktop screenshots, trained through TRL's ``environment_factory``.

Which TRL path carries images into the loss (TRL 1.16, ``GRPOTrainer``):

- ``rollout_func``: none. ``_generate`` returns no images for it and the extra keys of its
  output reach only the reward functions, so the loss pass sees the placeholder tokens of
  the screenshots without their pixels;
- a dataset ``images`` / ``image`` column: only images known before the rollout, rendered
  into the prompt (not the screens an episode's actions produce);
- ``environment_factory`` (and ``tools``) whose reset and tool results are content blocks
  (``[{"type": "image", "image": PIL}, {"type": "text", ...}]``): TRL collects the images of
  the reset prompt and of every tool result, feeds them to generation, and in the loss pass
  runs the processor's image processor over all of them and marks their places in the
  sequence by the ``<|image_pad|>`` token (Qwen-family models, ``mm_token_type_ids``).

So a multimodal policy trains on ``DesktopEnvironment.configure(multimodal=True)``: its
reset and tool results carry the screen as an image block (:mod:`bunshin_gym.integrations.trl`).
This module adds what that needs beyond the text path: the warm start's examples with their
screenshots (:func:`first_call_examples`, :func:`warm_start`), the oracle's actions as the
desktop class's tool calls (:func:`desktop_call`), and :class:`VisionProbe`, which counts the
images the vision tower encodes with gradients on (the loss pass) and without (generation).
"""

from __future__ import annotations

import ast
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


def is_multimodal(processing_class: Any) -> bool:
    """A processor with an image processor (what TRL calls a VLM), not a plain tokenizer."""
    return hasattr(processing_class, "image_processor") and hasattr(processing_class, "tokenizer")


def desktop_call(action: Any) -> tuple[str, dict] | None:
    """The :class:`~bunshin_gym.integrations.trl.DesktopEnvironment` tool call of an oracle
    action: a computer_13 dict, ``pyautogui.write/press/hotkey/click(...)`` code, or
    DONE/FAIL; None for what its tools cannot say (WAIT, other code)."""
    if action in ("DONE", "FAIL"):
        return action.lower(), {}
    if isinstance(action, dict):
        kind = action.get("action_type")
        simple = {"TYPING": ("type_text", ("text",)), "PRESS": ("press", ("key",)),
                  "HOTKEY": ("hotkey", ("keys",)), "SCROLL": ("scroll", ("dx", "dy")),
                  "CLICK": ("click", ("x", "y", "button", "num_clicks")), "DONE": ("done", ()), "FAIL": ("fail", ())}
        if kind not in simple:
            return None
        name, keys = simple[kind]
        return name, {k: action[k] for k in keys if k in action}
    if not isinstance(action, str):
        return None
    try:
        node = ast.parse(action.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "pyautogui"):
        return None
    try:
        args = [ast.literal_eval(a) for a in node.args]
    except ValueError:
        return None
    name = {"write": "type_text", "typewrite": "type_text", "press": "press", "hotkey": "hotkey",
            "click": "click"}.get(node.func.attr)
    if name == "type_text" and len(args) == 1 and isinstance(args[0], str):
        return name, {"text": args[0]}
    if name == "press" and len(args) == 1 and isinstance(args[0], str):
        return name, {"key": args[0]}
    if name == "hotkey" and args and all(isinstance(a, str) for a in args):
        return name, {"keys": list(args)}
    if name == "click" and len(args) == 2 and all(isinstance(a, int) for a in args):
        return name, {"x": args[0], "y": args[1]}
    return None


@dataclass
class VisionExample:
    """TRL's first prompt of a task, its screenshot inputs, and the first call to learn."""

    task_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    pixel_inputs: dict  # pixel_values, image_grid_thw, mm_token_type_ids (of the prompt)


def first_call_examples(cls: type, processor: Any, tasks: dict[str, Any]) -> list[VisionExample]:
    """For each task whose oracle's first action is a tool call: the prompt as TRL renders it for
    a multimodal env class (the row's prompt as a text block, then what the real ``reset``
    returns, the screenshot included; the tools by the chat template) and that call."""
    from bunshin_gym.integrations.trl import first_observation, task_rows
    from bunshin_gym.train.tools import call_text

    row = task_rows([""])[0]
    out = []
    for task_id, task in tasks.items():
        first_call = next((c for c in map(desktop_call, task.oracle() or []) if c is not None), None)
        if first_call is None:
            log.info("warm start: %s has no oracle action the desktop tools can say; skipped", task_id)
            continue
        first, tools = first_observation(cls, row, task_id)
        blocks = first if isinstance(first, list) else [{"type": "text", "text": first}]
        msgs = [*row["prompt"][:-1], {"role": "user", "content": [
            {"type": "text", "text": row["prompt"][-1]["content"]}, *blocks]}]
        enc = processor.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=True, return_tensors="pt")
        tok = processor.tokenizer
        completion = tok(call_text(*first_call), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        pixels = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        out.append(VisionExample(task_id, enc["input_ids"][0].tolist(), completion, pixels))
    return out


def warm_start(model: Any, examples: list[VisionExample], *, steps: int, lr: float, target_loss: float = 0.0,
               seed: int = 0) -> list[float]:
    """Fit ``model`` on each example's first call given its prompt and screenshot (Adam, the
    examples' mean loss per step) for at most ``steps`` steps, stopping at ``target_loss``."""
    import torch

    if steps <= 0 or not examples:
        return []
    torch.manual_seed(seed)
    batches = []
    for e in examples:
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        labels = ids.clone()
        labels[0, :len(e.prompt_ids)] = -100
        extra = dict(e.pixel_inputs)
        if "mm_token_type_ids" in extra:  # the completion holds no image
            tt = extra["mm_token_type_ids"]
            extra["mm_token_type_ids"] = torch.cat([tt, tt.new_zeros((1, len(e.completion_ids)))], dim=1)
        batches.append((ids, labels, extra))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for ids, labels, extra in batches:
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, **extra).loss
            (loss / len(batches)).backward()
            total += float(loss.detach()) / len(batches)
        opt.step()
        losses.append(total)
        if total <= target_loss:
            break
    return losses


@dataclass
class VisionCall:
    grad: bool  # with gradients on: the loss pass (generation and TRL's scoring run without)
    grid_thw: list[list[int]]  # per image: (frames, patch rows, patch columns)
    patches: int  # rows of pixel_values
    pixels: Any = None  # a CPU copy of pixel_values, when the probe keeps them


@dataclass
class VisionProbe:
    """Records what the model's vision tower encodes (a forward hook): which images reached it,
    and whether with gradients on (and, with ``keep_pixels``, their pixel values: memory grows
    with every call). Use as a context manager, or ``attach``/``detach``."""

    model: Any
    keep_pixels: bool = False
    calls: list[VisionCall] = field(default_factory=list)
    _handle: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self) -> VisionProbe:
        import torch

        tower = vision_tower(self.model)

        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            pixels = args[0] if args else kwargs.get("hidden_states", kwargs.get("pixel_values"))
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            call = VisionCall(torch.is_grad_enabled(), grid.tolist() if grid is not None else [],
                              int(pixels.shape[0]) if pixels is not None else 0,
                              pixels.detach().cpu().clone() if self.keep_pixels and pixels is not None else None)
            with self._lock:
                self.calls.append(call)

        self._handle = tower.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> VisionProbe:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def images(self, *, grad: bool) -> list[list[int]]:
        """The (t, h, w) patch grids of every image encoded with (``grad``) or without gradients."""
        return [g for c in self.calls if c.grad == grad for g in c.grid_thw]


def vision_tower(model: Any) -> Any:
    """The vision encoder of a transformers image-text-to-text model."""
    for path in ("model.visual", "visual", "model.vision_tower", "vision_tower", "model.vision_model"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    raise ValueError(f"{type(model).__name__}: no vision tower found")


def desktop_corpus(cls: type, tasks: Iterable[Any]) -> list[str]:
    """Text to train the tiny VL policy's tokenizer on: what TRL's prompts for ``cls`` hold (the
    chat template's words, the tools' JSON schemas as the template renders them, the row's
    prompt), the tasks' instructions and the oracle's first calls."""
    import json

    from transformers.utils import get_json_schema
    from trl.chat_template_utils import qwen3_vl_chat_template

    from bunshin_gym.integrations.trl import task_rows, tool_methods
    from bunshin_gym.train.chat import SYSTEM
    from bunshin_gym.train.tools import call_text

    methods = tool_methods(cls())  # TRL's rule; the constructor opens no workspace
    out = [SYSTEM, qwen3_vl_chat_template, task_rows([""])[0]["prompt"][-1]["content"]]
    out += [json.dumps(get_json_schema(m)) for m in methods]
    for task in tasks:
        out.append(task.instruction)
        out += [call_text(*c) for c in map(desktop_call, task.oracle() or []) if c is not None]
    return out
