"""What demonstrates and tests the library; never imported by it.

A tiny paged target model, a toy DFlash-style drafter that stores and reads its
K/V through the draft pool, an ownership checker with its own page -> owner
map, one executor loop (with a ground-truth oracle variant for drafter-only
tests), a scheduler, disaggregated workers over torch.distributed, the
embedded scenarios, their report, and the command line.
"""
from __future__ import annotations

import importlib
from typing import Any

# Each public name and the module it lives in. Loaded on first use (PEP 562), so `import draftkv_sim`
# stays cheap until a name is read: the command line's `--version` never loads torch.
_EXPORTS: dict[str, str] = {
    "DEFAULT_SCENARIO": ".scenario",
    "DFlashDrafter": ".toy_drafter",
    "DFlashDrafterConfig": ".toy_drafter",
    "DraftLoop": ".drafter_harness",
    "Executor": ".engine",
    "OwnershipChecker": ".ownership",
    "OwnershipViolation": ".ownership",
    "RunSpec": ".scenario",
    "RunStats": ".engine",
    "Scenario": ".scenario",
    "Scheduler": ".scheduler",
    "SchedulerConfig": ".scheduler",
    "SimSetup": ".scenario",
    "StepResult": ".engine",
    "TinyTarget": ".target_model",
    "TinyTargetConfig": ".target_model",
    "TokenFeatures": ".features",
    "UnbackedAccessError": ".target_model",
    "acceptance": ".features",
    "phrase_stream": ".features",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later reads skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
