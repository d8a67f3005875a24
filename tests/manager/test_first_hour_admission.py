"""Admission against the pool, not only the geometry's charge: a request within the charge is still
refused by a pool smaller than its peak, with both numbers (`admission.check_request(pool_pages=...)`)."""
from __future__ import annotations

import pytest

from tensorrt_llm_draftkv.config import LayerGroupConfig
from tensorrt_llm_draftkv.config import SpeculativeDecodingMode as Mode
from tensorrt_llm_draftkv.manager import admission, rules
from tensorrt_llm_draftkv.runtime.life_cycle import LifeCycle

P, W, CHUNK = 32, 4096, 8192
POLICY = rules.DraftPoolTraits(Mode.DFLASH)
LIFE_CYCLES = [LifeCycle(W).widened(P)]
KW = dict(request_id=7, prompt_len=131071, chunk=CHUNK, max_draft_len=7, num_extra_kv_tokens=8, max_new_tokens=64)


def charge() -> tuple[int, ...]:
    return admission.request_charge(
        [LayerGroupConfig(1, window=W)], P, chunk=CHUNK, max_seq_len=1 << 20,
        max_draft_len=7, num_extra_kv_tokens=8, trail_tokens=P,
    )


def test_within_the_charge_and_a_big_enough_pool_is_admitted():
    admission.check_request(POLICY, LIFE_CYCLES, P, charged=charge(), pool_pages=(8 * charge()[0],), **KW)


def test_a_pool_smaller_than_the_peak_refuses_with_both_numbers():
    needed = admission.mirror_peak_pages(POLICY, LIFE_CYCLES, P, prompt_len=131071, chunk=CHUNK, max_draft_len=7,
                                         num_extra_kv_tokens=8, max_new_tokens=64)
    assert needed[0] <= charge()[0]  # within the geometry's charge: only the pool check can refuse it
    admission.check_request(POLICY, LIFE_CYCLES, P, charged=charge(), **KW)  # the charge alone admits it
    with pytest.raises(admission.AdmissionRefused) as info:
        admission.check_request(POLICY, LIFE_CYCLES, P, charged=charge(), pool_pages=(100,), **KW)
    message = str(info.value)
    assert "request 7 refused at admission" in message
    assert f"needs {needed[0]} pages in layer group 0" in message and "the pool has only 100 pages" in message
    assert info.value.needed_pages == needed[0] and info.value.group == 0


def test_pool_sizes_for_the_wrong_number_of_groups_are_an_error():
    with pytest.raises(ValueError, match="pool sizes for 2 layer groups"):
        admission.check_request(POLICY, LIFE_CYCLES, P, charged=charge(), pool_pages=(100, 100), **KW)
