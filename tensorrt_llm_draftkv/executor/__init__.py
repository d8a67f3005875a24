"""The executor: scheduling, the tiny paged target, the drafter adapter, disaggregated workers, scenarios."""
from .engine import Executor, RunStats
from .scenario import DEFAULT_SCENARIO, RunSpec, Scenario, SimSetup
from .scheduler import Scheduler, SchedulerConfig
from .target_model import TinyTarget, TinyTargetConfig, UnbackedAccessError

__all__ = [
    "DEFAULT_SCENARIO",
    "Executor",
    "RunSpec",
    "RunStats",
    "Scenario",
    "Scheduler",
    "SchedulerConfig",
    "SimSetup",
    "TinyTarget",
    "TinyTargetConfig",
    "UnbackedAccessError",
]
