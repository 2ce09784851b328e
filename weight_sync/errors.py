"""Errors of the weight path, shared by the trainer side and the rollout side."""


class WeightUpdateError(Exception):
    """A weight update was rejected (validation: nothing was written) or did not complete
    (transfer failure: the engine refuses to generate until a complete update lands)."""
