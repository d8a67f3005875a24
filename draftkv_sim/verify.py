"""What the executor verifies drafts against: the tiny paged target, or a ground-truth oracle.

A verifier owns the target side of a step. For a prefill chunk it computes
the chunk (and, for the prompt's last chunk, the first output token); for a
generation row it reads the last accepted token and the drafts at absolute
positions ``[n - 1, n - 1 + len(drafts)]`` (``n``: tokens the request holds)
and returns the target's greedy next token at each, so the executor keeps the
leading drafts that match and the next prediction as the bonus token.

* :class:`TargetVerifier`: the tiny target with paged attention over its own
  manager's pages (the executor's default).
* :class:`TruthVerifier`: no target at all; every request carries its
  ground-truth token stream and the target's greedy next token at position
  ``p`` is ``truth[p + 1]``. Acceptance can be capped per step (forced
  rejections), which drafter-only tests use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence, Union

import torch

from tensorrt_llm_draftkv.manager import KVCacheManagerV2
from tensorrt_llm_draftkv.request import LlmRequest, ScheduledRequests
from .features import acceptance
from .target_model import TinyTarget

#: Most drafts a request may accept this step: a mapping (absent: no cap) or a function of the request id.
AcceptCap = Union[Mapping[int, int], Callable[[int], int], None]


@dataclass
class Verdict:
    """One generation row's verification at absolute positions ``n - 1 .. n - 1 + len(drafts)``.

    ``preds[i]``: the target's greedy next token after position ``n - 1 + i``
    (``len(drafts) + 1`` of them); ``accepted``: leading drafts kept, so
    ``preds[: accepted + 1]`` are the tokens the request gains.
    """

    drafts: list[int]
    preds: list[int]
    accepted: int


class Verifier(Protocol):
    """The target side of an executor step (see the module docstring)."""

    manager: KVCacheManagerV2 | None
    model: TinyTarget | None

    def prepare(self, batch: ScheduledRequests) -> None: ...

    def context(self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int) -> int | None: ...

    def verify(self, req: LlmRequest, tokens: torch.Tensor, drafts: Sequence[int]) -> Verdict: ...

    def update(self, batch: ScheduledRequests) -> None: ...

    def release(self, req: LlmRequest) -> None: ...


class TargetVerifier:
    """Greedy verification by the tiny target, whose K/V lives in its own manager's pages."""

    def __init__(self, manager: KVCacheManagerV2, model: TinyTarget) -> None:
        self.manager = manager
        self.model = model
        #: target K/V positions on reused (prefix-hit) pages checked against the request's tokens
        self.reused_positions_checked = 0

    def prepare(self, batch: ScheduledRequests) -> None:
        self.manager.prepare_resources(batch)

    def context(self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int) -> int | None:
        """Target K/V of positions ``[start, end)``; the first output token if the chunk ends the prompt."""
        rid = req.py_request_id
        if start > 0 and start == req.prepopulated_prompt_len:
            # The first chunk after a prefix hit: the reused pages must already hold this prompt's K/V.
            self.reused_positions_checked += self.model.check_reused(rid, tokens, start)
        self.model.write_kv(rid, tokens, start, end)
        if end < req.prompt_len:
            return None
        return self.model.predict(rid, tokens, [req.prompt_len - 1])[0]

    def verify(self, req: LlmRequest, tokens: torch.Tensor, drafts: Sequence[int]) -> Verdict:
        """``tokens[n : n + len(drafts)]`` must hold the drafts already."""
        rid, n = req.py_request_id, req.max_beam_num_tokens
        self.model.write_kv(rid, tokens, n - 1, n + len(drafts))
        preds = self.model.predict(rid, tokens, list(range(n - 1, n + len(drafts))))
        return Verdict(list(drafts), preds, acceptance(drafts, preds))

    def update(self, batch: ScheduledRequests) -> None:
        self.manager.update_context_resources(batch)
        self.manager.update_resources(batch)

    def release(self, req: LlmRequest) -> None:
        if self.manager.has_cache(req.py_request_id):
            self.manager.free_resources(req)


@dataclass
class TruthVerifier:
    """A ground-truth oracle in place of the target: no target cache, no model.

    ``truth[rid]`` is request ``rid``'s whole token stream (prompt first); the
    target's greedy next token at absolute position ``p`` is ``truth[p + 1]``.
    Drafts are verified only where the stream still has a token after them.
    ``accept_cap`` caps how many drafts a request may accept (set per step).
    """

    truth: dict[int, list[int]] = field(default_factory=dict)
    accept_cap: AcceptCap = None
    manager: None = None
    model: None = None

    def prepare(self, batch: ScheduledRequests) -> None:
        pass

    def context(self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int) -> int | None:
        return self.truth[req.py_request_id][req.prompt_len] if end >= req.prompt_len else None

    def verify(self, req: LlmRequest, tokens: torch.Tensor, drafts: Sequence[int]) -> Verdict:
        rid, n = req.py_request_id, req.max_beam_num_tokens
        truth = self.truth[rid]
        if n >= len(truth):
            raise ValueError(f"request {rid}: its truth stream ends at {len(truth)} tokens; it holds {n}")
        drafts = list(drafts)[: len(truth) - n - 1]
        preds = truth[n : n + len(drafts) + 1]
        accepted = acceptance(drafts, preds)
        cap = self.accept_cap
        if cap is not None:
            limit = cap(rid) if callable(cap) else cap.get(rid, accepted)
            accepted = min(accepted, max(int(limit), 0))
        return Verdict(drafts, preds, accepted)

    def update(self, batch: ScheduledRequests) -> None:
        pass

    def release(self, req: LlmRequest) -> None:
        self.truth.pop(req.py_request_id, None)
