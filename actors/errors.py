"""Typed errors of the Ray layer. Both are RolloutErrors, so one `except RolloutError` serves."""
from rollout.errors import RolloutError


class PlacementError(RolloutError):
    """The cluster cannot hold the asked replicas (checked before anything is created), or a
    placement group was not placed in time (it is removed before this is raised)."""


class ReplicaError(RolloutError):
    """A replica did not start in time, or one of its shards failed or died."""
