"""Health: one status record per replica, from its shards' own reports."""
from __future__ import annotations

from typing import Any

from actors.replica import Replica


def replica_status(replica: Replica, outstanding_work: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """{index, node_id, tp_size, alive, outstanding_work, shards, error}. A replica is alive when
    every shard answers in time and no follower loop has stopped."""
    if not replica.ready:
        return replica_status_unavailable(replica, outstanding_work, "not started or destroyed")
    record = replica_status_unavailable(replica, outstanding_work, None)
    try:
        shards = replica.status(timeout_s)
    except Exception as e:  # a dead actor, or one that did not answer in time
        record["error"] = f"{type(e).__name__}: {e}"
        return record
    record["shards"] = shards
    broken = [s for s in shards if s.get("error") or s.get("serving") is False]
    record["alive"] = not broken
    if broken:
        record["error"] = "; ".join(f"rank {s['rank']}: {s.get('error') or 'follower loop ended'}"
                                    for s in broken)
    return record


def replica_status_unavailable(replica: Replica, outstanding_work: int, error: Any) -> dict[str, Any]:
    """The record of a replica not asked (not alive): no shard reports."""
    return {"index": replica.index, "node_id": replica.node_id, "tp_size": replica.tp_size,
            "outstanding_work": outstanding_work, "alive": False, "shards": [], "error": error}
