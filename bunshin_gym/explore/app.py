"""``bunshin explore``: the web page and its JSON API (FastAPI, served by uvicorn).

Routes (``RUN`` is a run directory's name; only runs found at start-up or under the runs
root are served, never an arbitrary path):

- ``/``: the page (``static/``: plain HTML, CSS and JavaScript, no build step, nothing
  fetched from the internet);
- ``/api/runs``; ``/api/runs/RUN`` (epochs, tasks, counts); ``/api/runs/RUN/groups`` (a page
  of groups: ``offset``, ``limit``, ``epoch``, ``task``, ``min_reward``, ``max_reward``);
  ``/api/runs/RUN/groups/GID/tree``; ``/api/runs/RUN/groups/GID/steps/MEMBER/DEPTH`` (one
  step: its full observation text and the action's marks; a web step also ``before``, the
  screenshot its action was chosen on, where its element's box is); ``/api/runs/RUN/curves``;
  ``/api/runs/RUN/media/NAME`` (thumbnails, screenshots, observation texts);
- ``/api/workspaces``, ``/api/snapshots`` (with memory, shared and private, in bytes:
  :mod:`bunshin_gym.explore.memory`; ``memory_survey`` says when it was counted),
  ``/api/workspaces/ID/screen.jpg`` (live, read-only).

Example:
    >>> app = create_app(runs_root="/var/lib/bunshin/train")
    >>> uvicorn.run(app, host="127.0.0.1", port=8765)
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from bunshin_gym.explore import live
from bunshin_gym.explore.marks import marks, web_marks
from bunshin_gym.explore.runs import Run, build_tree, discover

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
_MEDIA_NAME = re.compile(r"^[0-9a-f]{8,64}(-t)?\.(jpg|png|json)$")


class Runs:
    """The runs the page serves: one pinned run directory, or those under a root (looked for
    again when asked, so runs started later appear)."""

    def __init__(self, run: str | Path | None = None, root: str | Path | None = None):
        if run is None and root is None:
            raise ValueError("give a run directory or a root of run directories")
        self.pinned = Path(run) if run is not None else None
        if self.pinned is not None and not self.pinned.is_dir():
            raise ValueError(f"{self.pinned}: not a directory")
        self.root = Path(root) if root is not None else None
        self._runs: dict[str, Run] = {}
        self._lock = threading.Lock()

    def list(self) -> list[Run]:
        paths = [self.pinned] if self.pinned is not None else discover(self.root)
        with self._lock:
            out = []
            for p in paths:
                run = self._runs.get(p.name)
                if run is None or run.path != p:
                    run = self._runs[p.name] = Run(p)
                out.append(run)
            return out

    def warm(self) -> None:
        """Index the run the page opens first (the newest) in the background, now: the first
        look at a big run reads its whole step log."""
        first = self.list()[:1]
        if first:
            threading.Thread(target=first[0].refresh, name="explore-index", daemon=True).start()

    def get(self, name: str) -> Run:
        with self._lock:
            run = self._runs.get(name)
        if run is None:
            run = next((r for r in self.list() if r.name == name), None)
        if run is None:
            raise HTTPException(404, f"no run {name!r}")
        return run


def create_app(run: str | Path | None = None, runs_root: str | Path | None = None, *,
               live_workspaces: bool = True) -> FastAPI:
    """The explorer app for one run directory (``run``) or every run under ``runs_root``."""
    runs = Runs(run, runs_root)
    runs.warm()
    app = FastAPI(title="bunshin explore", docs_url=None, redoc_url=None)

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/api/runs")
    def list_runs() -> list[dict]:
        out = []
        for r in runs.list():
            out.append({"name": r.name, "path": str(r.path), "steps_log": r.steps_file.exists(),
                        "report": (r.path / "report.json").exists()})
        return out

    @app.get("/api/runs/{name}")
    def run_info(name: str) -> dict:
        return runs.get(name).info()

    @app.get("/api/runs/{name}/groups")
    def groups(name: str, offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500),
               epoch: str | None = None, task: str | None = None, min_reward: float | None = None,
               max_reward: float | None = None) -> dict:
        return runs.get(name).page(offset=offset, limit=limit, epoch=epoch or None, task=task or None,
                                   min_reward=min_reward, max_reward=max_reward)

    @app.get("/api/runs/{name}/groups/{gid}/tree")
    def tree(name: str, gid: str) -> dict:
        try:
            return build_tree(runs.get(name).group(gid))
        except KeyError as e:
            raise HTTPException(404, str(e.args[0])) from None

    @app.get("/api/runs/{name}/groups/{gid}/steps/{member}/{depth}")
    def step(name: str, gid: str, member: int, depth: int) -> dict:
        r = runs.get(name)
        try:
            s = r.step(gid, member, depth)
        except KeyError as e:
            raise HTTPException(404, str(e.args[0])) from None
        g = r.group(gid)
        out = dict(s, instruction=g.instruction, text=_obs_text(r, s.get("obs")))
        if "url" in out["text"]:  # the web env's observation: the action names an element of the
            # page it was chosen on, the observation before it (the member's previous step's)
            before = g.obs if depth == 0 else next(
                (p.get("obs") for p in g.steps if p["member"] == member and p["depth"] == depth - 1), None)
            shot = {k: before[k] for k in ("thumb", "shot", "size") if k in before} if isinstance(before, dict) else {}
            out["before"] = shot  # the screenshot the action was chosen on: its element box is there
            out["marks"] = web_marks(s.get("action"), _obs_text(r, before).get("accessibility_tree", ""),
                                     s.get("element_box"), shot.get("size"))
        else:
            out["marks"] = marks(s.get("action"))
        return out

    @app.get("/api/runs/{name}/curves")
    def curves(name: str) -> dict:
        return runs.get(name).curves()

    @app.get("/api/runs/{name}/media/{file}")
    def media(name: str, file: str) -> FileResponse:
        # named by content hash: never changes, so the browser may keep it
        return FileResponse(_media_path(runs.get(name), file), headers={"Cache-Control": "max-age=86400, immutable"})

    @app.get("/api/workspaces")
    async def workspaces() -> dict:
        if not live_workspaces:
            return {"workspaces": [], "disabled": True}
        rows = await run_in_threadpool(live.workspaces)
        return {"workspaces": rows, "memory_survey": live.survey_time()}

    @app.get("/api/snapshots")
    async def snapshots() -> dict:
        if not live_workspaces:
            return {"snapshots": [], "disabled": True}
        return {"snapshots": await run_in_threadpool(live.snapshots)}

    @app.get("/api/workspaces/{ws_id}/screen.jpg")
    async def screen(ws_id: str) -> Response:
        if not live_workspaces or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", ws_id):
            raise HTTPException(404, f"no workspace {ws_id!r}")
        try:
            data = await run_in_threadpool(live.screen_jpeg, ws_id)
        except LookupError as e:
            raise HTTPException(404, str(e)) from None
        except OSError as e:
            raise HTTPException(502, f"workspace {ws_id}: the screen could not be read: {e}") from None
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "no-store"})

    return app


def _obs_text(run: Run, obs: dict | None) -> dict:
    """An observation's text fields: whole, from its media file, or the tails kept inline."""
    obs = obs or {}
    full = obs.get("full")
    if full:
        try:
            return json.loads(_media_path(run, full.split("/", 1)[-1]).read_text())
        except (OSError, json.JSONDecodeError, HTTPException) as e:
            log.warning("run %s: observation text %s not readable: %s", run.name, full, e)
    return obs.get("text", {})


def _media_path(run: Run, file: str) -> Path:
    if not _MEDIA_NAME.match(file):
        raise HTTPException(404, f"no media file {file!r}")
    path = run.path / "media" / file
    if not path.is_file():
        raise HTTPException(404, f"run {run.name} has no media file {file!r}")
    return path


def serve(run: str | Path | None = None, runs_root: str | Path | None = None, *, host: str = "127.0.0.1",
          port: int = 8765) -> None:
    """Serve the explorer until interrupted."""
    import uvicorn

    app = create_app(run, runs_root)
    log.info("bunshin explore on http://%s:%d/", host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning")
