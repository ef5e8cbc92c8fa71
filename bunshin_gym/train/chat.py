"""Token-level chat formatting for multi-turn episodes.

The history is never re-tokenised: a prompt is tokenised once, each model turn is appended
as the ids the model produced, and each observation is appended as the ids of the chat
template's text between an end-of-turn and the next generation prompt (the env's
"suffix"), tokenised alone. The suffix's shape is taken from the template itself by
rendering a conversation with marker strings, so any chat template with a ``tool`` role
works (Qwen-style ones render it as ``<|im_start|>user\\n<tool_response>...``).

Multimodal processors: a suffix with images is tokenised by the processor, which expands
each image into its placeholder tokens; the pixel inputs travel with the episode.

Example:
    >>> fmt = ChatFormat(tokenizer, tools=SHELL.tools)
    >>> ids = fmt.prompt_ids("Create /home/user/hello.txt")
    >>> ids += model_turn_ids + fmt.suffix_ids("hello\\n[exit code 0]")
"""

from __future__ import annotations

from typing import Any

SYSTEM = ("You are an agent in a Linux workspace. Act only through the tools, one call per turn, "
          "and call done when the task is complete.")
#: a short system prompt that spells the call format out (for small policies: no tool schemas)
COMPACT_SYSTEM = ('Act with one tool call per turn: <tool_call>{"name": "shell", "arguments": {"command": "..."}}'
                  '</tool_call>; when finished: {"name": "done", "arguments": {}}.')
_U, _A, _O = "\x01USERMARK\x01", "\x01ASSISTANTMARK\x01", "\x01OBSMARK\x01"


class ChatFormat:
    """Prompt and observation ids for one tokenizer (or multimodal processor).

    Args:
        processing_class: a tokenizer, or a processor with a ``tokenizer`` attribute.
        tools: tool schemas rendered into the prompt by the chat template.
        system: the system message.
        template_kwargs: extra chat-template arguments (default ``enable_thinking=False``).
    """

    def __init__(self, processing_class: Any, tools: list[dict] | None = None, system: str = SYSTEM,
                 template_kwargs: dict | None = None):
        self.processor = processing_class
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.multimodal = processing_class is not self.tokenizer and hasattr(processing_class, "image_processor")
        self.tools = tools
        self.system = system
        self.kwargs = {"enable_thinking": False, **(template_kwargs or {})}
        tok = self.tokenizer
        eot = "<|im_end|>" if "<|im_end|>" in tok.get_vocab() else tok.eos_token
        self.eot_text = eot
        self.eot_id = tok.convert_tokens_to_ids(eot)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eot_id
        self._suffixes: dict[int, tuple[str, str]] = {}
        self._suffix_parts(0)

    def _content(self, text: str, n_images: int) -> Any:
        if not n_images:
            return text
        return [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]

    def _suffix_parts(self, n_images: int) -> tuple[str, str]:
        if n_images not in self._suffixes:
            text = self._render([{"role": "user", "content": _U}, {"role": "assistant", "content": _A},
                                 {"role": "tool", "content": self._content(_O, n_images)}],
                                add_generation_prompt=True)
            after = text.index(_A) + len(_A)
            if not text.startswith(self.eot_text, after):
                raise ValueError(f"the chat template does not end an assistant turn with {self.eot_text!r}")
            pre, post = text[after + len(self.eot_text):].split(_O)
            self._suffixes[n_images] = (pre, post)
        return self._suffixes[n_images]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.kwargs)

    def _ids(self, text: str, images: list | None) -> tuple[list[int], dict]:
        if images:
            out = self.processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
            extra = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
            return out["input_ids"][0].tolist(), extra
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], {}

    def prompt_text(self, instruction: str, n_images: int = 0) -> str:
        msgs = ([{"role": "system", "content": self.system}] if self.system else [])
        user = {"role": "user", "content": self._content(instruction, n_images)}
        return self._render(msgs + [user], add_generation_prompt=True)

    def prompt_ids(self, instruction: str, images: list | None = None) -> tuple[list[int], dict]:
        """The episode's prompt (system, tools, the task's instruction, the generation prompt);
        plus the processor's pixel inputs when there are images."""
        return self._ids(self.prompt_text(instruction, len(images or [])), images)

    def suffix_text(self, content: str, n_images: int = 0) -> str:
        pre, post = self._suffix_parts(n_images)
        return pre + content + post

    def suffix_ids(self, content: str, images: list | None = None) -> tuple[list[int], dict]:
        """Ids that follow a model turn's end-of-turn token: the observation and the next
        generation prompt; plus the processor's pixel inputs when there are images."""
        return self._ids(self.suffix_text(content, len(images or [])), images)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
