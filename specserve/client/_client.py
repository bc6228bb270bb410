"""The SDK's implementation; the public names and their documentation are :mod:`specserve.client`."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

from specserve.api import errors
from specserve.api.params import PROPOSER_KINDS, SAMPLING_MODES, PositionLogprobs
from specserve.api.status import error_from_rpc
from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

#: A conversation for :meth:`Client.chat`: ``{"role": ..., "content": ...}`` mappings (or
#: ``(role, content)`` pairs), oldest first.
ChatMessages = Sequence[Mapping[str, str] | tuple[str, str]]

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "unspecified",
    common_pb2.FINISH_REASON_EOS: "eos",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop_token",
    common_pb2.FINISH_REASON_STOP_STRING: "stop_string",
    common_pb2.FINISH_REASON_LENGTH: "length",
}


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class GenerationStats:
    """Statistics of one generation, as the coordinator measured them (times in nanoseconds)."""

    session_id: str
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    proposed_tokens: int
    accepted_tokens: int
    #: ``accepted_per_position[i]``: rounds whose draft token at position ``i`` was accepted.
    accepted_per_position: tuple[int, ...]
    draft_ns: int
    verify_ns: int
    queue_ns: int
    first_token_ns: int
    total_ns: int
    #: ``"eos"``, ``"stop_token"``, ``"stop_string"`` or ``"length"``.
    finish_reason: str
    seed: int
    #: Rounds that proposed at least one draft token (the rest ran the target alone).
    draft_rounds: int = 0
    #: Predicted Outputs: completion tokens the prediction predicted at their place.
    accepted_prediction_tokens: int = 0
    #: Predicted Outputs: tokens drafted from the prediction and not committed (rejected).
    rejected_prediction_tokens: int = 0
    #: The target's own account of the Verify calls (``verify_ns`` minus this: network, coordinator).
    target_ns: int = 0
    #: The target's forward passes in those calls (a batched pass counted for each session in it).
    forward_ns: int = 0
    #: Of ``proposed_tokens``, those an n-gram lookup in the coordinator drafted (no draft call): the
    #: ``ngram`` proposer's, or the hybrid lookup's of a session drafting with the model.
    lookup_proposed_tokens: int = 0
    #: Of ``accepted_tokens``, those the lookup drafted.
    lookup_accepted_tokens: int = 0
    #: Of ``prompt_tokens``, those the target did not prefill: its prefix cache held them.
    cached_tokens: int = 0
    #: Of ``proposed_tokens``, those a constrained request's forced text drafted (no draft call).
    forced_proposed_tokens: int = 0
    #: Of ``accepted_tokens``, those the forced text drafted.
    forced_accepted_tokens: int = 0

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.GenerationStats) -> GenerationStats:
        return cls(
            session_id=pb.session_id,
            prompt_tokens=pb.prompt_tokens,
            completion_tokens=pb.completion_tokens,
            rounds=pb.rounds,
            proposed_tokens=pb.proposed_tokens,
            accepted_tokens=pb.accepted_tokens,
            accepted_per_position=tuple(pb.accepted_per_position),
            draft_ns=pb.draft_ns,
            verify_ns=pb.verify_ns,
            queue_ns=pb.queue_ns,
            first_token_ns=pb.first_token_ns,
            total_ns=pb.total_ns,
            finish_reason=_FINISH_REASONS.get(pb.finish_reason, str(pb.finish_reason)),
            seed=pb.seed,
            draft_rounds=pb.draft_rounds,
            accepted_prediction_tokens=pb.accepted_prediction_tokens,
            rejected_prediction_tokens=pb.rejected_prediction_tokens,
            target_ns=pb.target_ns,
            forward_ns=pb.forward_ns,
            lookup_proposed_tokens=pb.lookup_proposed_tokens,
            lookup_accepted_tokens=pb.lookup_accepted_tokens,
            cached_tokens=pb.cached_tokens,
            forced_proposed_tokens=pb.forced_proposed_tokens,
            forced_accepted_tokens=pb.forced_accepted_tokens,
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0.0 when nothing was proposed)."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Committed tokens per round (1.0 is what decoding without speculation gives)."""
        return self.completion_tokens / self.rounds if self.rounds else 0.0

    @property
    def draft_s(self) -> float:
        return self.draft_ns / 1e9

    @property
    def verify_s(self) -> float:
        return self.verify_ns / 1e9

    @property
    def queue_s(self) -> float:
        return self.queue_ns / 1e9

    @property
    def first_token_s(self) -> float:
        return self.first_token_ns / 1e9

    @property
    def total_s(self) -> float:
        return self.total_ns / 1e9

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per second of the request's wall-clock time."""
        return self.completion_tokens / self.total_s if self.total_ns else 0.0

    def summary(self) -> str:
        """These statistics as a few human-readable lines (the CLI prints them)."""
        per_pos = " ".join(str(n) for n in self.accepted_per_position) or "-"
        return "\n".join(
            [
                f"tokens {self.completion_tokens} (prompt {self.prompt_tokens}) | rounds {self.rounds} "
                f"| {self.tokens_per_round:.2f} tokens/round | finish {self.finish_reason}",
                f"draft tokens proposed {self.proposed_tokens}, accepted {self.accepted_tokens} "
                f"({100 * self.acceptance_rate:.1f}%) | accepted per position: {per_pos}",
                f"time {self.total_s:.3f} s ({self.tokens_per_s:.1f} tokens/s) | first token "
                f"{1e3 * self.first_token_s:.1f} ms | draft {self.draft_s:.3f} s | verify "
                f"{self.verify_s:.3f} s | queue {self.queue_s:.3f} s",
                f"session {self.session_id} | seed {self.seed}",
            ]
            + (
                [
                    f"of which from the prompt lookup: proposed {self.lookup_proposed_tokens}, "
                    f"accepted {self.lookup_accepted_tokens}"
                ]
                if self.lookup_proposed_tokens
                else []
            )
            + (
                [
                    f"prediction tokens accepted {self.accepted_prediction_tokens}, "
                    f"rejected {self.rejected_prediction_tokens}"
                ]
                if self.accepted_prediction_tokens or self.rejected_prediction_tokens
                else []
            )
        )


@dataclass(frozen=True)
class StreamChunk:
    """Tokens that just committed, and their text (a split multi-byte character waits until whole).

    ``logprobs``: with ``logprobs=True``, one :class:`PositionLogprobs` per token, else ``()``.
    """

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[PositionLogprobs, ...] = ()


@dataclass(frozen=True)
class GenerateResult:
    """A finished generation: the completion (without the prompt) and its statistics.

    ``logprobs``: with ``logprobs=True``, one :class:`PositionLogprobs` per token of
    ``token_ids`` (the target's processed distribution at that position), else ``()``.
    """

    text: str
    token_ids: tuple[int, ...]
    stats: GenerationStats
    logprobs: tuple[PositionLogprobs, ...] = ()

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


# --------------------------------------------------------------------------- request building


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: ChatMessages | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    min_new_tokens: int = 0,
    gamma: int | Literal["auto"] | None = None,
    proposer: Literal["model", "feature", "ngram"] | None = None,
    draft_top_k: int = 0,
    sampling_mode: Literal["optimal", "coupled"] | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    prediction: str | Sequence[int] | None = None,
    hybrid_lookup: bool | None = None,
    min_confidence: float | None = None,
) -> coordinator_pb2.GenerateRequest:
    """The ``GenerateRequest`` for :meth:`Client.generate`'s arguments (see there).

    Raises :class:`~specserve.api.errors.InvalidArgument` only for what cannot be encoded
    at all; value ranges are the server's to check.
    """
    if sum(p is not None for p in (prompt, prompt_token_ids, messages)) != 1:
        raise errors.InvalidArgument("pass exactly one of prompt (text), prompt_token_ids or messages (chat)")
    if proposer is not None and proposer not in PROPOSER_KINDS:
        raise errors.InvalidArgument(f"proposer must be 'model', 'feature' or 'ngram', got {proposer!r}")
    if sampling_mode is not None and sampling_mode not in SAMPLING_MODES:
        raise errors.InvalidArgument(f"sampling_mode must be 'optimal' or 'coupled', got {sampling_mode!r}")
    _check_uint("top_k", top_k, 32)
    _check_uint("draft_top_k", draft_top_k, 32)
    _check_uint("max_new_tokens", max_new_tokens or 0, 32)
    _check_uint("min_new_tokens", min_new_tokens, 32)
    if seed is not None:
        _check_uint("seed", seed, 64)
    _check_uint("top_logprobs", top_logprobs, 32)
    if top_logprobs and not logprobs:
        raise errors.InvalidArgument("top_logprobs needs logprobs=True")
    if isinstance(stop, str):
        stop = [stop]
    for tok in [*(prompt_token_ids or ()), *(stop_token_ids or ())]:
        _check_uint("token ids", tok, 32)

    request = coordinator_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            sampling_mode=SAMPLING_MODES[sampling_mode]
            if sampling_mode is not None
            else common_pb2.SAMPLING_MODE_UNSPECIFIED,
        ),
        stop=common_pb2.StopConditions(
            max_new_tokens=max_new_tokens or 0,
            stop_token_ids=list(stop_token_ids or ()),
            stop_strings=list(stop or ()),
            ignore_eos=ignore_eos,
            min_new_tokens=min_new_tokens,
        ),
        speculation=coordinator_pb2.SpeculationParams(
            proposer=PROPOSER_KINDS[proposer] if proposer is not None else common_pb2.PROPOSER_KIND_UNSPECIFIED,
            draft_top_k=draft_top_k,
            hybrid_lookup=hybrid_lookup,
            min_confidence=min_confidence,
        ),
    )
    if logprobs:
        request.logprobs.top_logprobs = top_logprobs
        request.logprobs.SetInParent()
    if prediction is not None:
        if isinstance(prediction, str):
            request.prediction.text = prediction
        elif isinstance(prediction, Sequence) and not isinstance(prediction, (str, bytes)):
            for tok in prediction:
                _check_uint("prediction token ids", tok, 32)
            request.prediction.tokens.token_ids.extend(prediction)
            request.prediction.tokens.SetInParent()
        else:
            raise errors.InvalidArgument(
                f"prediction must be text (str) or token ids, got {type(prediction).__name__}"
            )
    if gamma is not None and gamma != "auto":
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
            raise errors.InvalidArgument(f"gamma must be 'auto' (or None) or an integer >= 0, got {gamma!r}")
        request.speculation.gamma = gamma
    if prompt is not None:
        if not isinstance(prompt, str):
            raise errors.InvalidArgument(f"prompt must be a str, got {type(prompt).__name__}")
        request.text = prompt
    elif messages is not None:
        request.chat.messages.extend(_chat_message(m) for m in _message_list(messages))
        request.chat.SetInParent()  # an empty conversation is still "chat" (the server refuses it)
    else:
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


def _check_uint(name: str, value: Any, bits: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**bits:
        raise errors.InvalidArgument(f"{name} must be an integer in [0, 2**{bits}), got {value!r}")


# --------------------------------------------------------------------------- channels


def _read_pem(value: bytes | str | os.PathLike[str] | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as fh:
        return fh.read()


@dataclass
class _Config:
    address: str
    timeout: float | None
    retries: int
    backoff: float
    max_backoff: float
    metadata: tuple[tuple[str, str], ...]
    credentials: grpc.ChannelCredentials | None
    options: list[tuple[str, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, address: str, **kw: Any) -> _Config:
        if kw["retries"] < 0 or kw["backoff"] < 0:
            raise ValueError("retries and backoff must be >= 0")
        token = kw.pop("token")
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        pems = [_read_pem(kw.pop(k)) for k in ("root_certificates", "private_key", "certificate_chain")]
        tls = kw.pop("tls")
        if tls is None:
            tls = any(p is not None for p in pems)
        if (pems[1] is None) != (pems[2] is None):
            raise ValueError("pass both private_key and certificate_chain (mutual TLS), or neither")
        creds = grpc.ssl_channel_credentials(*pems) if tls else None
        options = [
            ("grpc.max_receive_message_length", kw.pop("max_message_bytes")),
            ("grpc.enable_retries", 0),  # the SDK retries itself, only where that is safe
        ]
        if kw.get("server_name_override"):
            options.append(("grpc.ssl_target_name_override", kw["server_name_override"]))
        kw.pop("server_name_override", None)
        return cls(address=address, metadata=metadata, credentials=creds, options=options, **kw)

    def delay(self, attempt: int, err: errors.SpecServeError) -> float:
        if err.retry_after_s is not None:
            return err.retry_after_s
        # Equal jitter: many clients reconnecting at once do not retry in lockstep.
        return min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)

    def should_retry(self, err: errors.SpecServeError, attempt: int, received: bool) -> bool:
        return not received and isinstance(err, errors.Unavailable) and attempt < self.retries


class _Collector:
    """Folds response messages into chunks and, at the end, a :class:`GenerateResult`."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] = []
        self.stats: GenerationStats | None = None

    def add(self, response: coordinator_pb2.GenerateResponse) -> StreamChunk | None:
        kind = response.WhichOneof("event")
        if kind == "chunk":
            logprobs = tuple(PositionLogprobs.from_pb(p) for p in response.chunk.logprobs)
            chunk = StreamChunk(tuple(response.chunk.token_ids), response.chunk.text, logprobs)
            self.token_ids.extend(chunk.token_ids)
            self.text.append(chunk.text)
            self.logprobs.extend(logprobs)
            return chunk
        if kind == "stats":
            self.stats = GenerationStats.from_pb(response.stats)
        return None

    def result(self, address: str) -> GenerateResult:
        if self.stats is None:
            raise errors.SpecServeError(f"the stream from {address} ended without its closing statistics")
        return GenerateResult("".join(self.text), tuple(self.token_ids), self.stats, tuple(self.logprobs))


class _StreamBase:
    def __init__(self) -> None:
        self._result: GenerateResult | None = None

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def result(self) -> GenerateResult:
        """The whole generation; available once the stream is exhausted."""
        if self._result is None:
            raise RuntimeError("the stream is not finished yet: iterate it to the end first")
        return self._result

    @property
    def stats(self) -> GenerationStats:
        return self.result.stats


# --------------------------------------------------------------------------- blocking client


class TokenStream(_StreamBase, Iterator[StreamChunk]):
    """Iterator of :class:`StreamChunk`; ``.result`` / ``.stats`` once exhausted; ``.cancel()``."""

    def __init__(self, client: Client, request: coordinator_pb2.GenerateRequest) -> None:
        super().__init__()
        self._client = client
        self._call: Any = None
        self._gen = self._run(request)

    def _run(self, request: coordinator_pb2.GenerateRequest) -> Generator[StreamChunk, None, None]:
        cfg, attempt = self._client._cfg, 0
        while True:
            collector, received = _Collector(), False
            self._call = self._client._stub.Generate(request, timeout=cfg.timeout, metadata=cfg.metadata)
            try:
                for response in self._call:
                    received = True
                    chunk = collector.add(response)
                    if chunk is not None:
                        yield chunk
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, cfg.address)
                if cfg.should_retry(err, attempt, received):
                    time.sleep(cfg.delay(attempt, err))
                    attempt += 1
                    continue
                raise err from exc
            finally:
                if not collector.stats:
                    self._call.cancel()
            self._result = collector.result(cfg.address)
            return

    def __next__(self) -> StreamChunk:
        return next(self._gen)

    def cancel(self) -> None:
        """Cancel the request on the server; iterating further raises :class:`~specserve.api.errors.Cancelled`."""
        if self._call is not None and self._result is None:
            self._call.cancel()

    def close(self) -> None:
        self.cancel()
        self._gen.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Client:
    """Blocking client of a specserve coordinator.

    Args:
        address: ``host:port`` of the coordinator.
        timeout: deadline of each attempt of a call, in seconds (``None``: none).
        retries: extra attempts after UNAVAILABLE before any token arrived.
        backoff: first retry delay in seconds; doubles each retry up to ``max_backoff``.
        token: bearer token, sent as ``authorization: Bearer <token>``.
        tls: use TLS (default: when any PEM below is given; ``True`` alone uses the system roots).
        root_certificates, private_key, certificate_chain: PEM bytes or file paths
            (the CA to trust; a client key and certificate for mutual TLS).
        server_name_override: TLS host name to expect (tests with an IP address).

    Example::

        with Client("127.0.0.1:50051") as client:
            print(client.generate("def add(a, b):", max_new_tokens=16, temperature=0).text)
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = 600.0,
        retries: int = 3,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        private_key: bytes | str | os.PathLike[str] | None = None,
        certificate_chain: bytes | str | os.PathLike[str] | None = None,
        server_name_override: str | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self._cfg = _Config.build(
            address, timeout=timeout, retries=retries, backoff=backoff, max_backoff=max_backoff,
            token=token, tls=tls, root_certificates=root_certificates, private_key=private_key,
            certificate_chain=certificate_chain, server_name_override=server_name_override,
            max_message_bytes=max_message_bytes,
        )  # fmt: skip
        cfg = self._cfg
        if cfg.credentials is not None:
            self._channel = grpc.secure_channel(address, cfg.credentials, options=cfg.options)
        else:
            self._channel = grpc.insecure_channel(address, options=cfg.options)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    @property
    def address(self) -> str:
        return self._cfg.address

    def stream(self, prompt: str | None = None, **kwargs: Any) -> TokenStream:
        """Start a generation and return its :class:`TokenStream` (same arguments as :meth:`generate`).

        Example::

            stream = client.stream("for i in range(", max_new_tokens=16)
            for chunk in stream:
                print(chunk.text, end="")
            print(stream.stats.accepted_tokens, "draft tokens accepted")
        """
        return TokenStream(self, build_request(prompt, **kwargs))

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        min_new_tokens: int = 0,
        gamma: int | Literal["auto"] | None = None,
        proposer: Literal["model", "feature", "ngram"] | None = None,
        draft_top_k: int = 0,
        sampling_mode: Literal["optimal", "coupled"] | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        prediction: str | Sequence[int] | None = None,
        hybrid_lookup: bool | None = None,
        min_confidence: float | None = None,
    ) -> GenerateResult:
        """Generate a completion of ``prompt`` (text) or ``prompt_token_ids``.

        Sampling follows Hugging Face ``generate()``: ``temperature`` 0 is greedy;
        ``top_k`` 0, ``top_p`` 1, ``min_p`` 0 and ``repetition_penalty`` 1 disable
        those. ``seed`` (None: the server picks and reports it in ``stats.seed``)
        makes a sampled completion reproducible. ``max_new_tokens`` None is the
        server's default. ``stop`` strings and ``stop_token_ids`` end the
        completion (included in it). ``min_new_tokens`` (vLLM's ``min_tokens``): until
        that many tokens are generated, EOS (unless ``ignore_eos``) and ``stop_token_ids``
        are masked out of the distribution, as Hugging Face's ``min_new_tokens`` masks EOS
        (not with ``stop`` strings; at most ``max_new_tokens``). ``gamma``: draft tokens per round, or
        ``"auto"``/None for the server's policy; ``proposer``: ``"feature"`` (the
        feature head, reading the target's features), ``"model"`` (the token draft),
        ``"ngram"`` (prompt lookup), or None for the server's default (the feature
        head where the draft tier serves one); ``draft_top_k`` > 0 truncates
        the draft's distribution (the output distribution stays exact).

        ``sampling_mode`` (None: the server's default, ``"optimal"``) decides
        what a seed fixes. Both modes sample exactly from the target. With
        ``"optimal"`` the text for a seed also depends on the draft's proposals,
        so it repeats only under the same fixed ``gamma``, ``proposer`` and
        draft (the adaptive policy and draft faults change the schedule). With
        ``"coupled"`` (Gumbel-max with shared noise) the same seed gives the
        same text whatever the gamma, proposer, draft, batch or failover, at
        some cost in accepted draft tokens. Greedy decoding is the same in both.

        ``logprobs=True``: ``result.logprobs`` (and each chunk's) holds, per token, its
        log probability under the target's processed distribution at that position and
        the ``top_logprobs`` (0..20) most likely alternatives. Processed means the
        request's own logits processing (temperature, top-k, top-p, min-p, repetition
        penalty), so a token removed by top-k has no entry; for greedy requests, the
        repetition penalty then a softmax at temperature 1.

        ``prediction`` (Predicted Outputs): text (or token ids) the completion is
        expected to largely repeat, e.g. the file being edited. The server drafts from
        it where the completion follows it and verifies every drafted token exactly, so
        the output is the same as without it; only the speed changes. With
        ``proposer="model"`` the draft model drafts where the prediction has nothing to
        offer, with ``"ngram"`` the prompt lookup. ``stats.accepted_prediction_tokens``
        and ``stats.rejected_prediction_tokens`` count how it went.

        ``hybrid_lookup`` (None: the server's setting, on by default): with the automatic
        policy and ``proposer="model"``, the server also drafts from an n-gram lookup over
        the session's own tokens where the completion copies earlier text and the lookup's
        measured acceptance makes that pay, with no draft call; ``False`` drafts from the
        model alone. ``stats.lookup_proposed_tokens`` and ``stats.lookup_accepted_tokens``
        count the lookup's share.

        ``min_confidence`` (dynamic draft length; None: the server's setting under the
        automatic policy, 0.4 by default, and 0 with a fixed ``gamma``): the draft model
        ends a round's proposal after a token it drafted with probability below this, in
        [0, 1), so ``gamma`` becomes a cap; 0 drafts the whole ``gamma``. The output is
        the same at any value; only the speed changes.

        Example::

            result = client.generate("def add(a, b):", max_new_tokens=16, temperature=0, gamma=4)
            print(result.text, result.finish_reason, result.stats.acceptance_rate)
        """
        kwargs = dict(locals())
        del kwargs["self"], kwargs["prompt"]
        stream = self.stream(prompt, **kwargs)
        with stream:
            for _ in stream:
                pass
        return stream.result

    def stream_chat(self, messages: ChatMessages, **kwargs: Any) -> TokenStream:
        """Start the assistant's reply to ``messages``; returns its :class:`TokenStream`.

        Sampling and speculation arguments as :meth:`generate`. The server renders the
        conversation with the target model's chat template (a model without one is refused
        with :class:`~specserve.api.errors.FailedPrecondition`).

        Example::

            messages = [{"role": "user", "content": "Name a prime."}]
            for chunk in client.stream_chat(messages, max_new_tokens=16):
                print(chunk.text, end="")
        """
        return TokenStream(self, build_request(messages=messages, **kwargs))

    def chat(self, messages: ChatMessages, **kwargs: Any) -> GenerateResult:
        """The assistant's reply to ``messages`` (``{"role", "content"}`` mappings, oldest first).

        Arguments as :meth:`generate`; ``result.text`` is the reply. Keep a conversation going by
        appending ``{"role": "assistant", "content": result.text}`` and the next user message.
        """
        with self.stream_chat(messages, **kwargs) as stream:
            for _ in stream:
                pass
        return stream.result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------------- asyncio client


class AsyncTokenStream(_StreamBase, AsyncIterator[StreamChunk]):
    """Async iterator of :class:`StreamChunk`; ``.result`` / ``.stats`` once exhausted; ``.cancel()``."""

    def __init__(self, client: AsyncClient, request: coordinator_pb2.GenerateRequest) -> None:
        super().__init__()
        self._client = client
        self._call: Any = None
        self._gen = self._run(request)

    async def _run(self, request: coordinator_pb2.GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        cfg, attempt = self._client._cfg, 0
        stub = self._client._ensure_stub()
        while True:
            collector, received = _Collector(), False
            self._call = stub.Generate(request, timeout=cfg.timeout, metadata=cfg.metadata)
            try:
                async for response in self._call:
                    received = True
                    chunk = collector.add(response)
                    if chunk is not None:
                        yield chunk
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, cfg.address)
                if cfg.should_retry(err, attempt, received):
                    await asyncio.sleep(cfg.delay(attempt, err))
                    attempt += 1
                    continue
                raise err from exc
            finally:
                if not collector.stats:
                    self._call.cancel()
            self._result = collector.result(cfg.address)
            return

    def __anext__(self) -> Any:
        return self._gen.__anext__()

    def cancel(self) -> None:
        """Cancel the request on the server."""
        if self._call is not None and self._result is None:
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()
        await self._gen.aclose()

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class AsyncClient:
    """asyncio client of a specserve coordinator; same arguments as :class:`Client`.

    The channel is opened on first use inside the running event loop.

    Example::

        import asyncio
        from specserve import AsyncClient

        async def main():
            async with AsyncClient("127.0.0.1:50051") as client:
                result = await client.generate("def add(a, b):", max_new_tokens=16, temperature=0)
                print(result.text)

        asyncio.run(main())
    """

    def __init__(self, address: str, **kwargs: Any) -> None:
        defaults: dict[str, Any] = {
            "timeout": 600.0, "retries": 3, "backoff": 0.2, "max_backoff": 5.0, "token": None,
            "tls": None, "root_certificates": None, "private_key": None, "certificate_chain": None,
            "server_name_override": None, "max_message_bytes": 16 * 1024 * 1024,
        }  # fmt: skip
        unknown = set(kwargs) - set(defaults)
        if unknown:
            raise TypeError(f"unknown AsyncClient arguments: {sorted(unknown)}")
        self._cfg = _Config.build(address, **{**defaults, **kwargs})
        self._channel: grpc.aio.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorServiceStub | None = None

    @property
    def address(self) -> str:
        return self._cfg.address

    def _ensure_stub(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        if self._stub is None:
            cfg = self._cfg
            if cfg.credentials is not None:
                self._channel = grpc.aio.secure_channel(cfg.address, cfg.credentials, options=cfg.options)
            else:
                self._channel = grpc.aio.insecure_channel(cfg.address, options=cfg.options)
            self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        return self._stub

    def stream(self, prompt: str | None = None, **kwargs: Any) -> AsyncTokenStream:
        """Start a generation; returns an :class:`AsyncTokenStream` (arguments as :meth:`Client.generate`)."""
        return AsyncTokenStream(self, build_request(prompt, **kwargs))

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> GenerateResult:
        """Generate a completion; arguments and result as :meth:`Client.generate`."""
        async with self.stream(prompt, **kwargs) as stream:
            async for _ in stream:
                pass
        return stream.result

    def stream_chat(self, messages: ChatMessages, **kwargs: Any) -> AsyncTokenStream:
        """Start the assistant's reply to ``messages``; as :meth:`Client.stream_chat`."""
        return AsyncTokenStream(self, build_request(messages=messages, **kwargs))

    async def chat(self, messages: ChatMessages, **kwargs: Any) -> GenerateResult:
        """The assistant's reply to ``messages``; as :meth:`Client.chat`."""
        async with self.stream_chat(messages, **kwargs) as stream:
            async for _ in stream:
                pass
        return stream.result

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
