"""What demonstrates and tests the library; never imported by it.

A tiny paged target model, a toy DFlash-style drafter that stores and reads its
K/V through the draft pool, an ownership checker with its own page -> owner
map, one executor loop (with a ground-truth oracle variant for drafter-only
tests), a scheduler, disaggregated workers over torch.distributed, the
embedded scenarios, their report, and the command line.
"""
from .toy_drafter import DFlashDrafter, DFlashDrafterConfig
from .engine import Executor, RunStats, StepResult
from .features import TokenFeatures, acceptance, phrase_stream
from .drafter_harness import DraftLoop
from .ownership import OwnershipChecker, OwnershipViolation
from .scenario import DEFAULT_SCENARIO, RunSpec, Scenario, SimSetup
from .scheduler import Scheduler, SchedulerConfig
from .target_model import TinyTarget, TinyTargetConfig, UnbackedAccessError

__all__ = [
    "DEFAULT_SCENARIO",
    "DFlashDrafter",
    "DFlashDrafterConfig",
    "DraftLoop",
    "Executor",
    "OwnershipChecker",
    "OwnershipViolation",
    "RunSpec",
    "RunStats",
    "Scenario",
    "Scheduler",
    "SchedulerConfig",
    "SimSetup",
    "StepResult",
    "TinyTarget",
    "TinyTargetConfig",
    "TokenFeatures",
    "UnbackedAccessError",
    "acceptance",
    "phrase_stream",
]
