"""Chat prompts: the target tokenizer's chat template, exactly as Hugging Face applies it."""

from __future__ import annotations

import pytest
import tiny_models

from specserve.api.errors import FailedPrecondition, InvalidArgument
from specserve.api.params import GenerationParams
from specserve.coordinator.chat import ChatMessage, Conversation, TemplateOptions, chat_prompt_ids
from specserve.coordinator.requests import GenerationRequest, Prompt
from specserve.runtime.config import CoordinatorSettings

pytestmark = pytest.mark.unit

CONVERSATION = (
    ChatMessage("system", "you write python"),
    ChatMessage("user", "def add(a, b):"),
    ChatMessage("assistant", "return a + b"),
    ChatMessage("user", "and sub?"),
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_models.make_tiny_tokenizer(tmp_path_factory.mktemp("chat-tok"))


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    return tiny_models.make_tiny_tokenizer(tmp_path_factory.mktemp("plain-tok"), chat_template=None)


def _chat(messages) -> Prompt:
    return Prompt(chat=Conversation(messages=tuple((m.role, m.content) for m in messages)))


def test_prompt_ids_equal_hugging_face_apply_chat_template(tokenizer):
    ids = chat_prompt_ids(tokenizer, CONVERSATION)
    conversation = [{"role": m.role, "content": m.content} for m in CONVERSATION]
    want = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert list(ids) == list(want["input_ids"])
    text = tokenizer.decode(list(ids))
    assert text.startswith("system: you write python\n") and text.endswith("user: and sub?\nassistant:")


def test_a_tokenizer_without_a_chat_template_is_refused_saying_what_to_do(plain_tokenizer):
    with pytest.raises(FailedPrecondition, match="no chat template") as info:
        chat_prompt_ids(plain_tokenizer, CONVERSATION)
    assert "plain text prompt" in info.value.message


def test_an_empty_conversation_and_a_message_without_role_are_invalid(tokenizer):
    with pytest.raises(InvalidArgument, match="conversation is empty"):
        chat_prompt_ids(tokenizer, ())
    with pytest.raises(InvalidArgument, match="needs a role"):
        ChatMessage("", "hi")


def test_a_template_that_raises_becomes_invalid_argument(tmp_path):
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}"
        "{{ raise_exception('the first message must not be the assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    tok = tiny_models.make_tiny_tokenizer(tmp_path, chat_template=template)
    with pytest.raises(InvalidArgument, match="the first message must not be the assistant"):
        chat_prompt_ids(tok, [ChatMessage("assistant", "hi")])


async def _parse(prompt, tokenizer, settings):
    async def tokenize(text):
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    async def render_chat(messages, options):
        return chat_prompt_ids(tokenizer, messages, options)

    return await GenerationRequest.check(
        GenerationParams(),
        prompt,
        settings=settings,
        tokenize=tokenize,
        render_chat=render_chat,
        vocab_size=384,
        max_gamma=8,
    )


async def test_generation_request_renders_chat_and_applies_the_prompt_limits(tokenizer, plain_tokenizer):
    settings = CoordinatorSettings(host="127.0.0.1", max_prompt_tokens=100, max_prompt_bytes=2000)
    parsed = await _parse(_chat(CONVERSATION), tokenizer, settings)
    assert parsed.prompt_token_ids == chat_prompt_ids(tokenizer, CONVERSATION)
    long = [ChatMessage("user", "the quick brown fox " * 40)]
    with pytest.raises(InvalidArgument, match="limit of 100"):
        await _parse(_chat(long), tokenizer, settings)
    huge = [ChatMessage("user", "x" * 2001)]  # refused by its bytes, before the template runs
    with pytest.raises(InvalidArgument, match="conversation is 2005 bytes"):
        await _parse(_chat(huge), plain_tokenizer, settings)
    with pytest.raises(InvalidArgument, match="conversation is empty"):
        await _parse(_chat([]), tokenizer, settings)
    with pytest.raises(FailedPrecondition, match="no chat template"):
        await _parse(_chat(CONVERSATION), plain_tokenizer, settings)


def test_template_options_of_a_conversation_and_their_refusals():
    conversation = Conversation(continue_final_message=True, template_kwargs_json='{"greeting": "hi"}')
    options = TemplateOptions.of(conversation)
    assert options == TemplateOptions(add_generation_prompt=False, continue_final_message=True, variables={"greeting": "hi"})
    assert TemplateOptions.of(Conversation(omit_generation_prompt=True)).add_generation_prompt is False
    hostile = (
        ('{"a": ' * 5000 + "1" + "}" * 5000, "template_kwargs_json nests arrays and objects more than 64 levels"),
        ('{"a": 1, "a": 2}', "the key 'a' appears twice"),
        ('{"a": 1e999}', "out of range"),
    )
    for bad, message in (("{", "not valid JSON"), ("[1]", "must be a JSON object"), ('{"tokenize": 1}', "'tokenize'"), *hostile):
        with pytest.raises(InvalidArgument, match=message):
            TemplateOptions.of(Conversation(template_kwargs_json=bad))
    with pytest.raises(InvalidArgument, match="leave add_generation_prompt off"):
        TemplateOptions(continue_final_message=True)


def test_continue_final_message_leaves_the_last_message_open(tokenizer):
    prefilled = [ChatMessage("user", "add two numbers"), ChatMessage("assistant", "def add")]
    ids = chat_prompt_ids(tokenizer, prefilled, TemplateOptions(add_generation_prompt=False, continue_final_message=True))
    assert tokenizer.decode(ids).endswith("assistant: def add")
