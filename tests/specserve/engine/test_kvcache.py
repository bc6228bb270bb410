"""specserve.engine.kvcache: a session's KV cache with an explicit branch, and the per-service store.

Each check compares against a fresh prefill of the same tokens (no cache), in float32,
within 1e-4, on real tiny Llama and GPT-2 models.
"""

from __future__ import annotations

import pytest
import tiny_models
import torch

from specserve.api.errors import InvalidArgument, NotFound
from specserve.engine.kvcache import SessionCache, SessionCacheStore, common_prefix_len
from specserve.engine.models import load_model

pytestmark = pytest.mark.unit

ATOL = 1e-4
PROMPT = [5, 17, 42, 99, 3, 250, 7, 11]
BRANCH = [64, 65, 66, 67, 68]  # gamma = 5 draft tokens


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request, tmp_path_factory):
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path_factory.mktemp(request.param), arch=request.param)
    return load_model(target_dir).model


@torch.inference_mode()
def fresh_logits(model, tokens) -> torch.Tensor:
    """Logits [len(tokens), vocab] of a fresh prefill (no cache)."""
    return model(input_ids=torch.tensor([tokens])).logits[0].float()


def assert_consistent(cache: SessionCache, expected_tokens, committed_len: int) -> None:
    assert cache.tokens == tuple(expected_tokens)
    assert cache.committed_len == committed_len
    assert cache.kv_len == len(expected_tokens)  # KV rows agree with the token list


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_reconcile_from_cold_equals_fresh_prefill(model):
    cache = SessionCache(model, "s")
    r = cache.reconcile(PROMPT)
    assert (r.kept, r.fed) == (0, len(PROMPT))
    assert_consistent(cache, PROMPT, len(PROMPT))
    torch.testing.assert_close(r.logits, fresh_logits(model, PROMPT)[-1], atol=ATOL, rtol=0)
    # Same C again: the last token is cropped and re-fed to produce its logits.
    again = cache.reconcile(PROMPT)
    assert (again.kept, again.fed) == (len(PROMPT) - 1, 1)
    torch.testing.assert_close(again.logits, r.logits, atol=ATOL, rtol=0)


def test_extend_logits_equal_fresh_prefill(model):
    cache = SessionCache(model, "s")
    cache.reconcile(PROMPT)
    rows = cache.extend(BRANCH)  # [gamma, vocab]
    assert rows.shape == (len(BRANCH), cache.vocab_size)
    assert_consistent(cache, PROMPT + BRANCH, len(PROMPT))
    assert cache.branch_len == len(BRANCH)
    torch.testing.assert_close(rows, fresh_logits(model, PROMPT + BRANCH)[len(PROMPT) :], atol=ATOL, rtol=0)


def test_extend_keeps_the_logits_asked_for_and_refuses_a_count_it_cannot_give(model):
    """``logits_to_keep``: the output head runs on the last rows only, which equal those of a full
    extend; a count outside 1..n is refused before anything is fed."""
    cache = SessionCache(model, "s")
    tail = cache.extend(PROMPT + BRANCH, logits_to_keep=3)  # [3, vocab]
    assert tail.shape == (3, cache.vocab_size)
    torch.testing.assert_close(tail, fresh_logits(model, PROMPT + BRANCH)[-3:], atol=ATOL, rtol=0)
    for bad in (0, 3):
        with pytest.raises(InvalidArgument, match="logits_to_keep"):
            cache.extend(BRANCH[:2], logits_to_keep=bad)
    assert cache.tokens == tuple(PROMPT + BRANCH)  # the refused calls fed nothing


@pytest.mark.parametrize("accepted", [0, 2, len(BRANCH)], ids=["first", "middle", "last"])
def test_target_round_rejection_points(model, accepted):
    """Target-style round: pending token + gamma proposals fed, `accepted` kept, a correction/bonus appended."""
    cache = SessionCache(model, "s")
    r = cache.reconcile(PROMPT, pending=True)
    assert r.logits is None
    assert_consistent(cache, PROMPT[:-1], len(PROMPT) - 1)
    rows = cache.extend([PROMPT[-1], *BRANCH])  # [gamma + 1, vocab]
    torch.testing.assert_close(
        rows, fresh_logits(model, PROMPT + BRANCH)[len(PROMPT) - 1 :], atol=ATOL, rtol=0
    )
    cache.commit(1 + accepted)
    removed = cache.rollback()
    assert removed == len(BRANCH) - accepted
    committed = PROMPT + BRANCH[:accepted]
    assert_consistent(cache, committed, len(committed))
    new_c = [*committed, 200]  # + correction (or bonus) token, now the pending one
    r2 = cache.reconcile(new_c, pending=True)
    assert r2.fed == 0 and r2.kept == len(committed)
    assert_consistent(cache, committed, len(committed))
    nxt = cache.extend([200])[-1]
    torch.testing.assert_close(nxt, fresh_logits(model, new_c)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("accepted", [0, 2, len(BRANCH)], ids=["first", "middle", "last"])
def test_draft_round_rejection_points(model, accepted):
    """Draft-style round: cache holds C + x1..x_{gamma-1}; the next reconcile keeps the accepted tokens."""
    cache = SessionCache(model, "s")
    cache.reconcile(PROMPT)
    cache.extend(BRANCH[:-1])
    new_c = [*PROMPT, *BRANCH[:accepted], 201]
    r = cache.reconcile(new_c)
    assert r.kept == len(PROMPT) + min(accepted, len(BRANCH) - 1)
    assert r.fed == len(new_c) - r.kept
    assert_consistent(cache, new_c, len(new_c))
    torch.testing.assert_close(r.logits, fresh_logits(model, new_c)[-1], atol=ATOL, rtol=0)


def test_reconcile_with_a_diverging_history_crops_and_refeeds(model):
    cache = SessionCache(model, "s")
    cache.reconcile(PROMPT)
    other = [*PROMPT[:3], 300, 301]
    r = cache.reconcile(other)
    assert (r.kept, r.fed) == (3, 2)
    assert_consistent(cache, other, len(other))
    torch.testing.assert_close(r.logits, fresh_logits(model, other)[-1], atol=ATOL, rtol=0)
    shorter = PROMPT[:2]
    r = cache.reconcile(shorter, pending=True)
    assert_consistent(cache, shorter[:1], 1)


def test_append_kv_from_elsewhere_matches_own_feed(model):
    """KV computed by another cache (as a batched pass would) appended as a branch gives identical logits."""
    donor = SessionCache(model, "donor")
    donor.reconcile(PROMPT + BRANCH)
    start = len(PROMPT) - 1
    new_kv = [(k[:, :, start:, :], v[:, :, start:, :]) for k, v in donor.layer_kv()]
    cache = SessionCache(model, "s")
    cache.reconcile(PROMPT, pending=True)
    cache.append_kv(new_kv, [PROMPT[-1], *BRANCH])
    assert_consistent(cache, PROMPT + BRANCH, len(PROMPT) - 1)
    for (k1, v1), (k2, v2) in zip(cache.layer_kv(), donor.layer_kv(), strict=True):
        assert k1.shape == k2.shape
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=0)
        torch.testing.assert_close(v1, v2, atol=1e-5, rtol=0)
    cache.commit(3)
    cache.rollback()
    c = PROMPT + BRANCH[:2]
    r = cache.reconcile(c)
    torch.testing.assert_close(r.logits, fresh_logits(model, c)[-1], atol=ATOL, rtol=0)
    with pytest.raises(InvalidArgument, match="layers"):
        cache.append_kv(new_kv[:1], [PROMPT[-1], *BRANCH])
    with pytest.raises(InvalidArgument, match="must be"):
        cache.append_kv(new_kv, [1, 2])
    assert_consistent(cache, c, len(c))  # the refused appends changed nothing


def test_bad_operations_are_refused_and_change_nothing(model):
    cache = SessionCache(model, "s")
    cache.reconcile(PROMPT)
    cache.extend(BRANCH)
    with pytest.raises(InvalidArgument, match="out of range"):
        cache.extend([cache.vocab_size])
    with pytest.raises(InvalidArgument, match="out of range"):
        cache.reconcile([*PROMPT, -1])
    with pytest.raises(InvalidArgument, match="cannot commit"):
        cache.commit(len(BRANCH) + 1)
    with pytest.raises(InvalidArgument, match="empty"):
        cache.reconcile([])
    assert_consistent(cache, PROMPT + BRANCH, len(PROMPT))


def test_nbytes_follows_the_cached_tokens(model):
    cache = SessionCache(model, "s")
    assert cache.nbytes == 0
    cache.reconcile(PROMPT)
    per_token = cache.nbytes / len(PROMPT)
    assert per_token > 0
    cache.extend(BRANCH)
    assert cache.nbytes == per_token * (len(PROMPT) + len(BRANCH))
    cache.rollback()
    assert cache.nbytes == per_token * len(PROMPT)


class FakeClock:
    """A manual monotonic clock (the only fake here: it stands in for time passing)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_store_evicts_least_recently_used_by_count(model):
    store = SessionCacheStore(model, max_sessions=2, budget_bytes=10**9, ttl_s=60)
    a, created = store.get_or_create("a")
    assert created
    store.get_or_create("b")
    assert store.get_or_create("a") == (a, False)  # a is now most recently used
    store.get_or_create("c")
    assert store.session_ids() == ["a", "c"]
    assert "b" not in store and len(store) == 2


def test_store_evicts_by_byte_budget(model):
    probe = SessionCache(model, "probe")
    probe.reconcile(PROMPT)
    one_session = probe.nbytes
    store = SessionCacheStore(model, max_sessions=10, budget_bytes=int(one_session * 1.5), ttl_s=60)
    store.get_or_create("a")[0].reconcile(PROMPT)
    store.get_or_create("b")[0].reconcile(PROMPT)
    assert store.total_bytes == 2 * one_session
    evicted = store.trim(protect=("b",))
    assert evicted == ["a"]
    assert store.session_ids() == ["b"] and store.total_bytes == one_session
    # A protected session alone over the budget is kept.
    store.get("b").extend(BRANCH * 2)
    assert store.trim(protect=("b",)) == [] and "b" in store


def test_store_releases_idle_sessions_after_ttl(model):
    clock = FakeClock()
    store = SessionCacheStore(model, max_sessions=10, budget_bytes=10**9, ttl_s=30, clock=clock)
    store.get_or_create("old")
    clock.now += 20
    store.get_or_create("young")
    clock.now += 15  # old idle 35 s > 30, young idle 15 s
    assert store.release_expired() == ["old"]
    assert store.session_ids() == ["young"]
    clock.now += 31
    store.get_or_create("new")  # creating also releases what expired
    assert store.session_ids() == ["new"]


def test_release_and_unknown_session(model):
    store = SessionCacheStore(model, max_sessions=4, budget_bytes=10**9, ttl_s=60)
    store.get_or_create("a")
    store.release("a")
    assert "a" not in store
    with pytest.raises(NotFound, match="'a'"):
        store.release("a")
    assert store.get("a") is None


def test_evicted_session_is_rebuilt_with_identical_logits(model):
    store = SessionCacheStore(model, max_sessions=1, budget_bytes=10**9, ttl_s=60)
    cache, _ = store.get_or_create("s")
    cache.reconcile(PROMPT)
    cache.extend(BRANCH[:3])
    c = PROMPT + BRANCH[:2] + [9]
    before = cache.reconcile(c).logits
    store.get_or_create("other")  # evicts "s"
    assert "s" not in store
    rebuilt, created = store.get_or_create("s")
    assert created and rebuilt.tokens == ()
    r = rebuilt.reconcile(c)
    assert r.fed == len(c)
    torch.testing.assert_close(r.logits, before, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        rebuilt.extend([4, 5]), fresh_logits(model, [*c, 4, 5])[-2:], atol=ATOL, rtol=0
    )


def test_store_checks_its_config(model):
    with pytest.raises(ValueError, match="max_sessions"):
        SessionCacheStore(model, max_sessions=0, budget_bytes=1, ttl_s=1)
    with pytest.raises(ValueError, match="ttl_s"):
        SessionCacheStore(model, max_sessions=1, budget_bytes=1, ttl_s=0)


def test_context_limit_is_refused_without_changing_the_cache(model):
    cache = SessionCache(model, "s")
    cache.reconcile(PROMPT)
    assert cache.max_positions == 512
    with pytest.raises(InvalidArgument, match="at most 512 positions"):
        cache.reconcile([1] * 513)
    with pytest.raises(InvalidArgument, match="at most 512 positions"):
        cache.extend([1] * (513 - len(PROMPT)))
    assert_consistent(cache, PROMPT, len(PROMPT))


# ---------------------------------------------------------------- the prefix cache (shared blocks)

LONG = [(7 * i + 3) % 250 + 1 for i in range(37)]  # 4 whole blocks of 8 and 5 tokens more


def _shared_store(model, **kwargs) -> SessionCacheStore:
    args = {"max_sessions": 16, "budget_bytes": 10**9, "ttl_s": 60, "block_tokens": 8} | kwargs
    return SessionCacheStore(model, **args)


def test_attached_prefix_gives_the_logits_of_a_fresh_prefill(model):
    store = _shared_store(model)
    a, _ = store.get_or_create("a")
    a.reconcile(LONG)
    assert store.share(a) == 4 and a.shared_len == 32 and store.block_count == 4
    b, _ = store.get_or_create("b")
    turn2 = [*LONG, 9, 8, 7]
    assert store.attach(b, turn2, most=len(turn2) - 1) == 32
    assert b.tokens == tuple(LONG[:32]) and b.kv_len == 32 and b.committed_len == 32
    r = b.reconcile(turn2)
    assert (r.kept, r.fed) == (32, len(turn2) - 32)
    torch.testing.assert_close(r.logits, fresh_logits(model, turn2)[-1], atol=ATOL, rtol=0)
    # A verify-like branch on the attached cache, then rollback: the shared part is untouched.
    logits = b.extend(BRANCH)
    torch.testing.assert_close(logits, fresh_logits(model, turn2 + BRANCH)[-len(BRANCH) :], atol=ATOL, rtol=0)
    b.rollback()
    assert_consistent(b, turn2, len(turn2))
    assert store.stats.queries == len(turn2) and store.stats.hits == 32


def test_shared_blocks_count_once_and_layer_kv_is_the_whole_sequence(model):
    store = _shared_store(model)
    a, _ = store.get_or_create("a")
    a.reconcile(LONG)
    alone = store.total_bytes
    store.share(a)
    assert store.total_bytes == alone  # the KV moved from the session into blocks, not copied beside it
    b, _ = store.get_or_create("b")
    store.attach(b, LONG, most=len(LONG) - 1)
    b.reconcile(LONG)
    assert store.total_bytes < 2 * alone - store.shared_bytes // 2  # the 32 shared tokens are held once
    for (ka, va), (kb, vb) in zip(a.layer_kv(), b.layer_kv(), strict=True):
        assert ka.shape[2] == kb.shape[2] == len(LONG)
        torch.testing.assert_close(kb, ka, atol=ATOL, rtol=0)
        torch.testing.assert_close(vb, va, atol=ATOL, rtol=0)
    # b shares a's blocks; sharing b again finds them (no new block).
    made = store.stats.blocks_made
    assert store.share(b) == 0 and store.stats.blocks_made == made


def test_truncating_into_the_shared_part_keeps_the_cache_exact(model):
    store = _shared_store(model)
    a, _ = store.get_or_create("a")
    a.reconcile(LONG)
    store.share(a)
    other = [*LONG[:20], 99, 98, 97, 96]  # diverges inside the third block
    r = a.reconcile(other)
    assert r.kept == 20 and a.shared_len == 16  # two whole blocks kept, four tokens copied to the tail
    torch.testing.assert_close(r.logits, fresh_logits(model, other)[-1], atol=ATOL, rtol=0)
    assert_consistent(a, other, len(other))
    assert [blk.refs for blk in a.blocks] == [1, 1] and store.block_count == 4  # the other two stay, free


def test_a_held_block_is_never_evicted_and_free_blocks_go_least_recently_used(model):
    clock = FakeClock()
    store = _shared_store(model, clock=clock)
    a, _ = store.get_or_create("a")
    a.reconcile(LONG)
    store.share(a)
    clock.now += 1
    other = [(5 * i + 1) % 250 + 1 for i in range(37)]
    b, _ = store.get_or_create("b")
    b.reconcile(other)
    store.share(b)
    store.release("a")  # a's blocks stay cached, free
    assert store.block_count == 8
    clock.now += 1
    store.budget_bytes = store.total_bytes - 1
    assert store.trim(protect=("b",)) == []  # a free block of a's chain goes, b's are held
    assert store.total_bytes <= store.budget_bytes
    assert all(blk.refs == 1 for blk in b.blocks) and len(b.blocks) == 4
    assert store.stats.blocks_evicted == 1  # the last block of a's chain first
    c, _ = store.get_or_create("c")
    assert store.attach(c, LONG, most=36) == 24  # the three blocks left of a's chain
    # Below what b holds alone: everything else goes, b stays whole.
    store.budget_bytes = 1
    store.trim(protect=("b",))
    assert store.session_ids() == ["b"] and len(b.blocks) == 4 and store.block_count == 4


def test_the_prefix_cache_off_shares_nothing(model):
    store = _shared_store(model, prefix_cache=False)
    a, _ = store.get_or_create("a")
    a.reconcile(LONG)
    assert store.share(a) == 0 and store.block_count == 0
    b, _ = store.get_or_create("b")
    assert store.attach(b, LONG, most=36) == 0 and b.seq_len == 0


@torch.inference_mode()
def fresh_features(model, tokens) -> torch.Tensor:
    """``[len(tokens), hidden]`` float16: the model's features of ``tokens`` from one fresh pass."""
    from specserve.engine.feature_head import FinalNormInput
    from specserve.engine.feature_maker import features_of

    with FinalNormInput(model) as tap:
        model(input_ids=torch.tensor([tokens]))
    return features_of(model, tap.hidden[0]).to(torch.float16)


def test_shared_blocks_keep_their_features_and_a_tracking_session_attaches_them(model):
    """A session that keeps features (the feature head's) shares its blocks with their features, counted once;
    the next one attaches them and reads every position's features without feeding them again."""
    store = _shared_store(model)
    a, _ = store.get_or_create("a")
    a.track_features()
    a.reconcile(LONG)
    own = store.total_bytes
    assert store.share(a) == 4 and all(blk.features is not None for blk in a.blocks)
    assert store.total_bytes == own  # the features moved into the blocks with the KV
    want = fresh_features(model, LONG)
    torch.testing.assert_close(a.feature_rows(0, len(LONG)), want, atol=2e-3, rtol=2e-3)
    b, _ = store.get_or_create("b")
    b.track_features()
    turn2 = [*LONG, 9, 8, 7]
    assert store.attach(b, turn2, most=len(turn2) - 1) == 32 and b.features_len == 32
    assert b.reconcile(turn2).fed == len(turn2) - 32
    torch.testing.assert_close(b.feature_rows(3, len(turn2)), fresh_features(model, turn2)[3:], atol=2e-3, rtol=2e-3)
    # Cut inside the shared part: the cut block's first rows move to the tail with its keys and values.
    b.truncate(20)
    assert b.features_len == 20
    torch.testing.assert_close(b.feature_rows(0, 20), want[:20], atol=2e-3, rtol=2e-3)


def test_blocks_without_features_are_not_attached_by_a_tracking_session_and_gain_them_when_it_shares(model):
    store = _shared_store(model)
    plain, _ = store.get_or_create("plain")
    plain.reconcile(LONG)
    store.share(plain)
    tracking, _ = store.get_or_create("tracking")
    tracking.track_features()
    assert store.attach(tracking, LONG, most=36) == 0  # the blocks bring no features: it feeds them
    tracking.reconcile(LONG)
    made = store.stats.blocks_made
    assert store.share(tracking) == 4 and store.stats.blocks_made == made  # the same blocks, now with features
    assert all(blk.features is not None for blk in tracking.blocks) and tracking.blocks == plain.blocks
    later, _ = store.get_or_create("later")
    later.track_features()
    assert store.attach(later, LONG, most=36) == 32


def test_a_lead_is_part_of_the_first_blocks_key(model):
    """A cache whose keys and values depend on a token before its first (the feature head's, on position 0)
    finds only blocks made after that same token."""
    store = _shared_store(model)
    a, _ = store.get_or_create("a")
    a.lead = (1,)
    a.reconcile(LONG)
    store.share(a)
    for name, lead, hit in (("two", (2,), 0), ("none", (), 0), ("one", (1,), 32)):
        other, _ = store.get_or_create(name)
        other.lead = lead
        assert store.attach(other, LONG, most=36) == hit, lead
    store.release("a")
    store.budget_bytes = 1
    store.trim(protect=("one",))
    assert store.block_count == 4  # held by the session that attached them
    store.release("one")
    store.trim()
    assert store.block_count == 0 and store.total_bytes == 0  # a lead's blocks are evicted like any


def test_stores_sharing_a_budget_evict_from_both_least_recently_used_first(model):
    """One budget for two stores (a draft's model and its feature head): growing one evicts the other's older
    sessions, not its own newer ones."""
    from specserve.engine.kvcache import KVBudget

    clock = FakeClock()
    budget = KVBudget(10**9)
    first = _shared_store(model, budget_bytes=budget, clock=clock, prefix_cache=False)
    second = _shared_store(model, budget_bytes=budget, clock=clock, prefix_cache=False)
    old, _ = first.get_or_create("old")
    old.reconcile(LONG)
    clock.now += 1
    new, _ = second.get_or_create("new")
    new.reconcile(LONG)
    clock.now += 1
    newest, _ = second.get_or_create("newest")
    newest.reconcile(LONG)
    assert budget.total_bytes == first.total_bytes + second.total_bytes
    budget.budget_bytes = second.total_bytes  # room for the second store's two sessions only
    assert second.trim(protect=("newest",)) == ["old"]
    assert first.session_ids() == [] and second.session_ids() == ["new", "newest"]
    with pytest.raises(ValueError, match="budget_bytes"):
        KVBudget(0)
def test_blocks_attach_only_within_their_cache_scope(model):
    """Issue 54: a block made under one cache scope (a tenant, a salt) is never attached by another; the same
    scope attaches it, and the same tokens shared under two scopes are two chains."""
    store = _shared_store(model)
    a, _ = store.get_or_create("a", scope=b"tenant-a")
    a.reconcile(LONG)
    assert store.share(a) == 4
    other, _ = store.get_or_create("other", scope=b"tenant-b")
    assert store.attach(other, LONG, most=len(LONG) - 1) == 0 and other.seq_len == 0
    unscoped, _ = store.get_or_create("unscoped")
    assert store.attach(unscoped, LONG, most=len(LONG) - 1) == 0
    same, _ = store.get_or_create("same", scope=b"tenant-a")
    assert store.attach(same, LONG, most=len(LONG) - 1) == 32 and same.blocks == a.blocks
    # tenant-b computes the prefix itself; sharing it makes its own blocks, not a's.
    r = other.reconcile(LONG)
    assert (r.kept, r.fed) == (0, len(LONG))
    torch.testing.assert_close(r.logits, fresh_logits(model, LONG)[-1], atol=ATOL, rtol=0)
    assert store.share(other) == 4 and store.block_count == 8
    assert not set(other.blocks) & set(a.blocks)
    again, _ = store.get_or_create("again", scope=b"tenant-b")
    assert store.attach(again, LONG, most=len(LONG) - 1) == 32 and again.blocks == other.blocks
    # Every block of tenant-a evicted: tenant-b's chain is untouched and still found.
    for sid in ("a", "same"):
        store.release(sid)
    store.budget_bytes = store.total_bytes - store.shared_bytes // 2
    store.trim(protect=("other", "again", "unscoped"))
    fresh, _ = store.get_or_create("fresh", scope=b"tenant-a")
    assert store.attach(fresh, LONG, most=len(LONG) - 1) == 0
    late, _ = store.get_or_create("late", scope=b"tenant-b")
    assert store.attach(late, LONG, most=len(LONG) - 1) == 32


def test_a_session_met_under_another_scope_starts_a_fresh_cache(model):
    store = _shared_store(model)
    a, _ = store.get_or_create("a", scope=b"one")
    a.reconcile(LONG)
    store.share(a)
    same, created = store.get_or_create("a", scope=b"one")
    assert same is a and not created
    moved, created = store.get_or_create("a", scope=b"two")
    assert created and moved is not a and moved.seq_len == 0 and moved.scope == b"two"
    assert store.attach(moved, LONG, most=len(LONG) - 1) == 0
