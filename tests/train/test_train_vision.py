"""Screenshots reach GRPO's loss: a tiny Qwen3-VL built offline, trained through TRL's
environment_factory on real desktop workspaces (slow), and on a screen test double (an extra,
without workspaces); a vision-language policy is refused on the rollout_func path, where
TRL 1.16 drops the images."""

from __future__ import annotations

import pytest
from PIL import Image

from bunshin_gym.train.vision import VisionProbe, desktop_call, vision_tower

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

SCREEN = (800, 600)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from bunshin_gym.train.tiny_vl import build_tiny_vl_policy, load_vl_policy

    corpus = ["Look at the screen and press a key.", '<tool_call>\n{"name": "press", "arguments": {"key": "a"}}\n'
              '</tool_call>', "Solve the task in the workspace with the tools."]
    path = build_tiny_vl_policy(corpus, tmp_path_factory.mktemp("tiny-vl"), hidden=32)
    return path, *load_vl_policy(path)


def expected_grid(processor, size=SCREEN) -> list[int]:
    """The patch grid Qwen's image processor makes of a screenshot of this size."""
    return processor.image_processor(images=[Image.new("RGB", size)], return_tensors="pt")["image_grid_thw"][0].tolist()


def test_oracle_actions_become_desktop_tool_calls():
    assert desktop_call("pyautogui.write('mkdir ~/projects\\n')") == ("type_text", {"text": "mkdir ~/projects\n"})
    assert desktop_call("pyautogui.hotkey('ctrl', 's')") == ("hotkey", {"keys": ["ctrl", "s"]})
    assert desktop_call({"action_type": "CLICK", "x": 3, "y": 4}) == ("click", {"x": 3, "y": 4})
    assert desktop_call("DONE") == ("done", {})
    for unsayable in ("WAIT", "import os", "pyautogui.write(x)", "pyautogui.moveTo(1, 2)", "(", {"action_type": "X"}):
        assert desktop_call(unsayable) is None


def test_desktop_factory_warm_start_says_oracle_actions_with_the_desktop_tools():
    from types import SimpleNamespace

    from bunshin_gym.train.main import factory_call_mapper
    from bunshin_gym.train.tools import DESKTOP, SHELL

    to_call, sayable = factory_call_mapper("Bunshin-OSWorld-v0", DESKTOP)
    tasks = {"a": SimpleNamespace(oracle=lambda: ["pyautogui.write('ls\\n')", "DONE"]),
             "b": SimpleNamespace(oracle=lambda: ["WAIT", "DONE"]), "c": SimpleNamespace(oracle=lambda: [])}
    assert list(sayable(tasks)) == ["a"] and to_call(tasks["a"].oracle()[0]) == ("type_text", {"text": "ls\n"})
    to_call, sayable = factory_call_mapper("Bunshin-Shell-v0", SHELL)
    assert to_call("ls") == ("shell", {"command": "ls"}) and sayable(tasks) is tasks


def test_tool_call_reward_reads_trl_tool_loop_messages():
    from bunshin_gym.train.rewards import tool_call_reward

    called = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "press"}}]}
    episode = [called, {"role": "tool", "content": "pressed a"}, {"role": "assistant", "content": "no call"}]
    assert tool_call_reward([episode, [called], [], "plain text"]) == [0.5, 1.0, 0.0, 0.0]


def test_tiny_vl_policy_is_a_processor_and_the_probe_tells_grad_from_generation(tiny_vl):
    path, model, proc = tiny_vl
    from bunshin_gym.train.tiny_vl import is_vl_model_dir
    from bunshin_gym.train.vision import is_multimodal

    assert is_vl_model_dir(path) and is_multimodal(proc) and proc.tokenizer.chat_template
    msgs = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", SCREEN, (200, 0, 0))},
                                         {"type": "text", "text": "Look at the screen and press a key."}]}]
    enc = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                   return_tensors="pt")
    grid = expected_grid(proc)
    assert enc["image_grid_thw"][0].tolist() == grid and grid[1] * grid[2] <= 80  # a few patches per screen
    # the image's placeholder is expanded to one token per 2x2 merged patches
    assert int((enc["input_ids"] == model.config.image_token_id).sum()) == grid[1] * grid[2] // 4
    with VisionProbe(model) as probe:
        model.generate(**enc, max_new_tokens=2, do_sample=False)
        model(**enc, labels=enc["input_ids"]).loss.backward()
    assert probe.images(grad=False) == [grid] and probe.images(grad=True) == [grid]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision_tower(model).parameters())
    model.zero_grad()


class ScreenDouble:
    """A test double of a desktop for TRL's environment_factory: no workspace; reset and the one
    tool return a screen image and text, as DesktopEnvironment(multimodal=True) does."""

    def reset(self, **row) -> list:
        self.shade = 0
        return [{"type": "image", "image": Image.new("RGB", SCREEN, (0, 0, 0))},
                {"type": "text", "text": "Look at the screen and press a key."}]

    def press(self, key: str) -> list:
        """Press a key.

        Args:
            key: the key's name.
        """
        self.shade += 40
        return [{"type": "image", "image": Image.new("RGB", SCREEN, (self.shade, 0, 0))},
                {"type": "text", "text": f"pressed {key}"}]


def _length_reward(completions, **kwargs):
    # differs within a group whatever the random policy writes, so the advantages are not zero
    return [float(len(str(c))) for c in completions]


def test_screens_of_an_environment_factory_reach_the_loss_pass(tiny_vl, tmp_path):
    """The extra, without workspaces: TRL's loss pass encodes the reset screens (every rollout's
    prompt holds one) with gradients on, and the GRPO step moves the vision tower."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    _, model, proc = tiny_vl
    tower = vision_tower(model)
    start = [p.detach().clone() for p in tower.parameters()]
    config = GRPOConfig(output_dir=str(tmp_path / "trl"), max_steps=1, learning_rate=1e-2,
                        per_device_train_batch_size=4, num_generations=4, max_completion_length=24,
                        temperature=1.0, beta=0.0, logging_steps=1, save_strategy="no", report_to="none",
                        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
                        max_tool_calling_iterations=1)
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "Solve the task."}]}])
    trainer = GRPOTrainer(model=model, args=config, processing_class=proc, environment_factory=ScreenDouble,
                          reward_funcs=[_length_reward], train_dataset=rows)
    with VisionProbe(model, keep_pixels=True) as probe:
        trainer.train()
    in_loss = probe.images(grad=True)
    assert len(in_loss) >= 4 and all(g == expected_grid(proc) for g in in_loss)  # >= one screen per rollout
    # the pixels encoded are the double's screens: black after reset, red after each key press
    shots = [Image.new("RGB", SCREEN, (40 * k, 0, 0)) for k in range(4)]
    rows = {k: proc.image_processor(images=[im], return_tensors="pt")["pixel_values"] for k, im in enumerate(shots)}
    for call in (c for c in probe.calls if c.grad):
        per_image = call.pixels.split(call.patches // len(call.grid_thw))
        assert all(any(torch.equal(img, r) for r in rows.values()) for img in per_image)
        assert sum(torch.equal(img, rows[0]) for img in per_image) >= 4  # every rollout's reset screen
    assert sum(float((p.detach() - q).abs().sum()) for p, q in zip(tower.parameters(), start, strict=True)) > 0


def test_a_vision_language_policy_is_refused_on_the_rollout_func_path(tmp_path):
    from bunshin_gym.train.main import Args, main

    with pytest.raises(ValueError, match="carries no images from a rollout_func.*--api environment_factory"):
        main(Args(env_id="Bunshin-OSWorld-v0", policy="tiny-vl", tasks="osworld/terminal-mkdir-projects",
                  out_dir=str(tmp_path / "run"), quiet=True))
    with pytest.raises(ValueError, match="WxH"):
        main(Args(env_id="Bunshin-OSWorld-v0", api="environment_factory", screen_size="800",
                  tasks="osworld/terminal-mkdir-projects", out_dir=str(tmp_path / "run"), quiet=True))
    with pytest.raises(ValueError, match="options of the desktop env"):
        main(Args(screen_size="800x600", out_dir=str(tmp_path / "run"), quiet=True))
    assert not (tmp_path / "run").exists()  # refused before anything was built


@pytest.mark.slow
def test_bunshin_train_a_vision_language_policy_on_desktop_screenshots(tmp_path):
    """`bunshin train --policy tiny-vl --api environment_factory` on a real desktop task: the
    warm start fits the first call on TRL's prompt with its screenshot, then two GRPO steps.
    The vision tower encodes the desktop's screenshots (reset and after the tool calls) in the
    loss pass, and its weights move."""
    from bunshin_gym.train.main import Args, main
    from bunshin_gym.train.tiny_vl import load_vl_policy

    args = Args(env_id="Bunshin-OSWorld-v0", api="environment_factory", policy="tiny-vl",
                tasks="osworld/terminal-mkdir-projects", steps=2, num_generations=2, screen_size="800x600",
                a11y_tree=False, format_reward=1.0, warm_start_steps=200, warm_start_loss=0.05, warm_start_lr=5e-3,
                learning_rate=1e-3, lr_warmup_steps=0, temperature=1.0, max_turns=2, max_completion_tokens=200,
                eval_episodes=0, cache=False, speculation=False, out_dir=str(tmp_path / "run"), quiet=True, seed=0)
    report = main(args)
    _, proc = load_vl_policy(tmp_path / "run" / "tiny-vl-policy")
    vis = report["vision"]
    rollouts = args.steps * args.num_generations
    assert report["warm_start"]["loss_last"] <= 0.05
    assert sum(s["tool_calls"] for s in report["steps"]) > 0  # the policy called the desktop's tools
    # every rollout's reset screenshot, plus the screenshots its tool calls returned
    assert vis["images_loss_pass"] > rollouts
    assert vis["grids_loss_pass"] == [tuple(expected_grid(proc))]
    assert vis["vision_update_norm"] > 0
    assert (tmp_path / "run" / "report.json").exists()
