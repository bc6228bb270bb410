"""``build_request``: a prompt (text, token ids or a conversation) and :class:`GenerationParams` as the
``GenerateRequest`` the SDK sends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specserve.api import errors
from specserve.api.params import GenerationParams
from specserve.v1 import coordinator_pb2

#: A conversation for :meth:`Client.chat`: ``{"role": ..., "content": ...}`` mappings (or
#: ``(role, content)`` pairs), oldest first.
ChatMessages = Sequence[Mapping[str, str] | tuple[str, str]]


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: ChatMessages | None = None,
    params: GenerationParams | None = None,
) -> coordinator_pb2.GenerateRequest:
    """The ``GenerateRequest`` for exactly one of ``prompt``, ``prompt_token_ids`` or ``messages``, with
    ``params`` (None: every setting the server's default).

    Raises :class:`~specserve.api.errors.InvalidArgument` for a prompt that cannot be encoded; the
    settings were checked when ``params`` was built, the server's limits are the server's to check.
    """
    if sum(p is not None for p in (prompt, prompt_token_ids, messages)) != 1:
        raise errors.InvalidArgument("pass exactly one of prompt (text), prompt_token_ids or messages (chat)")
    request = (params or GenerationParams()).to_pb()
    if prompt is not None:
        if not isinstance(prompt, str):
            raise errors.InvalidArgument(f"prompt must be a str, got {type(prompt).__name__}")
        request.text = prompt
    elif messages is not None:
        request.chat.messages.extend(_chat_message(m) for m in _message_list(messages))
        request.chat.SetInParent()  # an empty conversation is still "chat" (the server refuses it)
    else:
        for tok in prompt_token_ids or ():
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < 2**32:
                raise errors.InvalidArgument(f"token ids must be integers in [0, 2**32), got {tok!r}")
        request.tokens.token_ids.extend(prompt_token_ids or ())
        request.tokens.SetInParent()  # an empty list is still "tokens" (the server refuses it)
    return request


def _message_list(messages: Any) -> list[Any]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise errors.InvalidArgument(
            "messages must be a list of {'role': ..., 'content': ...} mappings, "
            f"got {type(messages).__name__}"
        )
    return list(messages)


def _chat_message(message: Any) -> coordinator_pb2.ChatMessage:
    if isinstance(message, Mapping):
        role, content = message.get("role"), message.get("content")
    elif isinstance(message, tuple) and len(message) == 2:
        role, content = message
    else:
        role = content = None
    if not isinstance(role, str) or not isinstance(content, str):
        raise errors.InvalidArgument(
            f"each chat message must be {{'role': str, 'content': str}} (or a (role, content) pair), got {message!r}"
        )
    return coordinator_pb2.ChatMessage(role=role, content=content)
