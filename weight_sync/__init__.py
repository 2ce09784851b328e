"""weight_sync: the bucket format, the trainer-side WeightSender, the rollout-side
WeightUpdater and the transports (disk, NCCL/gloo broadcast, tensor passing, CUDA IPC / shared
memory). Knows torch and safetensors only, never `rollout` or `actors`."""
from weight_sync.bucket import Bucket, BucketMeta, UpdateManifest, pack_buckets, plan_buckets
from weight_sync.errors import WeightUpdateError
from weight_sync.ipc_layout import IpcLayout, IpcLayoutRef, IpcLayoutUnknownError
from weight_sync.process_group import GroupAddress
from weight_sync.sender import TRANSPORTS, WeightSender
from weight_sync.spec import TensorSpec

__all__ = ["WeightSender", "WeightUpdateError", "Bucket", "BucketMeta", "UpdateManifest",
           "pack_buckets", "plan_buckets", "GroupAddress", "TensorSpec", "TRANSPORTS", "IpcLayout",
           "IpcLayoutRef", "IpcLayoutUnknownError"]
