"""bunshin_gym.train without workspaces: tool-call parser, observations, chat formatting with the
real tiny tokenizer, the OpenAI-compatible client against a real local HTTP server, and a fake
multimodal processor (in addition to the real text path)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from bunshin_gym.envs.shell.env import shipped_tasks
from bunshin_gym.train.chat import COMPACT_SYSTEM, ChatFormat
from bunshin_gym.train.observations import render
from bunshin_gym.train.tools import DESKTOP, SHELL, ToolCall, ToolCallError, call_text, parse_tool_call

torch = pytest.importorskip("torch")


# tool calls ------------------------------------------------------------------------------------
def test_well_formed_calls_parse_and_map_to_env_actions():
    call = parse_tool_call('think first\n<tool_call>\n{"name": "shell", "arguments": {"command": "ls -l"}}\n'
                           '</tool_call><|im_end|>')
    assert call == ToolCall("shell", {"command": "ls -l"})
    assert SHELL.to_action(call) == "ls -l"
    assert SHELL.to_action(parse_tool_call(call_text("done", {}))) == "DONE"
    # arguments given as a JSON string (some models do this)
    call = parse_tool_call('<tool_call>{"name": "shell", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>')
    assert SHELL.to_action(call) == "pwd"
    assert DESKTOP.to_action(ToolCall("action", {"action_type": "CLICK", "x": 3})) == {"action_type": "CLICK", "x": 3}
    for action in ("ls /data", "DONE", "FAIL"):
        assert SHELL.to_action(parse_tool_call(call_text(*SHELL.from_action(action)))) == action


@pytest.mark.parametrize("text, fragment", [
    ("just some words", "no tool call"),
    ('<tool_call>{"name": "shell", "arguments": {"command": "ls"}}', "not closed"),
    ("<tool_call>{name: shell}</tool_call>", "not valid JSON"),
    ('<tool_call>["shell"]</tool_call>', "name"),
    ('<tool_call>{"name": "shell", "arguments": [1]}</tool_call>', "arguments"),
])
def test_malformed_output_is_an_error_not_an_exception(text, fragment):
    err = parse_tool_call(text)
    assert isinstance(err, ToolCallError) and fragment in err.message


def test_adapter_rejects_unknown_tools_and_missing_arguments():
    assert isinstance(SHELL.to_action(ToolCall("python", {"code": "1"})), ToolCallError)
    assert isinstance(SHELL.to_action(ToolCall("shell", {})), ToolCallError)
    assert isinstance(SHELL.to_action(ToolCall("shell", {"command": "  "})), ToolCallError)
    assert isinstance(DESKTOP.to_action(ToolCall("action", {"x": 1})), ToolCallError)


# observations ----------------------------------------------------------------------------------
def test_shell_observations_render_output_and_status():
    assert render({"instruction": "i", "output": "a\nb\n", "exit_code": np.int64(2)}).text == "a\nb\n[exit code 2]"
    assert render({"output": "", "exit_code": -9}).text == "[timed out]"
    long = render({"output": "x" * 5000 + "END", "exit_code": 0}, max_chars=100).text
    assert long.startswith("…") and "END" in long and len(long) < 120


def test_desktop_observations_text_only_and_multimodal():
    shot = np.zeros((20, 30, 3), dtype=np.uint8)
    shot[:, :, 0] = 255
    obs = {"screenshot": shot, "accessibility_tree": "button 'OK' (10, 12)"}
    text = render(obs)
    assert text.images == [] and "button 'OK'" in text.text and "30x20" in text.text
    mm = render(obs, multimodal=True)
    assert len(mm.images) == 1 and mm.images[0].size == (30, 20) and mm.images[0].getpixel((0, 0)) == (255, 0, 0)
    assert "not shown" not in mm.text and "button 'OK'" in mm.text


# chat format with the real tiny tokenizer --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from bunshin_gym.train.policies import load_hf_policy
    from bunshin_gym.train.tiny import build_tiny_policy, shell_corpus

    path = build_tiny_policy(shell_corpus(shipped_tasks()), tmp_path_factory.mktemp("tiny"), hidden=32)
    model, tok = load_hf_policy(str(path))
    return model, tok, ChatFormat(tok, tools=None, system=COMPACT_SYSTEM)


def test_tiny_policy_chat_format(tiny):
    model, tok, fmt = tiny
    assert fmt.eot_id == tok.convert_tokens_to_ids("<|im_end|>")
    prompt, extra = fmt.prompt_ids("Create the directory /home/user/projects/alpha.")
    assert extra == {}
    text = fmt.decode(prompt)
    assert text.startswith("<|im_start|>system\n" + COMPACT_SYSTEM)
    assert text.endswith("/home/user/projects/alpha.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    suffix, _ = fmt.suffix_ids("hello\n[exit code 0]")
    assert fmt.decode(suffix) == ("\n<|im_start|>user\n<tool_response>\nhello\n[exit code 0]\n</tool_response>"
                                  "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the whole conversation re-rendered by the template is what the appended ids spell
    turn = tok(call_text("shell", {"command": "ls"}), add_special_tokens=False)["input_ids"] + [fmt.eot_id]
    msgs = [{"role": "system", "content": COMPACT_SYSTEM}, {"role": "user", "content": "Create the directory "
            "/home/user/projects/alpha."}, {"role": "assistant", "content": call_text("shell", {"command": "ls"})},
            {"role": "tool", "content": "hello\n[exit code 0]"}]
    full = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    spelled = fmt.decode(prompt + turn + suffix)
    # the template drops the empty think block of a past assistant turn; everything else is identical
    assert spelled.replace("<think>\n\n</think>\n\n<tool_call>", "<tool_call>") == full


def test_local_sampling_has_no_hidden_top_k(tiny):
    """TRL computes the training log-probabilities from softmax(logits / T) over the whole vocabulary,
    so sampling must not truncate to transformers' default top-k of 50."""
    from bunshin_gym.train.policies import LocalGenerator, Request

    model, _, fmt = tiny  # randomly initialised: a nearly flat next-token distribution over ~1000 ids
    prompt = fmt.prompt_ids("do it")[0]
    torch.manual_seed(0)
    gens = LocalGenerator(model, fmt, temperature=1.0).generate([Request(prompt, 1) for _ in range(300)])
    assert len({g.ids[0] for g in gens}) > 100


def test_tool_schemas_render_into_the_prompt(tiny):
    _, tok, _ = tiny
    fmt = ChatFormat(tok, tools=SHELL.tools)
    text = fmt.decode(fmt.prompt_ids("do it")[0])
    assert '"name": "shell"' in text and "<tools>" in text


# OpenAI-compatible server ----------------------------------------------------------------------------
class _Completions(BaseHTTPRequestHandler):
    """A small /v1/completions server backed by the tiny model (what vLLM speaks, in miniature)."""

    model = tok = None
    token_ids = True
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        choices = []
        for i, prompt in enumerate(body["prompt"]):
            with torch.no_grad():
                torch.manual_seed(i)
                out = self.model.generate(torch.tensor([prompt]), max_new_tokens=body["max_tokens"], do_sample=True,
                                          temperature=body["temperature"], eos_token_id=body["stop_token_ids"],
                                          pad_token_id=0)
                new = out[0, len(prompt):].tolist()
                logits = self.model(out).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            lps = [float(logits[j, t]) for j, t in enumerate(new)]
            stopped = new[-1] in body["stop_token_ids"]
            tokens = [f"token_id:{t}" for t in new] if self.token_ids else [self.tok.decode([t]) for t in new]
            choices.append({"index": i, "text": self.tok.decode(new), "finish_reason": "stop" if stopped else "length",
                            "logprobs": {"tokens": tokens, "token_logprobs": lps}})
        data = json.dumps({"object": "text_completion", "model": body["model"], "choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tiny):
    model, tok, _ = tiny
    _Completions.model, _Completions.tok, _Completions.token_ids, _Completions.seen = model, tok, True, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_openai_compatible_generator_reads_token_ids_and_logprobs(tiny, server):
    from bunshin_gym.train.policies import OpenAICompatibleGenerator, Request

    model, tok, fmt = tiny
    gen = OpenAICompatibleGenerator(server, "tiny", fmt, temperature=1.0)
    prompt = fmt.prompt_ids("Create /home/user/hello.txt")[0]
    outs = gen.generate([Request(prompt, 12), Request(prompt + [5], 12), Request(prompt, 3)])
    body = _Completions.seen[0]
    assert body["prompt"] == [prompt, prompt + [5]] and body["stop_token_ids"] == [fmt.eot_id]
    assert body["return_tokens_as_token_ids"] is True and len(_Completions.seen) == 2  # grouped by max_tokens
    for g, cap in zip(outs, (12, 12, 3), strict=True):
        assert 0 < len(g.ids) <= cap and len(g.logprobs) == len(g.ids)
        assert all(lp <= 0 for lp in g.logprobs)
        assert g.closed == (g.ids[-1] == fmt.eot_id)
    # logprobs are the served model's own
    with torch.no_grad():
        ref = model(torch.tensor([prompt + outs[0].ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    assert np.allclose(outs[0].logprobs, [float(ref[j, t]) for j, t in enumerate(outs[0].ids)], atol=1e-4)


def test_openai_generator_without_token_ids_tokenises_only_the_turn(tiny, server):
    from bunshin_gym.train.policies import OpenAICompatibleGenerator, Request

    _, tok, fmt = tiny
    _Completions.token_ids = False
    gen = OpenAICompatibleGenerator(server, "tiny", fmt)
    (g,) = gen.generate([Request(fmt.prompt_ids("x")[0], 10)])
    assert g.logprobs is None and len(g.ids) <= 11
    with pytest.raises(RuntimeError, match="HTTP 404"):
        OpenAICompatibleGenerator(server.replace("/v1", "/nope"), "tiny", fmt).generate([Request([1, 2], 4)])


# multimodal processor (fake, in addition to the real text path) ---------------------------------------
class FakeVLProcessor:
    """Enough of a Hugging Face processor: a tokenizer, an image processor, a chat template that
    renders image blocks as a placeholder, and __call__ that expands each placeholder."""

    image_token = "<image>"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.image_processor = object()
        self.calls = []

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False, **kw):
        def content(c):
            if isinstance(c, str):
                return c
            return "".join("<image>" if b["type"] == "image" else b["text"] for b in c)

        msgs = [dict(m, content=content(m["content"])) for m in messages]
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kw)

    def __call__(self, text, images, add_special_tokens=False, return_tensors="pt"):
        self.calls.append(len(images))
        expanded = [t.replace("<image>", "<|endoftext|>" * 4) for t in text]  # 4 patch tokens per image
        ids = self.tokenizer(expanded, add_special_tokens=False, return_tensors="pt")
        return {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"],
                "pixel_values": torch.zeros(len(images), 3, 2, 2)}


def test_screenshot_observations_reach_a_multimodal_processor(tiny):
    _, tok, _ = tiny
    proc = FakeVLProcessor(tok)
    fmt = ChatFormat(proc, tools=None, system=COMPACT_SYSTEM)
    assert fmt.multimodal
    view = render({"screenshot": np.zeros((8, 8, 3), np.uint8), "accessibility_tree": "window 'Calc'"},
                  multimodal=True)
    ids, pixels = fmt.suffix_ids(view.text, view.images)
    assert proc.calls == [1] and pixels["pixel_values"].shape[0] == 1
    assert ids.count(tok.pad_token_id) == 4 and "window 'Calc'" in fmt.decode(ids)
    text_ids, none = fmt.suffix_ids("plain")
    assert none == {} and proc.calls == [1]
