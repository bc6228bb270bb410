"""The committed-prefix log of every session, in Redis.

Redis is the source of truth for what a session has committed: any target or
draft replica can rebuild a session from it (docs/design.md, invariant 5), and a
commit is valid only once its compare-and-set here succeeded (invariant 2).

Keys (``{sid}`` is a Redis Cluster hash tag, so one session's keys share a slot)::

    specserve:{sid}:tokens   string   committed token ids (prompt + generated),
                                      packed little-endian uint32; append-only
    specserve:{sid}:meta     hash     version          commits so far (0 after create)
                                      prompt_len       number of prompt tokens
                                      sampling         JSON of SamplingParams (incl. the seed)
                                      stop             JSON of StopConditions
                                      finish_reason    FinishReason value, 0 while running
                                      last_base        base version of the last commit
                                      last_verdict     JSON of the last Verdict (idempotent retries;
                                                       with its logprobs when the round reported them)
    specserve:{sid}:lease    string   owner id of the coordinator driving the session (PX lease)

``prompt_len``, ``sampling`` and ``stop`` are written once, at create, and
never change: :meth:`SessionStore.load` takes them from a caller that already
holds them (:class:`SessionSettings`), so a round reads only what moves (the
tokens, the version, the finish reason, the last verdict).

All keys of a session expire together ``ttl_s`` after the last write, so
abandoned sessions (their coordinator gone) disappear; a session that ends is
removed at once by its coordinator (:meth:`SessionStore.end`). A commit is one Lua script (registered once per
store) that checks the version, appends the tokens, bumps the version and
records the verdict atomically; a retry of a commit that already happened finds
``version == base + 1`` with ``last_base == base`` and gets the recorded verdict
back instead of a second append.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass

import structlog
from redis import asyncio as aioredis
from redis.asyncio.retry import Retry  # the asyncio Retry: the sync one never retries a coroutine
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specserve.api.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SessionFinished,
    Unavailable,
    VersionConflict,
)
from specserve.api.params import PositionLogprobs, SamplingParams, StopConditions, Verdict

log = structlog.get_logger(__name__)

#: Socket and connect timeout of every Redis command, in seconds (docs/reliability.md).
REDIS_TIMEOUT_S = 5.0
#: Retries of a Redis command after a connection error or a timeout.
REDIS_RETRIES = 3

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[5])
redis.call('HSET', KEYS[1], 'version', 0, 'prompt_len', ARGV[2], 'sampling', ARGV[3], 'stop', ARGV[4],
           'finish_reason', 0, 'last_base', -1)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

_COMMIT = """
local v = redis.call('HGET', KEYS[1], 'version')
if not v then return {'missing'} end
v = tonumber(v)
local base = tonumber(ARGV[1])
if v == base then
  if tonumber(redis.call('HGET', KEYS[1], 'finish_reason')) ~= 0 then return {'finished'} end
  local len = redis.call('STRLEN', KEYS[2]) / 4
  if len ~= tonumber(ARGV[4]) then return {'badlen', tostring(len)} end
  redis.call('APPEND', KEYS[2], ARGV[2])
  redis.call('HSET', KEYS[1], 'version', base + 1, 'last_base', base, 'last_verdict', ARGV[3],
             'finish_reason', ARGV[5])
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
  return {'ok'}
end
if v == base + 1 and tonumber(redis.call('HGET', KEYS[1], 'last_base')) == base then
  return {'replay', redis.call('HGET', KEYS[1], 'last_verdict')}
end
return {'conflict', tostring(v)}
"""


def pack_tokens(token_ids: tuple[int, ...] | list[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def unpack_tokens(blob: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(blob) // 4}I", blob)


def _verdict_json(verdict: Verdict) -> str:
    return json.dumps(dataclasses.asdict(verdict))


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_STOP_FIELDS = frozenset(f.name for f in dataclasses.fields(StopConditions))


def _settings_from_fields(f: dict[str, bytes]) -> SessionSettings:
    """The settings stored at create: InvalidArgument if they fail today's checks, FailedPrecondition
    if they cannot be read at all."""
    try:
        stop = json.loads(f["stop"])
        sampling = json.loads(f["sampling"])
        unknown = sorted((set(stop) - _STOP_FIELDS) | (set(sampling) - _SAMPLING_FIELDS))
        if unknown:
            # A record written by a newer specserve (a rolling upgrade): serving it without a setting it
            # asks for (a constraint, say) would not be the session's output, so it is refused by name.
            raise FailedPrecondition(
                f"this session was created with settings this replica does not know ({', '.join(unknown)}): "
                "a newer specserve wrote it; serve it from an upgraded replica"
            )
        stop["stop_token_ids"] = tuple(stop["stop_token_ids"])
        stop["stop_strings"] = tuple(stop["stop_strings"])
        return SessionSettings(
            prompt_len=int(f["prompt_len"]),
            sampling=SamplingParams.from_dict(sampling),
            stop=StopConditions(**stop),
        )
    except (InvalidArgument, FailedPrecondition):
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise FailedPrecondition(f"the stored settings of this session are unreadable ({type(exc).__name__})") from exc


def _verdict_from_json(text: bytes | str) -> Verdict:
    data = json.loads(text)
    data["committed_token_ids"] = tuple(data["committed_token_ids"])
    data["logprobs"] = tuple(PositionLogprobs.from_dict(p) for p in data.get("logprobs", ()))
    return Verdict(**data)


@dataclass(frozen=True)
class SessionSettings:
    """What a session was created with; written once and never changed."""

    prompt_len: int
    sampling: SamplingParams
    stop: StopConditions


@dataclass(frozen=True)
class SessionRecord:
    """A read-only snapshot of one session as Redis holds it."""

    session_id: str
    token_ids: tuple[int, ...]
    prompt_len: int
    version: int
    sampling: SamplingParams
    stop: StopConditions
    finish_reason: int
    last_verdict: Verdict | None

    @property
    def committed_len(self) -> int:
        return len(self.token_ids)

    @property
    def generated_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason != 0

    @property
    def settings(self) -> SessionSettings:
        return SessionSettings(prompt_len=self.prompt_len, sampling=self.sampling, stop=self.stop)


#: The fields of a session's meta hash that change after create.
_STATE_FIELDS = ("version", "finish_reason", "last_verdict")


class SessionStore:
    """Per-session committed-prefix logs with atomic compare-and-set commits.

    ``commit`` is the one mutator of a session's log; everything else reads.
    Redis connection failures become :class:`~specserve.api.errors.Unavailable`.
    """

    def __init__(self, redis: aioredis.Redis, *, ttl_s: float = 3600.0, namespace: str = "specserve") -> None:
        self._redis = redis
        self._ttl_ms = int(ttl_s * 1000)
        self._ns = namespace
        self._create = redis.register_script(_CREATE)
        self._commit = redis.register_script(_COMMIT)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        ttl_s: float = 3600.0,
        namespace: str = "specserve",
        timeout_s: float = REDIS_TIMEOUT_S,
        retries: int = REDIS_RETRIES,
    ) -> SessionStore:
        """Connect lazily to ``url`` (``redis://`` or ``rediss://``, password in the URL).

        Each command waits at most ``timeout_s`` for its connection and for its reply,
        and is retried ``retries`` times (exponential back-off, capped at 1 s) on a
        connection error or a timeout, then fails as Unavailable.
        """
        redis = aioredis.Redis.from_url(
            url,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=retries),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
        )
        return cls(redis, ttl_s=ttl_s, namespace=namespace)

    @property
    def redis(self) -> aioredis.Redis:
        return self._redis

    async def close(self) -> None:
        await self._redis.aclose()

    def keys(self, session_id: str) -> tuple[str, str, str]:
        """The session's keys ``(meta, tokens, lease)``, laid out as the module docstring says."""
        tag = f"{self._ns}:{{{session_id}}}"
        return f"{tag}:meta", f"{tag}:tokens", f"{tag}:lease"

    async def _call(self, coro):
        """Await a Redis command; its failures become Unavailable with a message fit for a client.

        Redis's own text (script hashes, memory figures, addresses) goes to the log only,
        with the request id of the call being served.
        """
        try:
            return await coro
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("redis_unavailable", error=type(exc).__name__, detail=str(exc))
            raise Unavailable(f"Redis is unavailable: {type(exc).__name__}", retry_after_s=1.0) from exc
        except RedisError as exc:
            log.error("redis_error", error=type(exc).__name__, detail=str(exc))
            if isinstance(exc, RedisOutOfMemoryError) or "OOM command not allowed" in str(exc):  # a script's, too
                raise Unavailable("the session store is full; retry later", retry_after_s=1.0) from exc
            raise Unavailable(
                f"the session store refused the command ({type(exc).__name__}); retry later", retry_after_s=1.0
            ) from exc

    async def ping(self) -> bool:
        return bool(await self._call(self._redis.ping()))

    async def create(
        self,
        session_id: str,
        prompt_token_ids: tuple[int, ...] | list[int],
        sampling: SamplingParams,
        stop: StopConditions,
    ) -> SessionRecord:
        """Store a new session at version 0 holding its prompt; Aborted if the id exists."""
        if not prompt_token_ids:
            raise InvalidArgument("the prompt must contain at least one token")
        meta, tokens, _ = self.keys(session_id)
        created = await self._call(
            self._create(
                keys=[meta, tokens],
                args=[
                    pack_tokens(prompt_token_ids),
                    len(prompt_token_ids),
                    json.dumps(dataclasses.asdict(sampling)),
                    json.dumps(dataclasses.asdict(stop)),
                    self._ttl_ms,
                ],
            )
        )
        if not created:
            raise Aborted(f"session {session_id!r} already exists")
        return SessionRecord(
            session_id=session_id,
            token_ids=tuple(prompt_token_ids),
            prompt_len=len(prompt_token_ids),
            version=0,
            sampling=sampling,
            stop=stop,
            finish_reason=0,
            last_verdict=None,
        )

    async def load(self, session_id: str, *, settings: SessionSettings | None = None) -> SessionRecord:
        """The session's current state; NotFound if it does not exist (or expired).

        With ``settings`` (what an earlier load returned as ``record.settings``) only the
        fields that change are read. Settings that fail their own checks raise InvalidArgument.
        """
        meta, tokens, _ = self.keys(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            if settings is None:
                pipe.hgetall(meta)
            else:
                pipe.hmget(meta, _STATE_FIELDS)
            pipe.get(tokens)
            fields, blob = await self._call(pipe.execute())
        if settings is not None:
            fields = {k.encode(): v for k, v in zip(_STATE_FIELDS, fields, strict=True) if v is not None}
        if not fields or blob is None or b"version" not in fields:
            raise NotFound(f"session {session_id!r} does not exist (finished and expired, or never created)")
        f = {k.decode(): v for k, v in fields.items()}
        if settings is None:
            settings = _settings_from_fields(f)
        return SessionRecord(
            session_id=session_id,
            token_ids=unpack_tokens(blob),
            prompt_len=settings.prompt_len,
            version=int(f["version"]),
            sampling=settings.sampling,
            stop=settings.stop,
            finish_reason=int(f["finish_reason"]),
            last_verdict=_verdict_from_json(f["last_verdict"]) if "last_verdict" in f else None,
        )

    async def read_tokens(self, session_id: str, start: int = 0) -> tuple[int, ...]:
        """Committed token ids from index ``start`` on."""
        _, tokens, _ = self.keys(session_id)
        blob = await self._call(self._redis.getrange(tokens, start * 4, -1))
        if not blob and start == 0:
            raise NotFound(f"session {session_id!r} does not exist")
        return unpack_tokens(blob)

    async def commit(self, session_id: str, base_version: int, verdict: Verdict) -> tuple[Verdict, bool]:
        """Append ``verdict.committed_token_ids`` iff the session is at ``base_version``.

        Returns ``(verdict, replayed)``. ``replayed`` is True when this exact
        base version was committed before: the recorded verdict is returned and
        nothing is appended. Raises VersionConflict (another commit won),
        SessionFinished, NotFound, or FailedPrecondition (the verdict's lengths
        do not fit the log).
        """
        if verdict.new_version != base_version + 1:
            raise InvalidArgument("verdict.new_version must be base_version + 1")
        meta, tokens, _ = self.keys(session_id)
        base_len = verdict.committed_len - len(verdict.committed_token_ids)
        reply = await self._call(
            self._commit(
                keys=[meta, tokens],
                args=[
                    base_version,
                    pack_tokens(verdict.committed_token_ids),
                    _verdict_json(verdict),
                    base_len,
                    verdict.finish_reason,
                    self._ttl_ms,
                ],
            )
        )
        status = reply[0].decode()
        if status == "ok":
            log.debug(
                "committed",
                session_id=session_id,
                version=verdict.new_version,
                tokens=len(verdict.committed_token_ids),
            )
            return verdict, False
        if status == "replay":
            return _verdict_from_json(reply[1]), True
        if status == "missing":
            raise NotFound(f"session {session_id!r} does not exist")
        if status == "finished":
            raise SessionFinished(f"session {session_id!r} already finished; nothing more is committed")
        if status == "badlen":
            raise FailedPrecondition(
                f"session {session_id!r} holds {reply[1].decode()} committed tokens, the commit assumed {base_len}"
            )
        raise VersionConflict(
            f"session {session_id!r} is at version {reply[1].decode()}, the commit was based on {base_version}"
        )

    async def delete(self, session_id: str) -> None:
        await self._call(self._redis.delete(*self.keys(session_id)))

    async def end(self, session_id: str, owner: str, *, keep_s: float = 0.0) -> None:
        """The session has ended (finished, cancelled or failed) under ``owner``: its keys are deleted,
        or with ``keep_s`` > 0 its log expires in ``keep_s`` seconds and its lease goes now. Nothing is
        done when another owner holds the lease (it drives the session now)."""
        holder = await self.lease_owner(session_id)
        if holder not in (None, owner):
            return
        meta, tokens, lease = self.keys(session_id)
        if keep_s <= 0:
            await self._call(self._redis.delete(meta, tokens, lease))
            return
        ms = max(1, int(keep_s * 1000))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.pexpire(meta, ms)
            pipe.pexpire(tokens, ms)
            pipe.delete(lease)
            await self._call(pipe.execute())

    async def exists(self, session_id: str) -> bool:
        """Whether Redis holds any part of the session's log: its meta or its tokens (a lease is no part)."""
        meta, tokens, _ = self.keys(session_id)
        return bool(await self._call(self._redis.exists(meta, tokens)))

    async def session_ids(self) -> list[str]:
        """The id of every session whose meta Redis holds (a SCAN over the whole keyspace: for operators
        and tests, never on a round's path)."""
        prefix, suffix = f"{self._ns}:{{", "}:meta"

        async def scan() -> list[str]:
            keys = self._redis.scan_iter(match=f"{prefix}*{suffix}", count=1000)
            return [key.decode() async for key in keys]

        return [key[len(prefix) : -len(suffix)] for key in await self._call(scan())]

    async def lease_owner(self, session_id: str) -> str | None:
        """The owner id holding the session's lease (None: nobody holds it)."""
        _, _, lease = self.keys(session_id)
        owner = await self._call(self._redis.get(lease))
        return None if owner is None else owner.decode()

    async def acquire_lease(self, session_id: str, owner: str, ttl_s: float) -> bool:
        """Take (or renew, if ours) the session's owner lease for ``ttl_s`` seconds."""
        _, _, lease = self.keys(session_id)
        ms = int(ttl_s * 1000)
        if await self._call(self._redis.set(lease, owner, nx=True, px=ms)):
            return True
        if await self.lease_owner(session_id) == owner:
            await self._call(self._redis.pexpire(lease, ms))
            return True
        return False

    async def release_lease(self, session_id: str, owner: str) -> None:
        _, _, lease = self.keys(session_id)
        if await self.lease_owner(session_id) == owner:
            await self._call(self._redis.delete(lease))
