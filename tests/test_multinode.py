"""Spec for placement over several nodes, simulated with ray.cluster_utils.Cluster: a head with
no CPUs and two worker nodes of 4 CPUs. Two TP=2 replicas could share one node, yet land on
two (spread), each TP group on one node; five replicas do not fit and are refused before
anything is created."""
from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from actors import PlacementError, RolloutController
from actors.placement import NodeCapacity, plan_replica_nodes
from rollout import Engine, EngineConfig, SamplingParams
from tests.ray_helpers import live_objects

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_node_cluster():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=4, resources={f"worker_{i}": 1}) for i in range(2)]
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    cluster.wait_for_nodes()
    yield {n.node_id for n in nodes}
    ray.shutdown()
    cluster.shutdown()


def test_replicas_spread_over_nodes_and_tp_groups_stay_on_one(tiny_dirs, two_node_cluster):
    cfg = EngineConfig(model_path=tiny_dirs["LlamaForCausalLM"], kv_cache_tokens=2048, tp_size=2)
    with RolloutController(cfg, num_replicas=2) as ctl:
        per_replica = [set(r.node_ids()) for r in ctl.replicas]
        assert all(len(nodes) == 1 for nodes in per_replica)  # a TP group never spans nodes
        assert set.union(*per_replica) == two_node_cluster  # one replica per worker node
        prompts = [[3, 14, 15], [92, 65, 35], [46, 7], [26, 43]]
        sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4)
        single = Engine(EngineConfig(model_path=cfg.model_path, kv_cache_tokens=2048))
        assert [o.token_ids for o in ctl.generate(prompts, sp)] == \
            [o.token_ids for o in single.generate(prompts, sp)]


def test_a_replica_that_fits_no_node_is_refused(tiny_dirs, two_node_cluster):
    before = live_objects()
    cfg = EngineConfig(model_path=tiny_dirs["Qwen3ForCausalLM"], kv_cache_tokens=2048, tp_size=2)
    with pytest.raises(PlacementError, match="room for 4 group"):
        RolloutController(cfg, num_replicas=5)  # 5 groups of 2 CPUs; each node holds two
    assert live_objects() == before


def test_plan_fills_the_emptiest_node_first():
    nodes = [NodeCapacity("a", 8), NodeCapacity("b", 4), NodeCapacity("c", 1)]
    assert plan_replica_nodes(4, 2, "GPU", nodes) == ["a", "b", "a", "b"]
    assert plan_replica_nodes(5, 2, "GPU", nodes) == ["a", "b", "a", "b", "a"]
    with pytest.raises(PlacementError):
        plan_replica_nodes(7, 2, "GPU", nodes)
