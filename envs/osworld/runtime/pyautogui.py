"""A pyautogui-compatible module for bunshin desktop workspaces (python-xlib + XTest).

Installed inside the workspace as ``pyautogui`` at boot (by the env), so OSWorld's code
strings (``import pyautogui; pyautogui.click(960, 540)``) run unchanged against the
workspace's display (``$DISPLAY``, default ``:0``). It covers pyautogui's mouse and keyboard
API, ``size``, ``position`` and ``screenshot``; image location is not supported.
Standard library + python3-xlib only (PIL only for ``screenshot``).
"""

from __future__ import annotations

import os
import time

from Xlib import XK, X
from Xlib import display as _xdisplay
from Xlib.ext import xtest

__all__ = [
    "click", "doubleClick", "tripleClick", "rightClick", "middleClick", "mouseDown", "mouseUp", "moveTo",
    "moveRel", "move", "dragTo", "dragRel", "drag", "scroll", "vscroll", "hscroll", "write", "typewrite",
    "press", "keyDown", "keyUp", "hotkey", "size", "position", "onScreen", "screenshot", "sleep",
    "isValidKey", "KEYBOARD_KEYS", "KEY_NAMES", "FailSafeException", "PyAutoGUIException",
]

PAUSE = 0.0          # pyautogui's own default is 0.1 s after every call; set it if you need it
FAILSAFE = False
MINIMUM_DURATION = 0.1
#: gap before a key repeats: some toolkits (LibreOffice's) drop a press of the key just released
#: when both carry the same server timestamp
REPEAT_GAP = 0.012
LEFT, MIDDLE, RIGHT, PRIMARY, SECONDARY = "left", "middle", "right", "primary", "secondary"


class PyAutoGUIException(Exception):
    """Raised for invalid arguments (an unknown key or button)."""


class FailSafeException(PyAutoGUIException):
    """Kept for API compatibility; the fail-safe corner is never armed here."""


class ImageNotFoundException(PyAutoGUIException):
    """Kept for API compatibility."""


_display = None
_spare_keycode = None


def _d():
    global _display
    if _display is None:
        _display = _xdisplay.Display(os.environ.get("DISPLAY", ":0"))
    return _display


def _reset_display() -> None:
    """Drop the display connection (the next call reconnects)."""
    global _display, _spare_keycode
    if _display is not None:
        try:
            _display.close()
        except Exception:  # noqa: BLE001
            pass
    _display, _spare_keycode = None, None


def _flush() -> None:
    _d().sync()


def _after(pause: bool = True) -> None:
    if pause and PAUSE:
        time.sleep(PAUSE)


# keys ---------------------------------------------------------------------------------
_NAMED = {
    "enter": "Return", "return": "Return", "\n": "Return", "\r": "Return", "tab": "Tab", "\t": "Tab",
    "space": "space", " ": "space", "backspace": "BackSpace", "\b": "BackSpace", "delete": "Delete",
    "del": "Delete", "esc": "Escape", "escape": "Escape", "up": "Up", "down": "Down", "left": "Left",
    "right": "Right", "home": "Home", "end": "End", "pageup": "Prior", "pgup": "Prior",
    "pagedown": "Next", "pgdn": "Next", "insert": "Insert", "capslock": "Caps_Lock",
    "numlock": "Num_Lock", "scrolllock": "Scroll_Lock", "printscreen": "Print", "prtsc": "Print",
    "prtscr": "Print", "print": "Print", "pause": "Pause", "apps": "Menu", "menu": "Menu",
    "ctrl": "Control_L", "ctrlleft": "Control_L", "ctrlright": "Control_R", "control": "Control_L",
    "shift": "Shift_L", "shiftleft": "Shift_L", "shiftright": "Shift_R",
    "alt": "Alt_L", "altleft": "Alt_L", "altright": "Alt_R", "option": "Alt_L", "optionleft": "Alt_L",
    "optionright": "Alt_R", "win": "Super_L", "winleft": "Super_L", "winright": "Super_R",
    "super": "Super_L", "command": "Super_L", "cmd": "Super_L", "fn": "Super_L",
    "volumeup": "XF86AudioRaiseVolume", "volumedown": "XF86AudioLowerVolume", "volumemute": "XF86AudioMute",
    "num0": "KP_0", "num1": "KP_1", "num2": "KP_2", "num3": "KP_3", "num4": "KP_4", "num5": "KP_5",
    "num6": "KP_6", "num7": "KP_7", "num8": "KP_8", "num9": "KP_9", "add": "KP_Add",
    "subtract": "KP_Subtract", "multiply": "KP_Multiply", "divide": "KP_Divide", "decimal": "KP_Decimal",
    "separator": "KP_Separator", "clear": "Clear", "select": "Select", "execute": "Execute",
    "help": "Help", "browserback": "XF86Back", "browserforward": "XF86Forward",
    "browserrefresh": "XF86Refresh", "browserhome": "XF86HomePage",
}
_NAMED.update({f"f{i}": f"F{i}" for i in range(1, 25)})
KEY_NAMES = sorted(set(_NAMED) | {chr(c) for c in range(32, 127)})
KEYBOARD_KEYS = KEY_NAMES


def isValidKey(key: str) -> bool:  # noqa: N802 - pyautogui's name
    return _keysym(key, strict=False) is not None


def _keysym(key: str, strict: bool = True):
    if not isinstance(key, str) or not key:
        if strict:
            raise PyAutoGUIException(f"invalid key {key!r}")
        return None
    name = _NAMED.get(key) or _NAMED.get(key.lower())
    if name is not None:
        return XK.string_to_keysym(name)
    if len(key) == 1:
        c = ord(key)
        if 0x20 <= c <= 0x7E or 0xA0 <= c <= 0xFF:
            return c
        return 0x01000000 + c
    sym = XK.string_to_keysym(key)
    if sym:
        return sym
    if strict:
        raise PyAutoGUIException(f"unknown key {key!r}")
    return None


def _keycode(sym: int) -> tuple[int, bool]:
    """(keycode, needs shift) for a keysym; maps a spare keycode for symbols the keymap lacks."""
    global _spare_keycode
    d = _d()
    for code, index in d.keysym_to_keycodes(sym):
        if index in (0, 1):
            return code, index == 1
    # not on the keyboard: remap a keycode that has no symbols
    if _spare_keycode is None:
        first = d.display.info.min_keycode
        count = d.display.info.max_keycode - first + 1
        mapping = d.get_keyboard_mapping(first, count)
        for i, syms in enumerate(mapping):
            if not any(syms):
                _spare_keycode = first + i
                break
        else:
            _spare_keycode = d.display.info.max_keycode
    d.change_keyboard_mapping(_spare_keycode, [(sym, sym)])
    d.sync()
    time.sleep(0.01)  # clients fetch the new mapping on MappingNotify
    return _spare_keycode, False


def _key_event(key: str, down: bool) -> None:
    sym = _keysym(key)
    code, shift = _keycode(sym)
    d = _d()
    shift_code = d.keysym_to_keycode(XK.string_to_keysym("Shift_L"))
    if down:
        if shift:
            xtest.fake_input(d, X.KeyPress, shift_code)
        xtest.fake_input(d, X.KeyPress, code)
    else:
        xtest.fake_input(d, X.KeyRelease, code)
        if shift:
            xtest.fake_input(d, X.KeyRelease, shift_code)


def keyDown(key: str, logScreenshot=None, _pause=True) -> None:  # noqa: N802, N803
    _key_event(key, True)
    _flush()
    _after(_pause)


def keyUp(key: str, logScreenshot=None, _pause=True) -> None:  # noqa: N802, N803
    _key_event(key, False)
    _flush()
    _after(_pause)


def press(keys, presses: int = 1, interval: float = 0.0, logScreenshot=None, _pause=True) -> None:  # noqa: N803
    if isinstance(keys, str):
        keys = [keys]
    for i in range(presses):
        for k in keys:
            _key_event(k, True)
            _key_event(k, False)
            _flush()
            if interval:
                time.sleep(interval)
            elif i < presses - 1 or len(keys) > 1:
                time.sleep(REPEAT_GAP)
    _after(_pause)


def hotkey(*args, **kwargs) -> None:
    interval = kwargs.get("interval", 0.0)
    keys = [k for a in args for k in ([a] if isinstance(a, str) else a)]
    for k in keys:
        _key_event(k, True)
        if interval:
            _flush()
            time.sleep(interval)
    # let clients (a window manager's alt-tab grab) see the presses before the releases
    _flush()
    time.sleep(max(interval, 0.02))
    for k in reversed(keys):
        _key_event(k, False)
        if interval:
            _flush()
            time.sleep(interval)
    _flush()
    _after(kwargs.get("_pause", True))


def write(message, interval: float = 0.0, logScreenshot=None, _pause=True) -> None:  # noqa: N803
    prev = None
    for ch in message:
        if ch == prev and not interval:
            _flush()
            time.sleep(REPEAT_GAP)
        prev = ch
        _key_event(ch, True)
        _key_event(ch, False)
        if interval:
            _flush()
            time.sleep(interval)
        elif ord(ch) > 0xFF:
            _flush()  # a remapped keycode must be used before the next remap
    _flush()
    _after(_pause)


typewrite = write


# mouse --------------------------------------------------------------------------------
_BUTTONS = {"left": 1, "primary": 1, "middle": 2, "right": 3, "secondary": 3, 1: 1, 2: 2, 3: 3}


def _button(button) -> int:
    b = _BUTTONS.get(button.lower() if isinstance(button, str) else button)
    if b is None:
        raise PyAutoGUIException(f"button must be left, middle or right, not {button!r}")
    return b


def size() -> tuple[int, int]:
    s = _d().screen()
    return s.width_in_pixels, s.height_in_pixels


def position(x=None, y=None) -> tuple[int, int]:
    p = _d().screen().root.query_pointer()
    return (p.root_x if x is None else int(x)), (p.root_y if y is None else int(y))


def onScreen(x, y=None) -> bool:  # noqa: N802
    x, y = _xy(x, y)
    w, h = size()
    return 0 <= x < w and 0 <= y < h


def _xy(x=None, y=None) -> tuple[int, int]:
    if isinstance(x, (tuple, list)):
        x, y = x[0], x[1]
    cx, cy = position()
    return int(round(cx if x is None else x)), int(round(cy if y is None else y))


def _move(x: int, y: int, duration: float = 0.0) -> None:
    d = _d()
    if duration and duration >= MINIMUM_DURATION:
        sx, sy = position()
        steps = max(2, int(duration * 60))
        for i in range(1, steps + 1):
            xtest.fake_input(d, X.MotionNotify, x=int(sx + (x - sx) * i / steps), y=int(sy + (y - sy) * i / steps))
            d.sync()
            time.sleep(duration / steps)
    xtest.fake_input(d, X.MotionNotify, x=x, y=y)


def moveTo(x=None, y=None, duration=0.0, tween=None, logScreenshot=False, _pause=True) -> None:  # noqa: N802, N803
    _move(*_xy(x, y), duration)
    _flush()
    _after(_pause)


def moveRel(xOffset=None, yOffset=None, duration=0.0, tween=None, logScreenshot=False, _pause=True) -> None:  # noqa: N802, N803
    if isinstance(xOffset, (tuple, list)):
        xOffset, yOffset = xOffset
    cx, cy = position()
    moveTo(cx + (xOffset or 0), cy + (yOffset or 0), duration, _pause=_pause)


move = moveRel


def mouseDown(x=None, y=None, button=PRIMARY, duration=0.0, tween=None, logScreenshot=None, _pause=True) -> None:  # noqa: N802, N803
    b = _button(button)
    if x is not None or y is not None:
        _move(*_xy(x, y), duration)
    xtest.fake_input(_d(), X.ButtonPress, b)
    _flush()
    _after(_pause)


def mouseUp(x=None, y=None, button=PRIMARY, duration=0.0, tween=None, logScreenshot=None, _pause=True) -> None:  # noqa: N802, N803
    b = _button(button)
    if x is not None or y is not None:
        _move(*_xy(x, y), duration)
    xtest.fake_input(_d(), X.ButtonRelease, b)
    _flush()
    _after(_pause)


def click(x=None, y=None, clicks=1, interval=0.0, button=PRIMARY, duration=0.0, tween=None,
          logScreenshot=None, _pause=True) -> None:  # noqa: N803
    b = _button(button)
    if x is not None or y is not None:
        _move(*_xy(x, y), duration)
    d = _d()
    for i in range(int(clicks)):
        xtest.fake_input(d, X.ButtonPress, b)
        xtest.fake_input(d, X.ButtonRelease, b)
        if interval and i < clicks - 1:
            d.sync()
            time.sleep(interval)
    _flush()
    _after(_pause)


def leftClick(x=None, y=None, interval=0.0, duration=0.0, tween=None, logScreenshot=None, _pause=True) -> None:  # noqa: N802, N803
    click(x, y, 1, interval, LEFT, duration, _pause=_pause)


def rightClick(x=None, y=None, interval=0.0, duration=0.0, tween=None, logScreenshot=None, _pause=True) -> None:  # noqa: N802, N803
    click(x, y, 1, interval, RIGHT, duration, _pause=_pause)


def middleClick(x=None, y=None, interval=0.0, duration=0.0, tween=None, logScreenshot=None, _pause=True) -> None:  # noqa: N802, N803
    click(x, y, 1, interval, MIDDLE, duration, _pause=_pause)


def doubleClick(x=None, y=None, interval=0.0, button=LEFT, duration=0.0, tween=None, logScreenshot=None,  # noqa: N802
                _pause=True) -> None:  # noqa: N803
    click(x, y, 2, interval, button, duration, _pause=_pause)


def tripleClick(x=None, y=None, interval=0.0, button=LEFT, duration=0.0, tween=None, logScreenshot=None,  # noqa: N802
                _pause=True) -> None:  # noqa: N803
    click(x, y, 3, interval, button, duration, _pause=_pause)


def dragTo(x=None, y=None, duration=0.0, tween=None, button=PRIMARY, logScreenshot=None, _pause=True,  # noqa: N802
           mouseDownUp=True) -> None:  # noqa: N803
    b = _button(button)
    d = _d()
    if mouseDownUp:
        xtest.fake_input(d, X.ButtonPress, b)
        d.sync()
    tx, ty = _xy(x, y)
    _move(tx, ty, max(duration, 0.2))  # apps need intermediate motion to start a drag
    if mouseDownUp:
        d.sync()
        xtest.fake_input(d, X.ButtonRelease, b)
    _flush()
    _after(_pause)


def dragRel(xOffset=0, yOffset=0, duration=0.0, tween=None, button=PRIMARY, logScreenshot=None, _pause=True,  # noqa: N802
            mouseDownUp=True) -> None:  # noqa: N803
    if isinstance(xOffset, (tuple, list)):
        xOffset, yOffset = xOffset
    cx, cy = position()
    dragTo(cx + xOffset, cy + yOffset, duration, button=button, _pause=_pause, mouseDownUp=mouseDownUp)


drag = dragRel


def _wheel(clicks, up_button: int, down_button: int, x=None, y=None) -> None:
    if x is not None or y is not None:
        _move(*_xy(x, y))
    b = up_button if clicks > 0 else down_button
    d = _d()
    for _ in range(abs(int(clicks))):
        xtest.fake_input(d, X.ButtonPress, b)
        xtest.fake_input(d, X.ButtonRelease, b)
    _flush()


def scroll(clicks, x=None, y=None, logScreenshot=None, _pause=True) -> None:
    """Vertical wheel clicks: positive scrolls up, negative down (as pyautogui on X11)."""
    _wheel(clicks, 4, 5, x, y)
    _after(_pause)


vscroll = scroll


def hscroll(clicks, x=None, y=None, logScreenshot=None, _pause=True) -> None:
    """Horizontal wheel clicks: positive scrolls right, negative left."""
    _wheel(clicks, 7, 6, x, y)
    _after(_pause)


# screen -------------------------------------------------------------------------------
def screenshot(imageFilename=None, region=None):  # noqa: N803
    from PIL import Image

    d = _d()
    root = d.screen().root
    x, y, w, h = region if region else (0, 0, *size())
    raw = root.get_image(x, y, w, h, X.ZPixmap, 0xFFFFFFFF)
    img = Image.frombytes("RGB", (w, h), raw.data, "raw", "BGRX")
    if imageFilename:
        img.save(imageFilename)
    return img


def pixel(x, y) -> tuple[int, int, int]:
    return screenshot(region=(int(x), int(y), 1, 1)).getpixel((0, 0))


def locateOnScreen(*args, **kwargs):  # noqa: N802
    raise NotImplementedError("pyautogui.locateOnScreen is not available in bunshin workspaces")


locateCenterOnScreen = locateAllOnScreen = locateOnScreen


def sleep(seconds: float) -> None:
    time.sleep(seconds)
