"""TinyTarget: paged attention through the target manager's block table, greedy phrase continuation.

Expectations come from the prompt construction (`phrase_bank`: each phrase's
tokens are distinct, so the token after any non-final phrase token is known)
and from the pages themselves, never from running the model a second way.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm_draftkv.config import KVPoolConfig, LayerGroupConfig
from draftkv_sim.prompts import phrase_bank, phrase_prompt
from draftkv_sim.target_model import TinyTarget, TinyTargetConfig, UnbackedAccessError
from tensorrt_llm_draftkv.manager import KVCacheManagerV2
from tensorrt_llm_draftkv.request import LlmRequest, ScheduledRequests
from tensorrt_llm_draftkv.runtime import BAD_PAGE_INDEX



P = 16
DIM = 32
VOCAB = 256


def make_target(window: int | None, pages: int = 256) -> TinyTarget:
    cfg = KVPoolConfig(
        (LayerGroupConfig(2, window=window),),
        pages_per_group=(pages,),
        tokens_per_block=P,
        num_kv_heads=1,
        head_dim=DIM,
        dtype=torch.float64,
        device="cpu",
        max_seq_len=8192,
    )
    return TinyTarget(TinyTargetConfig(vocab_size=VOCAB, dim=DIM), KVCacheManagerV2.from_pool_config(cfg))


def prefill(model: TinyTarget, rid: int, tokens: torch.Tensor, *, advance_history: bool = True) -> LlmRequest:
    """Size the request's cache for the whole prompt (one chunk), store its K/V, then let history follow."""
    req = LlmRequest(rid, prompt_len=tokens.numel(), tokens=tokens.tolist())
    batch = ScheduledRequests(context_requests=[req])
    model.manager.prepare_resources(batch)
    model.write_kv(rid, tokens, 0, tokens.numel())
    if advance_history:
        req.advance_context_chunk()
        model.manager.update_context_resources(batch)
    return req


def successors(seed: int) -> tuple[dict[int, int], set[int], set[int]]:
    """Token -> next token inside its phrase; the phrase-final tokens; the phrase-initial tokens."""
    bank = phrase_bank(seed, VOCAB, 6, 24)
    succ = {int(a): int(b) for row in bank for a, b in zip(row[:-1], row[1:])}
    return succ, {int(row[-1]) for row in bank}, {int(row[0]) for row in bank}


# -- reads go through the block table ------------------------------------------------------
def test_predicting_past_the_window_never_reads_released_pages():
    model = make_target(window=64)
    tokens = phrase_prompt(5, 400)
    prefill(model, 0, tokens)
    row = model.manager.get_cache(0).block_row(0)
    assert row[0] == BAD_PAGE_INDEX, "history advanced: the window released the low pages"
    # The newest position attends only inside its window, which is backed.
    model.predict(0, tokens, [399])
    # An old position's window reaches released pages: an explicit error, not page 0.
    with pytest.raises(UnbackedAccessError, match=r"request 0: read at position \d+"):
        model.predict(0, tokens, [200])
    with pytest.raises(UnbackedAccessError):
        model.read_kv(0, 0, 400)


def test_an_unbacked_entry_inside_the_attended_window_raises():
    model = make_target(window=None)
    tokens = phrase_prompt(6, 300)
    prefill(model, 0, tokens)
    cache = model.manager.get_cache(0)
    model.predict(0, tokens, [299])
    saved = cache._rows[0][7]
    cache._rows[0][7] = BAD_PAGE_INDEX  # punch a hole at positions [112, 128)
    try:
        with pytest.raises(UnbackedAccessError, match="position 112"):
            model.predict(0, tokens, [299])
        with pytest.raises(UnbackedAccessError):
            model.write_kv(0, tokens, 100, 130)
    finally:
        cache._rows[0][7] = saved
    model.manager.check_accounting()


def _value_row(model: TinyTarget, rid: int, pos: int, group: int = 0) -> tuple[int, int]:
    """(physical page, flat row of the V vector) of a position, looked up in the block table here."""
    page = model.manager.get_cache(rid).block_row(group)[pos // P]
    assert page >= 0
    return page, page * 2 * P + P + pos % P


def test_prediction_follows_what_the_pages_hold():
    model = make_target(window=None)
    seed = 7
    tokens = phrase_prompt(seed, 500)
    prefill(model, 0, tokens)
    succ, finals, _ = successors(seed)
    p = max(i for i in range(500) if int(tokens[i]) not in finals)
    expected = succ[int(tokens[p])]
    assert model.predict(0, tokens, [p]) == [expected]

    # Overwrite, in every layer and through the block table, the values the induction
    # head retrieves (positions s whose previous token equals tokens[p]) with token X.
    x = next(t for t in range(VOCAB) if t != expected and t not in succ.values() and t != int(tokens[p]))
    matches = [s for s in range(1, p + 1) if int(tokens[s - 1]) == int(tokens[p])]
    assert matches
    for s in matches:
        _, vrow = _value_row(model, 0, s)
        for layer in model._layers(0):
            layer[vrow] = model.embedding[x]
    assert model.predict(0, tokens, [p]) == [x]


def test_corrupting_another_requests_pages_changes_nothing():
    model = make_target(window=None)
    a, b = phrase_prompt(11, 300), phrase_prompt(12, 300)
    prefill(model, 0, a)
    prefill(model, 1, b)
    positions = list(range(250, 300))
    before = model.predict(0, a, positions)
    for page in model.manager.get_cache(1).held_pages(0):
        for layer in model.manager.layer_groups[0].pool.layers:
            layer[page].normal_()
    assert model.predict(0, a, positions) == before
    assert model.predict(1, b, positions) != model.predict(0, a, positions)
    # ...and corrupting one of its own pages inside the window does change it
    for page in model.manager.get_cache(0).held_pages(0):
        for layer in model.manager.layer_groups[0].pool.layers:
            layer[page].normal_()
    assert model.predict(0, a, positions) != before


def test_the_window_limits_what_is_attended():
    # The same pages read with a window that excludes every earlier occurrence of the phrase
    # cannot continue it; the full-attention target can.
    seed = 21
    tokens = phrase_prompt(seed, 600)
    succ, finals, _ = successors(seed)
    full, windowed = make_target(None), make_target(window=16)
    prefill(full, 0, tokens, advance_history=False)
    prefill(windowed, 0, tokens, advance_history=False)
    seq = tokens.tolist()
    positions = [p for p in range(100, 599) if seq[p] not in finals and seq[p] in seq[:p]]
    hits_full = sum(a == succ[int(tokens[p])] for p, a in zip(positions, full.predict(0, tokens, positions)))
    hits_win = sum(a == succ[int(tokens[p])] for p, a in zip(positions, windowed.predict(0, tokens, positions)))
    assert hits_full == len(positions)
    assert hits_win < 0.5 * len(positions)


# -- greedy continuation -----------------------------------------------------------------------
def _retrievable(seq: list[int], p: int, window: int | None) -> bool:
    """Has the token at p occurred earlier with its successor inside p's window (keys (p-W, p])?"""
    lo = 0 if window is None else max(0, p - window)
    return any(seq[q] == seq[p] for q in range(lo, p))


@pytest.mark.parametrize("seed", [3, 17, 101])
@pytest.mark.parametrize("window", [None, 256])
def test_greedy_continuation_of_phrase_prompts(seed, window):
    model = make_target(window=window)
    n, new = 700, 80
    tokens = torch.zeros(n + new + 1, dtype=torch.long)
    tokens[:n] = phrase_prompt(seed, n)
    prefill(model, 0, tokens[:n], advance_history=False)
    succ, finals, initials = successors(seed)
    prompt = tokens[:n].tolist()

    # Inside the prompt: every non-final token seen earlier in its window is continued.
    ps = [p for p in range(n - 1) if prompt[p] not in finals and _retrievable(prompt, p, window)]
    assert len(ps) > 0.6 * n
    assert model.predict(0, tokens, ps) == [prompt[p + 1] for p in ps]

    # Greedy generation, one token a step, history following (windowed pages released).
    cache = model.manager.get_cache(0)
    for i in range(n, n + new):
        assert cache.resize(i + 8, history_length=i - 1)
        model.write_kv(0, tokens, i - 1, i)
        tokens[i] = model.predict(0, tokens, [i - 1])[0]
    seq = tokens[: n + new].tolist()
    checked = 0
    for i in range(n - 1, n + new - 1):
        if not _retrievable(seq, i, window):
            continue
        checked += 1
        if seq[i] in finals:
            assert seq[i + 1] in initials, f"after a phrase ends, another phrase starts (position {i})"
        else:
            assert seq[i + 1] == succ[seq[i]], f"position {i}: the phrase continues"
    assert checked > 0.8 * new
    assert set(seq[n:]) <= set(succ) | finals, "the continuation stays inside the request's phrase bank"


def test_predictions_are_deterministic_across_instances():
    tokens = phrase_prompt(9, 300)
    outs = []
    for _ in range(2):
        model = make_target(window=128)
        prefill(model, 0, tokens, advance_history=False)
        outs.append(model.predict(0, tokens, list(range(200, 300))))
    assert outs[0] == outs[1]


def test_target_checks_its_pool_geometry():
    cfg = KVPoolConfig(
        (LayerGroupConfig(1, window=None),),
        pages_per_group=(8,),
        tokens_per_block=P,
        num_kv_heads=2,
        head_dim=DIM,
        dtype=torch.float64,
        device="cpu",
        max_seq_len=1024,
    )
    with pytest.raises(ValueError, match="1 KV head"):
        TinyTarget(TinyTargetConfig(vocab_size=VOCAB, dim=DIM), KVCacheManagerV2.from_pool_config(cfg))
