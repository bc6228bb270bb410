"""specserve.engine.models: loading local models, reporting their facts, refusing mismatched pairs."""

from __future__ import annotations

import dataclasses

import pytest
import tiny_models
import torch

from specserve.api.errors import FailedPrecondition, InvalidArgument, VocabularyMismatch
from specserve.engine.models import (
    ModelInfo,
    check_same_vocabulary,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    vocab_fingerprint,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"pair_{request.param}")
    return tiny_models.make_tiny_pair(root, arch=request.param, seed=3)


def test_load_model_reports_its_facts(pair):
    target_dir, draft_dir = pair
    target = load_model(target_dir, warmup=True)
    draft = load_model(draft_dir)
    assert target.device == torch.device("cpu")  # auto: no CUDA here
    assert target.dtype == torch.float32  # auto on CPU
    assert next(target.model.parameters()).dtype == torch.float32
    assert target.vocab_size == draft.vocab_size == 384
    assert target.eos_token_id == 0
    assert target.parameter_count == sum(p.numel() for p in target.model.parameters())
    assert target.parameter_count > draft.parameter_count
    assert len(target.vocab_fingerprint) == 64
    assert target.vocab_fingerprint == draft.vocab_fingerprint
    assert target.name == str(target_dir)
    assert not target.model.training


def test_model_info_round_trips_through_protobuf(pair):
    info = load_model(pair[1]).info
    pb = info.to_pb()
    assert pb.vocab_size == 384 and pb.dtype == "float32" and pb.device == "cpu"
    assert pb.HasField("eos_token_id") and pb.eos_token_id == 0
    assert ModelInfo.from_pb(pb) == info
    no_eos = dataclasses.replace(info, eos_token_id=None)
    assert not no_eos.to_pb().HasField("eos_token_id")
    assert ModelInfo.from_pb(no_eos.to_pb()) == no_eos


def test_explicit_dtype_is_honoured(pair):
    loaded = load_model(pair[1], device="cpu", dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.info.dtype == "bfloat16"


def test_fingerprint_depends_on_the_token_table(tmp_path):
    a = tiny_models.make_tiny_tokenizer(tmp_path / "a")
    a_again = tiny_models.make_tiny_tokenizer(tmp_path / "a2")
    b = tiny_models.make_tiny_tokenizer(tmp_path / "b", corpus=[s[::-1] for s in tiny_models.CORPUS])
    assert vocab_fingerprint(a) == vocab_fingerprint(a_again)
    assert vocab_fingerprint(a) != vocab_fingerprint(b)


def test_matching_pair_is_accepted(pair):
    target_dir, draft_dir = pair
    check_same_vocabulary(load_model(draft_dir), load_model(target_dir))
    check_same_vocabulary(load_model(draft_dir).info, ModelInfo.from_pb(load_model(target_dir).to_pb()))


def test_vocabulary_size_mismatch_is_refused(tmp_path):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path / "big", vocab_size=384)
    _, draft_dir = tiny_models.make_tiny_pair(tmp_path / "small", vocab_size=320)
    with pytest.raises(VocabularyMismatch, match=r"320 tokens.*384"):
        check_same_vocabulary(load_model(draft_dir), load_model(target_dir))


def test_token_table_mismatch_is_refused(tmp_path):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path / "pair", vocab_size=384)
    other = tmp_path / "other_draft"
    tiny_models.make_tiny_tokenizer(other, 384, corpus=[s[::-1] for s in tiny_models.CORPUS])
    tiny_models.make_tiny_model(other, vocab_size=384, seed=9)
    draft, target = load_model(other), load_model(target_dir)
    assert draft.vocab_size == target.vocab_size == 384
    with pytest.raises(VocabularyMismatch, match="different token tables"):
        check_same_vocabulary(draft, target)


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FailedPrecondition, match="neither a registered name"):
        resolve_model_path(tmp_path / "nope", "draft")
    assert resolve_model_path(tmp_path, "draft") == str(tmp_path)
    with pytest.raises(FailedPrecondition, match=r"no config\.json"):
        load_model(tmp_path)
    with pytest.raises(FailedPrecondition, match="does not exist"):
        load_model(tmp_path / "nope")


def test_default_is_the_registered_default_pair(tmp_path, monkeypatch):
    """No model named: the target is the fetched SmolLM2 (from the cache), the draft the bundled one."""
    from specserve.engine import model_registry

    cached = tmp_path / model_registry.DEFAULT_TARGET
    cached.mkdir()
    for name in ("config.json", "model.safetensors"):
        (cached / name).write_text("{}")
    model_registry._write_manifest(cached, source="test", sha256="0")
    monkeypatch.setenv("SPECSERVE_MODEL_CACHE", str(tmp_path))
    assert resolve_model_path(None, "target") == str(cached)
    bundled = tmp_path / "package_models"
    (bundled / model_registry.DEFAULT_DRAFT).mkdir(parents=True)
    (bundled / model_registry.DEFAULT_DRAFT / "config.json").write_text("{}")
    monkeypatch.setattr(model_registry, "PACKAGE_MODELS_DIR", bundled)
    monkeypatch.setattr(model_registry, "REPO_MODELS_DIR", tmp_path / "no_checkout")
    assert resolve_model_path(None, "draft") == str(bundled / model_registry.DEFAULT_DRAFT)
    with pytest.raises(FailedPrecondition, match=r"specserve-demo-draft.*missing"):
        resolve_model_path("specserve-demo-draft", "draft")


def test_device_and_dtype_resolution():
    cpu = torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda:0")) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(InvalidArgument, match="dtype must be"):
        resolve_dtype("float8", cpu)
    if not torch.cuda.is_available():
        with pytest.raises(FailedPrecondition, match="CUDA is not available"):
            resolve_device("cuda")
