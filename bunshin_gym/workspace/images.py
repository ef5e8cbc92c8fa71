"""Workspace images: read-only btrfs subvolumes built from recipes.

A recipe is a TOML file (``bunshin_gym/workspace/recipes/base.toml``,
``envs/<env>/image.toml``, or any file in ``$BUNSHIN_RECIPES``)::

    name = "web"
    parent = "base"            # start from another image, or:
    suite = "bookworm"         #   debootstrap this suite ...
    variant = "minbase"        #   ... with this variant
    packages = ["chromium"]    # Debian packages
    pip = ["playwright==1.65"] # wheels downloaded on the host, installed offline
    files = { "/srv/app.py" = "app.py" }   # copied from beside the recipe
    run = ["useradd -m user"]  # shell commands run in the image (chroot)

An image is named ``<name>-<key>``, where the key hashes the recipe, the files it copies
and its parent's key: a changed recipe builds a new image, an unchanged one is reused.

Example:
    >>> from bunshin_gym.workspace.images import ImageStore
    >>> path = ImageStore().ensure("base")   # builds on first use, then instant
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bunshin_gym.config import Paths, colon_dirs, paths
from bunshin_gym.workspace import idmap, pool, records
from bunshin_gym.workspace.errors import SetupError, UnknownImage, WorkspaceError
from bunshin_gym.workspace.snapshots.store import Store

_log = logging.getLogger(__name__)

PACKAGE_RECIPES = Path(__file__).parent / "recipes"
REPO_ENVS = Path(__file__).resolve().parents[2] / "envs"
HOST_SH = Path(__file__).resolve().parents[2] / "scripts" / "lib" / "host.sh"


def debian_archive() -> str:
    """The Debian archive debootstrap fetches from: ``BUNSHIN_MIRROR``, else the one this
    host's apt uses for bookworm main (a local mirror or proxy on most clusters), read by the
    same shell function the set-up uses."""
    out = subprocess.run(["bash", "-c", f"source {shlex.quote(str(HOST_SH))}; debian_archive"],
                         capture_output=True, text=True).stdout.strip()
    if not out:
        raise SetupError("apt knows no Debian archive for bookworm main (apt-cache policy); "
                         "set BUNSHIN_MIRROR to a Debian mirror's URL")
    return out


@dataclass
class Recipe:
    name: str
    source: Path
    parent: str | None = None
    suite: str = "bookworm"
    variant: str = "minbase"
    packages: list[str] = field(default_factory=list)
    pip: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    run: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> Recipe:
        data = tomllib.loads(path.read_text())
        unknown = set(data) - {"name", "parent", "suite", "variant", "packages", "pip", "files", "run"}
        if unknown:
            raise WorkspaceError(f"recipe {path}: unknown keys {sorted(unknown)}")
        if "name" not in data:
            raise WorkspaceError(f"recipe {path}: no name")
        return cls(source=path, **data)

    def digest(self) -> str:
        h = hashlib.sha256(self.source.read_bytes())
        for rel in sorted(self.files.values()):
            h.update((self.source.parent / rel).read_bytes())
        return h.hexdigest()


def recipe_paths() -> dict[str, Path]:
    """All known recipes by image name: the package's, each env's image.toml, $BUNSHIN_RECIPES."""
    files = sorted(PACKAGE_RECIPES.glob("*.toml")) + sorted(REPO_ENVS.glob("*/image.toml"))
    for d in colon_dirs("BUNSHIN_RECIPES"):
        files += sorted(Path(d).glob("*.toml"))
    found: dict[str, Path] = {}
    for f in files:
        try:
            name = tomllib.loads(f.read_text()).get("name")
        except tomllib.TOMLDecodeError as e:
            raise WorkspaceError(f"recipe {f}: {e}") from e
        if name:
            found[name] = f
    return found


@contextlib.contextmanager
def build_lock(p: Paths, blocking: bool = True):
    """Held while an image builds, so ``gc`` never sweeps a build in progress."""
    with open(p.images / ".build.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


class ImageStore:
    """Builds, finds and lists images in the pool."""

    def __init__(self, p: Paths | None = None, log: Callable[[str], None] = _log.info):
        """``log`` reports a build's progress (``bunshin image build`` prints it)."""
        self.p = p or paths()
        self.log = log

    def recipe(self, name: str) -> Recipe:
        known = recipe_paths()
        if name not in known:
            raise UnknownImage(f"unknown image {name!r}; known images: {', '.join(sorted(known)) or 'none'}")
        return Recipe.load(known[name])

    def key(self, name: str) -> str:
        r = self.recipe(name)
        h = hashlib.sha256(r.digest().encode())
        if r.parent:
            h.update(self.key(r.parent).encode())
        return h.hexdigest()[:12]

    def path(self, name: str) -> Path:
        return self.p.images / f"{name}-{self.key(name)}"

    def exists(self, name: str) -> bool:
        return (self.path(name).with_suffix(".json")).exists()

    def get(self, name: str) -> Path:
        """The path of a built image; raises if it is unknown or not built yet."""
        path = self.path(name)
        if not path.with_suffix(".json").exists():
            raise UnknownImage(f"image {name!r} is not built yet; run: bunshin image build {name}")
        return path

    def ensure(self, name: str) -> Path:
        """Build the image (and its parents) unless an image of the same recipe exists."""
        pool.require_pool(self.p)
        r = self.recipe(name)
        if r.parent:
            self.ensure(r.parent)
        with build_lock(self.p):
            if self.exists(name):
                return self.path(name)
            return self._build(r)

    def list(self) -> list[dict]:
        out = []
        for meta in sorted(self.p.images.glob("*.json")):
            info = json.loads(meta.read_text())
            info["current"] = info["name"] in recipe_paths() and self.path(info["name"]) == meta.with_suffix("")
            out.append(info)
        return out

    def prune(self) -> list[str]:
        """Delete built images that are no longer current (their recipe changed or is gone)
        and that no workspace or snapshot uses; images in use are never touched."""
        used = {r.image_path for r in records.all_records(self.p)}
        used |= {s.metadata.image_path for s in Store(self.p).list()}
        known = recipe_paths()
        removed = []
        with build_lock(self.p):
            for meta in sorted(self.p.images.glob("*.json")):
                path = meta.with_suffix("")
                name = json.loads(meta.read_text())["name"]
                current = name in known and self.path(name) == path
                if current or str(path) in used:
                    continue
                for shifted in idmap.shifted_copies(path):  # its user-namespace copies go with it
                    if shifted.is_dir():
                        pool.delete_subvolume(shifted)
                    else:
                        shifted.unlink(missing_ok=True)
                pool.delete_subvolume(path)
                meta.unlink()
                removed.append(path.name)
        return removed

    # building ------------------------------------------------------------------------
    def _build(self, r: Recipe) -> Path:
        final = self.path(r.name)
        tmp = final.with_name(".build-" + final.name)
        pool.delete_subvolume(tmp)
        t0 = time.monotonic()
        self.log(f"[image {r.name}] building {final.name} from {r.source}")
        try:
            if r.parent:
                pool.snapshot_subvolume(self.get(r.parent), tmp)
                pool.set_readonly(tmp, False)
                if r.packages:
                    self._chroot(r.name, tmp, "apt-get update -q && DEBIAN_FRONTEND=noninteractive "
                                 "apt-get install -y -q --no-install-recommends " + shlex.join(r.packages))
            else:
                pool.create_subvolume(tmp)
                self._debootstrap(r, tmp)
            if r.pip:
                self._pip(r, tmp)
            for dst, rel in r.files.items():
                target = tmp / dst.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(r.source.parent / rel, target)
            for cmd in r.run:
                self._chroot(r.name, tmp, cmd)
            self._chroot(r.name, tmp, "apt-get clean; rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin")
            os.rename(tmp, final)
            pool.set_readonly(final)
        except BaseException:
            pool.delete_subvolume(tmp)
            raise
        meta = {"name": r.name, "key": final.name.rsplit("-", 1)[1], "recipe": str(r.source),
                "parent": r.parent, "built": time.time(), "build_seconds": round(time.monotonic() - t0, 1)}
        final.with_suffix(".json").write_text(json.dumps(meta, indent=1))
        self.log(f"[image {r.name}] ready in {meta['build_seconds']} s: {final}")
        return final

    def _stream(self, name: str, argv: list[str]) -> None:
        """Run a long build step, echoing its progress lines."""
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-30:]
            if line.startswith(("I: Retrieving", "I: Validating", "I: Configuring", "I: Unpacking",
                                "I: Extracting", "W:", "E:")) or "Setting up" in line:
                continue  # too chatty; counted below instead
            if line.startswith(("I: ", "Get:", "Unpacking", "Collecting", "Successfully")):
                self.log(f"[image {name}]   {line[:100]}")
        if proc.wait() != 0:
            raise WorkspaceError(f"image {name}: {argv[0]} failed:\n" + "\n".join(tail))

    def _debootstrap(self, r: Recipe, target: Path) -> None:
        if shutil.which("debootstrap") is None:
            raise SetupError("debootstrap is missing; run: scripts/setup.sh")
        cache = self.p.cache / "debootstrap"
        cache.mkdir(parents=True, exist_ok=True)
        self.log(f"[image {r.name}] debootstrap {r.variant} {r.suite} with {len(r.packages)} extra packages")
        self._stream(r.name, ["debootstrap", f"--variant={r.variant}", f"--cache-dir={cache}",
                              "--include=" + ",".join(r.packages), r.suite, str(target), debian_archive()])

    def _pip(self, r: Recipe, target: Path) -> None:
        wheels = self.p.cache / "wheels" / hashlib.sha256(" ".join(r.pip).encode()).hexdigest()[:12]
        if not wheels.exists():
            self.log(f"[image {r.name}] downloading wheels on the host: {' '.join(r.pip)}")
            tmp = wheels.with_name(wheels.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self._stream(r.name, [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                                  "--python-version", "3.11", "--platform", "manylinux_2_36_x86_64",
                                  "--platform", "manylinux2014_x86_64", "--platform", "any",
                                  "-d", str(tmp), *r.pip])
            tmp.rename(wheels)
        shutil.copytree(wheels, target / "var" / "tmp" / "wheels", dirs_exist_ok=True)
        self._chroot(r.name, target, "python3 -m pip install -q --no-index --find-links /var/tmp/wheels "
                     "--break-system-packages " + shlex.join(r.pip) + " && rm -rf /var/tmp/wheels")

    def _chroot(self, name: str, root: Path, cmd: str) -> None:
        """Run a shell command in the image, in a private mount namespace (nothing leaks)."""
        shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")
        script = (f"mount -t proc proc {root}/proc && mount --rbind /dev {root}/dev && "
                  f"mount -t tmpfs tmpfs {root}/tmp && exec chroot {root} /bin/sh -ec {shlex.quote(cmd)}")
        self.log(f"[image {name}] $ {cmd[:100]}")
        self._stream(name, ["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c", script])
