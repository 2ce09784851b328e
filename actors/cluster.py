"""Connecting to Ray: a running cluster when one is named, else a local one."""
from __future__ import annotations

import logging
import os
from typing import Optional

import ray

logger = logging.getLogger(__name__)


def connect(address: Optional[str] = None, *, min_cpus: int = 1) -> bool:
    """Make sure this process is connected to Ray. Uses, in order: the current connection,
    `address`, $RAY_ADDRESS; else starts a local cluster with at least `min_cpus` CPUs (so
    CPU shards fit even when that is more than the machine's cores). Returns True when it
    started Ray itself (the caller then shuts it down)."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address)
        return True
    num_cpus = max(os.cpu_count() or 1, min_cpus)
    logger.info("starting a local Ray cluster with %d CPUs", num_cpus)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    return True
