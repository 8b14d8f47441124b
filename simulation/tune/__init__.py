"""``orchard tune``: federated hyperparameter search, each trial a simulated federation.

| file | the rule it owns |
|---|---|
| ``space.py`` | the ``[tune]`` table: the space, objective, budget; every problem named by its key |
| ``plan.py`` | a study checked before any trial starts (config, space, objective) |
| ``objective.py`` | a trial: one ``run_simulation``, reported each round, pruned mid-run |
| ``study.py`` | Optuna's storage (heartbeats, a dead trial retried once), sampler, pruner, the budget's ledger |
| ``launchers.py`` | where trials run: worker processes, or Ray tasks |
| ``driver.py`` | what runs next, from the storage alone (so a study resumes) |
| ``results.py`` | the live and final tables, PNG plots, the best config |
"""

from orchard.simulation.tune.driver import Progress, StudyOutcome, drive
from orchard.simulation.tune.launchers import make_launcher
from orchard.simulation.tune.plan import plan_study
from orchard.simulation.tune.space import Param, TuneSpec

__all__ = ["Param", "Progress", "StudyOutcome", "TuneSpec", "drive", "make_launcher", "plan_study"]
