"""One kernel path per kind of machine, recorded in the deployment's Redis (specserve/engine/kernel_choice.py).

A real redis-server, real tiny models. The first replica of a kind times both paths and records the winner;
a later replica of the kind runs the record without timing; two replicas that measure at once both end on
the first record; a replica without a Redis times alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import redis
import tiny_models

from specserve.draft.kernel_timing import drafting_kernels
from specserve.engine import cpu_kernels, kernel_choice
from specserve.engine.models import load_model
from specserve.runtime.config import DraftSettings

pytestmark = pytest.mark.system

KIND = kernel_choice.HardwareKind("Test CPU", ("avx2",), "2.13", 2, '{"hidden_size": 8}', "float32", "target")


@pytest.fixture
def url(redis_url):
    yield redis_url
    kernel_choice.forget(redis_url)


def _measure(path: str, calls: list[int]):
    def measure():
        calls.append(1)
        return path, {"stock": 2.0 if path == "onednn" else 1.0, "onednn": 1.0 if path == "onednn" else 2.0}

    return measure


def test_the_first_replica_records_and_the_next_runs_the_record_without_timing(url):
    calls: list[int] = []
    first = kernel_choice.shared_choice(url, KIND, _measure("onednn", calls))
    assert first.kernels == "onednn" and first.shared and calls == [1]
    second = kernel_choice.shared_choice(url, KIND, _measure("stock", calls))
    assert second.kernels == "onednn" and calls == [1]  # not timed again, and not its own opinion
    assert second.measured_by == first.measured_by


def test_a_replica_that_loses_the_race_runs_the_first_record(url):
    # Another replica recorded while this one was timing: SET NX fails, and this one takes the record.
    def measure():
        other = kernel_choice.Choice("stock", {"stock": 1.0}, "other:1", 0.0, shared=True)
        redis.Redis.from_url(url).set(KIND.key(), other.to_json())
        return "onednn", {"onednn": 0.5, "stock": 1.0}

    assert kernel_choice.shared_choice(url, KIND, measure).kernels == "stock"


def test_each_kind_has_its_own_record(url):
    calls: list[int] = []
    kernel_choice.shared_choice(url, KIND, _measure("onednn", calls))
    other = dataclasses.replace(KIND, cpu="Another CPU")
    assert other.key() != KIND.key()
    assert kernel_choice.shared_choice(url, other, _measure("stock", calls)).kernels == "stock"
    assert len(calls) == 2
    assert dataclasses.replace(KIND, threads=1).key() != KIND.key()  # the thread count is part of the kind


def test_without_a_redis_the_path_is_timed_here_alone():
    calls: list[int] = []
    choice = kernel_choice.shared_choice(None, KIND, _measure("stock", calls))
    assert choice.kernels == "stock" and not choice.shared and calls == [1]
    unreachable = kernel_choice.shared_choice("redis://127.0.0.1:1/0", KIND, _measure("onednn", calls))
    assert unreachable.kernels == "onednn" and not unreachable.shared and len(calls) == 2


def test_a_record_that_names_no_path_is_measured_again(url):
    redis.Redis.from_url(url).set(KIND.key(), '{"kernels": "fast"}')
    calls: list[int] = []
    assert kernel_choice.shared_choice(url, KIND, _measure("stock", calls)).kernels == "stock"
    assert calls == [1]


def test_forget_makes_the_next_replica_measure_again(url):
    calls: list[int] = []
    kernel_choice.shared_choice(url, KIND, _measure("onednn", calls))
    assert kernel_choice.forget(url) == 1
    kernel_choice.shared_choice(url, KIND, _measure("stock", calls))
    assert calls == [1, 1]


def test_the_cpu_kind_names_this_machine():
    name, flags = kernel_choice.cpu_model_and_flags()
    assert name and all(f in kernel_choice.KERNEL_FLAGS for f in flags)


@pytest.mark.skipif(not cpu_kernels.onednn_available(), reason="this PyTorch has no oneDNN")
@pytest.mark.parametrize("recorded", ["stock", "onednn"])
def test_a_target_loading_with_auto_runs_the_recorded_path(tmp_path, url, recorded):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path)
    probe = load_model(target_dir, device="cpu", dtype="float32")
    kind = kernel_choice.hardware_kind(probe.model, "target")
    redis.Redis.from_url(url).set(kind.key(), kernel_choice.Choice(recorded, {}, "peer:1", 0.0, True).to_json())
    loaded = load_model(target_dir, device="cpu", dtype="float32", kernels="auto", kernel_store=url)
    assert cpu_kernels.path_of(loaded.model) == recorded


@pytest.mark.skipif(not cpu_kernels.onednn_available(), reason="this PyTorch has no oneDNN")
def test_a_target_that_finds_no_record_times_both_and_records_its_choice(tmp_path, url):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path)
    loaded = load_model(target_dir, device="cpu", dtype="float32", kernels="auto", kernel_store=url)
    kind = kernel_choice.hardware_kind(loaded.model, "target")
    held = kernel_choice.Choice.from_json(redis.Redis.from_url(url).get(kind.key()))
    assert held.kernels == cpu_kernels.path_of(loaded.model)
    assert set(held.timings_ms) == {"stock", "onednn"}


@pytest.mark.skipif(not cpu_kernels.onednn_available(), reason="this PyTorch has no oneDNN")
@pytest.mark.parametrize("recorded", ["stock", "onednn"])
def test_the_draft_runs_its_recorded_path(tmp_path, url, recorded):
    _, draft_dir = tiny_models.make_tiny_pair(tmp_path)
    draft = load_model(draft_dir, device="cpu", dtype="float32")
    kind = kernel_choice.hardware_kind(draft.model, "draft")
    redis.Redis.from_url(url).set(kind.key(), kernel_choice.Choice(recorded, {}, "peer:1", 0.0, True).to_json())
    settings = DraftSettings(host="127.0.0.1", redis_url=url, model=str(draft_dir))
    assert drafting_kernels(settings, draft) == recorded
    assert drafting_kernels(settings.model_copy(update={"kernels": "stock"}), draft) == "stock"  # named: as named


@pytest.mark.skipif(not cpu_kernels.onednn_available(), reason="this PyTorch has no oneDNN")
def test_a_draft_that_finds_no_record_times_its_drafting_step_on_both_paths(tmp_path, url):
    _, draft_dir = tiny_models.make_tiny_pair(tmp_path)
    draft = load_model(draft_dir, device="cpu", dtype="float32")
    settings = DraftSettings(host="127.0.0.1", redis_url=url, model=str(draft_dir))
    path = drafting_kernels(settings, draft)
    held = kernel_choice.Choice.from_json(
        redis.Redis.from_url(url).get(kernel_choice.hardware_kind(draft.model, "draft").key())
    )
    assert held.kernels == path and set(held.timings_ms) == {"stock", "onednn"}
