"""Helpers the simulator's tests share (import as `from sim_pkg.sim_support import ...`).

Module-level so that a spawned rank can unpickle the rank builders by name.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from draftkv_sim import SimSetup, phrase_stream

# Chunk 512, windows 256/256, 16-token pages, 64 new tokens: each simulator run takes a fraction of a second.
SMALL = replace(
    SimSetup(),
    chunk=512,
    target_window=256,
    draft_window=256,
    tokens_per_block=16,
    max_new_tokens=64,
    pool_requests=4,
    max_seq_len=8192,
)


def truth(n: int, seed: int = 0) -> list[int]:
    """A ground-truth token stream of repeated phrases (64-token vocabulary)."""
    return phrase_stream(n, vocab_size=64, phrase_len=8, num_phrases=6, seed=seed)


def _digest(t) -> str:
    import hashlib

    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def handoff_probe_rank(rank: int, **build):
    """A disaggregated rank (`sim.simulate._build_rank`) that also records, per request, what crosses the wire.

    Rank 0 (context worker): a digest of every tensor of the drafter context it sends. Rank 1
    (generation worker): whether the pages its drafter wrote while importing are exactly the
    mirror's backed pages below the prompt end, and a digest of what its pool then holds for the
    received range of every group. Both land on the rank's returned stats as `handoff_probe`.
    Module-level (and in `support`) so a spawned rank can unpickle it.
    """
    from draftkv_sim.run_build import build_rank as _build_rank

    executor = _build_rank(rank, **build)
    probe: dict = {}
    speculator = executor.speculator
    if rank == 0:
        export = speculator.export_context

        from draftkv_sim import disagg_transfer

        plan = disagg_transfer.transfer_plan

        def recording_plan(req, ex, hit=None):
            # The pages the one transfer writes hold this (the handshake names them once the hit is known).
            item = plan(req, ex, hit)
            if ex is executor and hit is not None and item.drafter_geometry is not None:
                payload = export(req, ex.tokens[req.py_request_id], item.drafter_geometry, floor=item.drafter_floor)
                probe[req.py_request_id] = [_digest(t) for t in payload]
            return item

        disagg_transfer.transfer_plan = recording_plan
    else:
        drafter, manager = speculator.drafter, executor.draft_manager
        imported = speculator.import_context

        def checking_import(request_id, prompt_len, geometry, payload, *, floor=0, **seed):
            pages: set[int] = set()
            write = drafter._write_for

            def spy(rid, gi, positions, ordinals, pg, offsets, kv, owned_row):
                pages.update(int(p) for p in pg[offsets.long() >= 0].tolist())
                return write(rid, gi, positions, ordinals, pg, offsets, kv, owned_row)

            drafter._write_for = spy
            try:
                seeded = imported(request_id, prompt_len, geometry, payload, floor=floor, **seed)
            finally:
                del drafter._write_for  # back to the class's method
            P = manager.tokens_per_block
            backed = {
                p for g in range(manager.num_pools)
                for i, p in enumerate(manager.get_cache(request_id).block_row(g)) if p >= 0 and i * P < prompt_len
            }
            read_back = [
                _digest(drafter.read_stored(request_id, g, *geometry.group_range(g, prompt_len)))
                for g in range(geometry.num_groups)
            ]
            probe[request_id] = (pages == backed, len(backed), read_back)
            return seeded

        speculator.import_context = checking_import
    _attach_to_stats(executor, "handoff_probe", probe)
    return executor


def _attach_to_stats(executor, field: str, value) -> None:
    """Make the stats `executor.run` and `executor.finish` return carry `value` as `field`."""
    for name in ("run", "finish"):
        original = getattr(executor, name)

        def with_value(*args, _original=original, **kwargs):
            stats = _original(*args, **kwargs)
            setattr(stats, field, value)
            return stats

        setattr(executor, name, with_value)


def _adopted_digests(executor, rid: int, prompt_len: int, hit: int, drafter_hit: int) -> list[str]:
    """Digests of what `executor`'s pools hold, through request `rid`'s rows, for the positions a generation
    worker adopts at a hit of `hit` tokens: per target group `[start, hit)` with `start` the first position its
    window still reads at the prompt end (0 under full attention); with a drafter hit, per draft group the
    drafter context `[seed start, drafter_hit)`."""
    import torch

    out = []
    P = executor.target_manager.tokens_per_block
    for g, group in enumerate(executor.target_manager.layer_groups):
        lo, hi = group.life_cycle.stale_range(prompt_len, P)
        start = hi * P if hi > lo else 0
        if hit > start:
            out.append(_digest(torch.cat(executor.target_model.read_kv(rid, start, hit, g))))
    if drafter_hit:
        speculator = executor.speculator
        lo = speculator.handoff_geometry().seed_start(prompt_len)
        out += [_digest(speculator.drafter.read_stored(rid, gi, lo, drafter_hit)) for gi in range(speculator.drafter.num_groups)]
    return out


def _install_reuse_probes() -> None:
    """Wrap `disagg.transfer_plan` (context worker, when it learns the hit) and `disagg.finish_admission`
    (generation worker, after admission) once per process; they record only for an executor carrying a
    `reuse_probe` dict, so ranks kept across runs are not disturbed."""
    from draftkv_sim import disagg_transfer as disagg

    if getattr(disagg.transfer_plan, "reuse_probe", False):
        return
    transfer_plan, finish_admission = disagg.transfer_plan, disagg.finish_admission

    def recording_transfer(req, ex, hit=None):
        probe = getattr(ex, "reuse_probe", None)
        if probe is not None and hit is not None and hit.tokens:
            probe[req.py_request_id] = (
                hit.tokens, hit.drafter_tokens,
                _adopted_digests(ex, req.py_request_id, req.prompt_len, hit.tokens, hit.drafter_tokens),
            )
        return transfer_plan(req, ex, hit)

    def recording_admit(admission, ex, **kwargs):
        req = finish_admission(admission, ex, **kwargs)
        item = admission.item
        probe = getattr(ex, "reuse_probe", None)
        if probe is not None:
            digests = _adopted_digests(ex, item.request_id, item.prompt_len, item.gen_reused_tokens,
                                       item.gen_drafter_reused) if item.gen_reused_tokens else []
            probe[item.request_id] = (item.gen_reused_tokens, item.gen_drafter_reused, digests, list(item.group_lo))
        return req

    recording_transfer.reuse_probe = True
    disagg.transfer_plan, disagg.finish_admission = recording_transfer, recording_admit


def reuse_probe_rank(rank: int, **build):
    """A disaggregated rank (`sim.simulate._build_rank`) that records, per request with a generation-worker
    prefix hit, digests of the K/V adopted instead of received: rank 0 of what its own pools hold for those
    positions when it learns the hit, rank 1 of what its adopted pages hold after admission (rank 1 also
    records every request's hit and the target K/V starts it received, `group_lo`). Both land on the rank's
    returned stats as `reuse_probe`. Module-level (and in `support`) so a spawned rank can unpickle it."""
    from draftkv_sim.run_build import build_rank as _build_rank

    _install_reuse_probes()
    executor = _build_rank(rank, **build)
    executor.reuse_probe = probe = {}
    _attach_to_stats(executor, "reuse_probe", probe)
    return executor


def _pool_digest(executor) -> str:
    """One digest over every layer of every pool of both managers (the bytes as they are)."""
    import hashlib

    h = hashlib.sha256()
    for manager in (executor.target_manager, executor.draft_manager):
        for group in manager.layer_groups if manager is not None else ():
            for layer in group.pool.layers:
                h.update(layer.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def random_pools_rank(rank: int, **build):
    """A disaggregated rank whose pools start with fresh random contents (seeded by rank, never zeros); the
    generation worker records a digest of all its pools after each request's transfer landed and was admitted
    (`pool_digests` on its stats: request id -> digest). Module-level so a spawned rank can unpickle it."""
    from draftkv_sim import disagg_transfer
    from draftkv_sim.run_build import build_rank as _build_rank

    executor = _build_rank(rank, **build)
    gen = torch.Generator().manual_seed(1000 + rank)
    for manager in (executor.target_manager, executor.draft_manager):
        for group in manager.layer_groups if manager is not None else ():
            for layer in group.pool.layers:
                layer.copy_(torch.rand(layer.shape, generator=gen, dtype=torch.float64).to(layer.dtype) + 1.0)
    digests: dict = {}
    _attach_to_stats(executor, "pool_digests", digests)
    if rank == 1:
        finish = disagg_transfer.finish_admission

        def recording_finish(admission, ex, **kwargs):
            req = finish(admission, ex, **kwargs)
            if ex is executor:
                digests[req.py_request_id] = _pool_digest(ex)
            return req

        disagg_transfer.finish_admission = recording_finish
    return executor


def faulty_transfer_rank(rank: int, fault: str, request_id: int, timeout_s: float, **build):
    """A disaggregated rank with one fault injected: rank 0's agent posts request `request_id`'s transfer
    without its notification (`drop_sync`) or with a destination outside the peer's registered memory
    (`bad_desc`); rank 1 waits `timeout_s` for a transfer. Module-level so a spawned rank can unpickle it."""
    from dataclasses import replace as _replace

    from draftkv_sim.run_build import build_rank as _build_rank
    from tensorrt_llm_draftkv.transfer import MemoryDescs, NixlTransferAgent, TorchWireAgent

    executor = _build_rank(rank, **build)
    executor.transfer_timeout_s = timeout_s
    if rank == 0:
        target = f"request {request_id}".encode()
        for cls in (NixlTransferAgent, TorchWireAgent):
            submit = cls.submit_transfer_requests

            def faulty(self, request, _submit=submit):
                if request.sync_message == target and fault == "drop_sync":
                    request = _replace(request, sync_message=b"")
                elif request.sync_message == target and fault == "bad_desc":
                    dst = request.dst_descs.descs.copy()
                    dst[0, 0] += 1 << 44  # far past anything the peer registered
                    request = _replace(request, dst_descs=MemoryDescs(request.dst_descs.type, dst))
                return _submit(self, request)

            cls.submit_transfer_requests = faulty
    return executor
