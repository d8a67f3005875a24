"""The simulator sizes its draft pool with the charge the draft manager's admission uses (moved from
tests/manager/test_admission.py: it checks the simulator's output)."""
from __future__ import annotations

from tensorrt_llm_draftkv import DraftKVCacheManagerV2, KVPoolConfig, LayerGroupConfig
from draftkv_sim.scenario import SimSetup
from draftkv_sim.run_build import draft_pages_per_request


def test_the_simulators_draft_charge_is_the_managers():
    setup = SimSetup()
    assert draft_pages_per_request(setup) == 386
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(1, window=setup.draft_window),), pages_per_group=(0,),
        tokens_per_block=setup.tokens_per_block, num_kv_heads=1, head_dim=1, max_seq_len=setup.max_seq_len,
    )
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config, spec_mode=setup.drafter, max_draft_len=setup.max_draft_len, num_extra_kv_tokens=setup.draft_extra_tokens
    )
    assert mgr.pages_per_request_charge(setup.chunk) == (386,)
