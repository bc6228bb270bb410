"""OpenAI reply bodies from session events: chunks, finish reasons, usage, the speculation report,
and the stop string left out of the text (no servers)."""

from __future__ import annotations

import pytest

from specserve.api.params import PositionLogprobs, TokenLogprob
from specserve.api.stats import GenerationStats, SourceStats
from specserve.coordinator.coordinator import Chunk, Finished
from specserve.coordinator.openai_protocol import ReplyOptions
from specserve.coordinator.openai_replies import (
    ReplyBuilder,
    StopTrimmer,
    TokenStrings,
    finish_reason,
    speculation_report,
    usage,
)

pytestmark = pytest.mark.unit

STOP_STRING = "stop_string"


def stats(**kw) -> GenerationStats:
    base = dict(
        session_id="s",
        prompt_tokens=5,
        completion_tokens=4,
        rounds=0,
        proposed_tokens=0,
        accepted_tokens=0,
        accepted_per_position=(),
        draft_ns=0,
        verify_ns=0,
        queue_ns=0,
        first_token_ns=0,
        total_ns=0,
        finish_reason="length",
        seed=0,
    )
    return GenerationStats(**{**base, **kw})


@pytest.mark.parametrize(
    ("deltas", "stops", "want"),
    [
        (["ab", "c\n", "\n"], ["\n\n"], "abc"),  # the stop string straddles two deltas
        (["hello END"], ["END"], "hello "),
        (["a", "b", "c", "ST", "OP"], ["STOP", "zz"], "abc"),
        (["xSTOP"], ["OP", "STOP"], "x"),  # both end the text: the longer is the stop string
    ],
)
def test_the_stop_string_is_cut_off_and_never_streamed(deltas, stops, want):
    trimmer = StopTrimmer(stops)
    streamed = "".join(trimmer.push(d) for d in deltas)
    assert want.startswith(streamed), "nothing of the stop string may be sent before the end"
    assert streamed + trimmer.finish(stats(finish_reason=STOP_STRING)) == want


def test_text_that_did_not_stop_on_a_string_is_kept_whole():
    trimmer = StopTrimmer(["END"])
    streamed = trimmer.push("and then E") + trimmer.push("N")
    assert streamed == "and then"
    assert streamed + trimmer.finish(stats()) == "and then EN"
    plain = StopTrimmer([])
    assert plain.push("abc") == "abc" and plain.finish(stats(finish_reason=STOP_STRING)) == ""


def test_finish_reasons_map_to_stop_and_length():
    for reason in ("eos", "stop_token", STOP_STRING):
        assert finish_reason(stats(finish_reason=reason)) == "stop"
    assert finish_reason(stats()) == "length"


def test_usage_counts_the_prompt_once_and_every_completion():
    got = usage([stats(completion_tokens=4, cached_tokens=3), stats(completion_tokens=6, cached_tokens=2)])
    assert got == {
        "prompt_tokens": 5,
        "completion_tokens": 10,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 2},  # the prompt tokens no choice prefilled
        "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }


def test_usage_sums_the_prediction_counts_of_every_choice():
    got = usage(
        [
            stats(accepted_prediction_tokens=3, rejected_prediction_tokens=1),
            stats(accepted_prediction_tokens=2, rejected_prediction_tokens=4),
        ]
    )
    assert got["completion_tokens_details"] == {"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 5}


def test_speculation_report_sums_sessions_like_vllm_metrics():
    a = stats(rounds=5, draft_rounds=4, proposed_tokens=10, accepted_tokens=6, accepted_per_position=(4, 2))
    b = stats(rounds=3, draft_rounds=2, proposed_tokens=6, accepted_tokens=5, accepted_per_position=(2, 2, 1))
    report = speculation_report([a, b])
    assert report["num_drafts"] == 6 and report["rounds"] == 8
    assert report["num_draft_tokens"] == 16 and report["num_accepted_tokens"] == 11
    assert report["num_accepted_tokens_per_pos"] == [6, 4, 1]
    assert report["acceptance_rate"] == pytest.approx(11 / 16)
    assert report["mean_acceptance_length"] == pytest.approx(1 + 11 / 6)
    none = speculation_report([stats(rounds=4)])
    assert none["num_drafts"] == 0 and none["acceptance_rate"] == 0.0 and none["mean_acceptance_length"] == 1.0
    assert none["sources"] == {}


def test_speculation_report_sums_each_source_over_the_choices():
    row = SourceStats
    a = stats(sources=(row(name="ngram", draft_rounds=2, proposed_tokens=5, accepted_tokens=4), row(name="model")))
    b = stats(sources=(row(name="ngram", draft_rounds=1, proposed_tokens=3, accepted_tokens=1),))
    assert speculation_report([a, b])["sources"] == {
        "ngram": {"num_drafts": 3, "num_draft_tokens": 8, "num_accepted_tokens": 5},
        "model": {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0},
    }


def test_chat_stream_chunks_then_the_usage_chunk():
    b = ReplyBuilder("chat", model="m", n=2, options=ReplyOptions(include_usage=True))
    out = b.on_event(1, Chunk((7, 8), "he"))
    assert [c["choices"][0]["delta"] for c in out] == [{"role": "assistant", "content": ""}, {"content": "he"}]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in out)
    out = b.on_event(0, Finished(stats(completion_tokens=0, finish_reason="eos")))
    assert out[0]["choices"][0]["delta"]["role"] == "assistant"
    assert out[-1]["choices"][0]["finish_reason"] == "stop" and out[-1]["choices"][0]["delta"] == {}
    assert not b.finished
    out = b.on_event(1, Finished(stats(completion_tokens=2)))
    assert out[-1]["choices"][0]["finish_reason"] == "length" and "speculation" in out[-1]["choices"][0]
    assert b.finished
    last = b.usage_chunk()
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    assert {c["id"] for c in out} == {last["id"]} and last["id"].startswith("chatcmpl-")


def test_continuous_usage_puts_the_running_usage_in_every_chunk():
    options = ReplyOptions(include_usage=True, continuous_usage=True)
    b = ReplyBuilder("chat", model="m", n=2, options=options, prompt_tokens=5)
    first = b.on_event(0, Chunk((7, 8), "he"))
    second = b.on_event(1, Chunk((9,), "y"))
    done = b.on_event(0, Finished(stats(completion_tokens=2)))
    counts = [c["usage"]["completion_tokens"] for c in first + second + done]
    assert counts == [0, 2, 2, 3, 3]  # each choice's role chunk, then its text: the usage after each chunk
    assert all(c["usage"]["prompt_tokens"] == 5 for c in first + second + done)
    assert all(c["usage"]["total_tokens"] == 5 + c["usage"]["completion_tokens"] for c in first + second + done)


def test_trimming_nothing_keeps_the_stop_string():
    b = ReplyBuilder("completion", model="m", n=1, options=ReplyOptions(trim_stop_strings=()))
    b.on_event(0, Chunk((1,), "x = 1\n\n"))
    b.on_event(0, Finished(stats(completion_tokens=1, finish_reason=STOP_STRING)))
    assert b.reply()["choices"][0]["text"] == "x = 1\n\n"


def test_non_streamed_completion_reply():
    b = ReplyBuilder("completion", model="m", n=1, options=ReplyOptions(trim_stop_strings=("\n\n",)))
    chunks = b.on_event(0, Chunk((1,), "x = 1\n"))
    chunks += b.on_event(0, Chunk((2,), "\n"))
    chunks += b.on_event(0, Finished(stats(completion_tokens=2, finish_reason=STOP_STRING)))
    reply = b.reply()
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
    assert reply["choices"] == [
        {
            "index": 0,
            "text": "x = 1",
            "logprobs": None,
            "finish_reason": "stop",
            "speculation": speculation_report([stats(completion_tokens=2, finish_reason=STOP_STRING)]),
        }
    ]
    assert reply["usage"]["total_tokens"] == 7
    assert chunks and all("usage" not in c for c in chunks), "no include_usage: the chunks carry no usage"


class WordTokenizer:
    """A stand-in tokenizer, named as such: token ``i`` is the word ``w<i>`` (no byte-level decoder)."""

    def decode(self, ids):
        return "".join(f"w{i}" for i in ids)


def entry(token: int, logprob: float, *top: tuple[int, float]) -> PositionLogprobs:
    return PositionLogprobs(token, logprob, tuple(TokenLogprob(t, v) for t, v in top))


def test_chat_logprobs_go_out_with_their_chunk_even_when_its_text_is_held_back():
    b = ReplyBuilder(
        "chat", model="m", n=1, options=ReplyOptions(trim_stop_strings=("STOP",)), token_strings=TokenStrings(WordTokenizer()))
    out = b.on_event(0, Chunk((1,), "ab", (entry(1, -0.5, (1, -0.5), (2, -1.5)),)))
    sent = out[-1]["choices"][0]
    assert sent["delta"] == {"content": ""}, "the text waits: it might begin the stop string"
    assert sent["logprobs"] == {
        "content": [
            {
                "token": "w1",
                "logprob": -0.5,
                "bytes": list(b"w1"),
                "top_logprobs": [
                    {"token": "w1", "logprob": -0.5, "bytes": list(b"w1")},
                    {"token": "w2", "logprob": -1.5, "bytes": list(b"w2")},
                ],
            }
        ],
        "refusal": None,
    }
    b.on_event(0, Chunk((3,), "cdef", (entry(3, -0.25),)))
    b.on_event(0, Finished(stats(completion_tokens=2)))
    (choice,) = b.reply()["choices"]
    assert choice["message"]["content"] == "abcdef"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["w1", "w3"]


def test_completion_logprobs_count_offsets_across_chunks():
    b = ReplyBuilder("completion", model="m", n=1, token_strings=TokenStrings(WordTokenizer()))
    first = b.on_event(0, Chunk((1, 22), "w1w22", (entry(1, -1.0, (1, -1.0)), entry(22, -2.0, (5, -0.1)))))
    second = b.on_event(0, Chunk((3,), "w3", (entry(3, -3.0, (3, -3.0)),)))
    assert first[-1]["choices"][0]["logprobs"] == {
        "tokens": ["w1", "w22"],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"w1": -1.0}, {"w5": -0.1}],
        "text_offset": [0, 2],
    }
    assert second[-1]["choices"][0]["logprobs"]["text_offset"] == [5]
    b.on_event(0, Finished(stats(completion_tokens=3)))
    assert b.reply()["choices"][0]["logprobs"]["text_offset"] == [0, 2, 5]
    plain = ReplyBuilder("completion", model="m", n=1)
    assert plain.on_event(0, Chunk((1,), "x", (entry(1, -1.0),)))[-1]["choices"][0]["logprobs"] is None


def test_a_byte_level_tokens_bytes_are_its_own_even_inside_a_character(tmp_path):
    """Byte-level BPE: a token holding half of a UTF-8 character gets its own raw bytes (its text shows the
    replacement character); the tokens' bytes concatenate to the text's UTF-8."""
    import tiny_models

    tokenizer = tiny_models.make_tiny_tokenizer(tmp_path)
    strings = TokenStrings(tokenizer)
    text = "def é(x): ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [strings(t) for t in ids]
    assert b"".join(bytes(raw) for _, raw in pieces) == text.encode("utf-8")
    assert any("\ufffd" in piece for piece, _ in pieces), "the test needs a token that splits a character"
