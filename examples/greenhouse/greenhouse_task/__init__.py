"""A user's own Orchard task: crop conditions from greenhouse sensors, one client per
greenhouse. See docs/your-task.md in Orchard's repository."""

from greenhouse_task.task import CONDITIONS, GreenhouseNet, build

__all__ = ["CONDITIONS", "GreenhouseNet", "build"]
