"""actors: the Ray layer. RolloutController (data-parallel replicas), Replica (one TP group in
one placement group), RolloutShard (one TP rank)."""
from actors.controller import RolloutController
from actors.errors import PlacementError, ReplicaError
from actors.replica import Replica, check_tp_size
from actors.shard import RolloutShard, RolloutShardActor

__all__ = ["RolloutController", "Replica", "RolloutShard", "RolloutShardActor", "PlacementError",
           "ReplicaError", "check_tp_size"]
