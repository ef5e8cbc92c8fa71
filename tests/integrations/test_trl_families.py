"""The desktop and web environment_factory classes on real workspaces: their tool methods drive
the env, get_reward is the task's score, a multimodal desktop returns the screenshot as an image block."""

from __future__ import annotations

import re
import time

from bunshin_gym.integrations.trl import DesktopEnvironment, WebEnvironment


def test_desktop_tools_solve_a_task_and_show_the_screen():
    cls = DesktopEnvironment.configure(screen_size=(800, 600), require_a11y_tree=False, multimodal=True)
    env = cls()
    try:
        first = env.reset(task="osworld/terminal-mkdir-projects")
        image, text = first
        assert image["type"] == "image" and image["image"].size == (800, 600)
        assert text["text"].startswith("Create a folder named projects")
        out = env.type_text("mkdir ~/projects\n")
        assert out[-1]["type"] == "text" and "error" not in out[-1]["text"]
        # the keys are typed when the tool returns; the terminal's shell runs them a moment
        # later (on a loaded host, after done() had already scored the task once)
        ws = env.env.unwrapped.workspace
        deadline = time.monotonic() + 30
        while ws.exec("test -d /home/user/projects").exit_code and time.monotonic() < deadline:
            time.sleep(0.2)
        out = env.done()
        assert out[-1]["text"].endswith("[episode ended]")
        assert env.get_reward() == 1.0
    finally:
        cls.close_all()


def test_web_tools_answer_a_question():
    cls = WebEnvironment.configure()
    env = cls()
    try:
        first = env.reset(task="webarena/1001")
        box = re.search(r"\[(\d+)\] searchbox 'Search'", first).group(1)
        page = env.type_text(box, "Voltix Pro Wireless Over-Ear Headphones")
        link = re.search(r"\[(\d+)\] link 'Voltix Pro Wireless Over-Ear Headphones, Set of 3, Black'", page)
        env.click(link.group(1))
        assert env.click("99999").startswith("error: there is no element with id [99999]")
        assert env.stop("$40.99").endswith("[episode ended]")
        assert env.get_reward() == 1.0
    finally:
        cls.close_all()
