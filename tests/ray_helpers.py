"""Ray test helpers: a local cluster per test module, and what is left in a cluster."""
from __future__ import annotations

import contextlib
import time

import ray
from ray.util.placement_group import placement_group_table


@contextlib.contextmanager
def local_ray(num_cpus: int):
    """A local Ray cluster for one test module (more CPUs than the machine has is fine: the
    shards are tiny and set one torch thread each)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             logging_level="warning", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def live_objects() -> tuple[frozenset, frozenset]:
    """Ids of the placement groups not removed and of the actors not dead."""
    pgs = frozenset(k for k, v in placement_group_table().items() if v["state"] != "REMOVED")
    # No dashboard in tests, so the state API is out; the GCS table holds the same records.
    actors = frozenset(k for k, v in ray._private.state.actors().items() if v["State"] != "DEAD")
    return pgs, actors


def wait_for_live_objects(expected: tuple[frozenset, frozenset], timeout_s: float = 15.0):
    """Poll until the cluster holds exactly `expected` (kills and removals are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = live_objects()
        if now == expected or time.monotonic() > deadline:
            return now
        time.sleep(0.2)
