"""The speculative layer's whole dependency on a draft manager is the `DraftPool` protocol."""
from __future__ import annotations

import re
from pathlib import Path

from tensorrt_llm_draftkv.config import KVPoolConfig, LayerGroupConfig, SpeculativeDecodingMode
from tensorrt_llm_draftkv.manager import DraftKVCacheManagerV2, KVCacheManagerV2
from tensorrt_llm_draftkv.speculative.draft_pool import DraftPool

SPECULATIVE = Path(__file__).resolve().parents[2] / "tensorrt_llm_draftkv" / "speculative"


def config() -> KVPoolConfig:
    return KVPoolConfig((LayerGroupConfig(2, window=64),), pages_per_group=(32,), tokens_per_block=8)


def test_a_draft_manager_is_a_draft_pool_and_a_target_manager_is_not():
    draft = DraftKVCacheManagerV2.from_pool_config(config(), spec_mode=SpeculativeDecodingMode.DFLASH, max_draft_len=3,
                                                   num_extra_kv_tokens=4)
    assert isinstance(draft, DraftPool)
    # a target manager has no draft-pool switches (joint reuse): the drafter's side never takes one
    assert not isinstance(KVCacheManagerV2.from_pool_config(config()), DraftPool)


def test_no_speculative_module_takes_a_draft_manager_untyped():
    untyped = re.compile(r"\b(draft_manager|dm|manager|draft_kv_cache_manager)\s*:\s*Any\b")
    offenders = [f"{p.name}:{i}" for p in SPECULATIVE.glob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if untyped.search(line)]
    assert offenders == []
