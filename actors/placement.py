"""Placement: what one replica needs, which node each replica goes to, and its placement group.

Every check here runs before anything is created in the cluster. A replica is one STRICT_PACK
placement group of `tp_size` bundles (1 GPU each, or 1 CPU each on a CPU engine), so a TP group
never spans two nodes; replicas are spread over nodes, fewest replicas per node first."""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from actors.errors import PlacementError
from rollout.config import EngineConfig

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"


def bundle_resource(config: EngineConfig) -> str:
    return "GPU" if config.is_cuda else "CPU"


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    units: float  # total of the bundle resource on the node

    def replica_slots(self, tp_size: int) -> int:
        return int(self.units // tp_size)


def node_capacities(resource: str) -> list[NodeCapacity]:
    """Alive nodes of the connected cluster that have any of `resource`."""
    nodes = [NodeCapacity(n["NodeID"], float(n["Resources"].get(resource, 0.0)))
             for n in ray.nodes() if n.get("Alive")]
    return [n for n in nodes if n.units > 0]


def plan_replica_nodes(num_replicas: int, tp_size: int, resource: str,
                       nodes: list[NodeCapacity]) -> list[str]:
    """The node of each replica: each on one node, spread (fewest replicas per node first).
    Raises PlacementError when the cluster's nodes cannot hold them all, even when empty."""
    slots = {n.node_id: n.replica_slots(tp_size) for n in nodes}
    if sum(slots.values()) < num_replicas:
        have = ", ".join(f"{n.node_id[:8]}: {n.units:g}" for n in nodes) or "none"
        raise PlacementError(
            f"{num_replicas} replica(s) x tp_size={tp_size} need {num_replicas} groups of "
            f"{tp_size} {resource} bundles, each group on one node; the cluster's nodes have "
            f"{resource} [{have}], room for {sum(slots.values())} group(s). Lower num_replicas "
            f"or tp_size, or add nodes.")
    assigned = {n: 0 for n in slots}
    plan = []
    for _ in range(num_replicas):
        free = [n for n in slots if assigned[n] < slots[n]]
        node = min(free, key=lambda n: (assigned[n], -slots[n]))
        assigned[node] += 1
        plan.append(node)
    return plan


def create_placement_group(tp_size: int, resource: str, node_id: str, timeout_s: float,
                           name: str = "") -> PlacementGroup:
    """A STRICT_PACK group of `tp_size` one-unit bundles on `node_id`, ready; or PlacementError
    after `timeout_s` (with the group removed)."""
    bundles = [{resource: 1.0}] * tp_size
    pg = placement_group(bundles, strategy="STRICT_PACK", name=name,
                         **_on_node(node_id, tp_size))
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except BaseException as e:
        remove_placement_group(pg)
        raise PlacementError(
            f"placement group {name or pg.id.hex()} ({tp_size} x {resource} on node "
            f"{node_id[:8]}) was not placed within {timeout_s:g}s: the resources are taken by "
            f"other work or the node left. It was removed. ({type(e).__name__})") from e
    return pg


def _on_node(node_id: str, n: int) -> dict:
    """Pin the bundles to a node: by label (Ray >= 2.4x), else as a soft hint on older Ray."""
    if "bundle_label_selector" in inspect.signature(placement_group).parameters:
        return {"bundle_label_selector": [{NODE_ID_LABEL: node_id}] * n}
    return {"_soft_target_node_id": node_id}
