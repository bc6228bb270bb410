"""Chat prompts: a conversation rendered with the target tokenizer's chat template.

The coordinator turns :class:`ChatMessage` objects into prompt token ids the
way Hugging Face does for ``generate()``: ``apply_chat_template(messages,
add_generation_prompt=True)`` renders the conversation and opens the
assistant's turn, and the text is tokenized without adding special tokens (the
template writes the ones it wants). The result equals
``tokenizer.apply_chat_template(..., tokenize=True)``. :class:`TemplateOptions`
can leave the assistant's turn closed, or leave the final message open so that
the completion continues it (``continue_final_message``, Hugging Face's own),
and give the template extra variables (``enable_thinking`` and the like).

A tokenizer without a chat template cannot do this: :func:`chat_prompt_ids`
raises :class:`~specserve.api.errors.FailedPrecondition` saying so. A template
that refuses the conversation (many raise on roles that do not alternate) is
:class:`~specserve.api.errors.InvalidArgument` with the template's own message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specserve.api.errors import FailedPrecondition, InvalidArgument
from specserve.coordinator.json_body import read_json


@dataclass(frozen=True)
class ChatMessage:
    """One message of a conversation: who wrote it and what it says."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if not self.role:
            raise InvalidArgument("every chat message needs a role (e.g. 'system', 'user', 'assistant')")


@dataclass(frozen=True)
class Conversation:
    """A chat prompt as a front end received it, not yet checked (``GenerateRequest.chat`` and the OpenAI
    chat body both become one): its messages as (role, content) pairs, whether to leave the assistant's turn
    closed or the final message open, and the template's extra variables as a JSON object's text."""

    messages: tuple[tuple[str, str], ...] = ()
    omit_generation_prompt: bool = False
    continue_final_message: bool = False
    template_kwargs_json: str = ""

    @property
    def size(self) -> int:
        """Its bytes as the prompt limit counts them: every role and content, and the variables' JSON."""
        texts = [self.template_kwargs_json, *(text for message in self.messages for text in message)]
        return sum(len(text.encode("utf-8")) for text in texts)

    def chat_messages(self) -> tuple[ChatMessage, ...]:
        """The messages, checked (every message needs a role)."""
        return tuple(ChatMessage(role=role, content=content) for role, content in self.messages)


#: ``apply_chat_template``'s own arguments and the template's reserved names: not template variables.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
    }
)  # fmt: skip


@dataclass(frozen=True)
class TemplateOptions:
    """How the chat template renders a conversation: open the assistant's turn (the default), or
    leave the final message open for the completion to continue (``continue_final_message``); and
    extra variables the template reads (``variables``, vLLM's ``chat_template_kwargs``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidArgument(
                "continue_final_message continues the final message, so the assistant's turn cannot also be "
                "opened: leave add_generation_prompt off"
            )
        reserved = sorted(RESERVED_TEMPLATE_NAMES & set(self.variables))
        if reserved:
            raise InvalidArgument(
                f"chat template variable {reserved[0]!r} is an argument of the template's rendering, not a "
                "variable: leave it out of the template's variables"
            )

    @classmethod
    def of(cls, chat: Conversation) -> TemplateOptions:
        """A conversation's options, checked (the variables' JSON strictly, as a request body's)."""
        variables: Any = {}
        if chat.template_kwargs_json:
            variables = read_json(chat.template_kwargs_json, "template_kwargs_json")  # strictly: no recursion
            if not isinstance(variables, dict):
                raise InvalidArgument("template_kwargs_json must be a JSON object of variable names to values")
        return cls(
            add_generation_prompt=not (chat.omit_generation_prompt or chat.continue_final_message),
            continue_final_message=chat.continue_final_message,
            variables=variables,
        )


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(
    tokenizer: Any, messages: Sequence[ChatMessage], options: TemplateOptions | None = None
) -> tuple[int, ...]:
    """The prompt token ids of ``messages``, with the assistant's turn opened unless ``options`` say
    otherwise."""
    options = options or TemplateOptions()
    if not messages:
        raise InvalidArgument("the conversation is empty: send at least one chat message")
    if not has_chat_template(tokenizer):
        raise FailedPrecondition(
            "the target model's tokenizer has no chat template, so chat messages cannot be turned into a "
            "prompt: send a plain text prompt instead (completions), or serve a chat model (one whose "
            "tokenizer carries a `chat_template`)"
        )
    from jinja2 import TemplateError

    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **options.variables,
        )
    except TemplateError as exc:
        raise InvalidArgument(f"the model's chat template refused the conversation: {exc}") from exc
    except ValueError as exc:  # continue_final_message: the final message is not in the rendered text
        raise InvalidArgument(f"continue_final_message: {exc}") from exc
    return tuple(tokenizer.encode(text, add_special_tokens=False))
