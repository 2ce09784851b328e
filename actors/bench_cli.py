"""`rollout bench weight-sync`: registered into the rollout CLI through the `rollout.cli`
entry-point group (rollout itself never imports actors). Also `python -m actors.bench_cli`."""
from __future__ import annotations

import argparse
import sys

from weight_sync.sender import TRANSPORTS


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (weight-sync latency)")
    bsub = bench.add_subparsers(title="benchmarks")
    add_weight_sync_parser(bsub)


def add_weight_sync_parser(sub) -> None:
    w = sub.add_parser("weight-sync", help="weight-sync latency per transport against the wire floor",
                       description="Pushes new weights N times per (transport, model shape, TP size, "
                       "bucket size) into a RolloutController and reports p50/p90 latency, phases, "
                       "GB/s and the raw floor of the same bytes measured in the same run. Writes "
                       "weight_sync.json and weight_sync.png to --out.")
    w.add_argument("--transports", nargs="+", default=None, choices=TRANSPORTS,
                   help="default: all four (ipc on GPU needs the trainer on the replica's GPU)")
    w.add_argument("--shapes", nargs="+", default=None,
                   help="model shapes (default: tiny small on CPU; qwen2-0.5b qwen2-1.5b qwen2-7b on GPU)")
    w.add_argument("--tp-sizes", nargs="+", type=int, default=[1], help="TP sizes of the replica")
    w.add_argument("--bucket-mb", nargs="+", type=_bucket_mb, default=[0], metavar="MiB|auto",
                   help="bucket sizes in MiB; auto (default) lets the sender pick from the replicas' "
                   "free device memory (512 MiB on CPU)")
    w.add_argument("--iters", type=int, default=5, help="timed pushes per case (after one warm-up)")
    w.add_argument("--device", default="cpu", help="cpu or cuda")
    w.add_argument("--dtype", default=None, help="default float32 on CPU, bfloat16 on GPU")
    w.add_argument("--trainer-device", default=None, help="default: cpu; on GPU the last GPU "
                   "(cuda:0 for ipc, colocated with the replica)")
    w.add_argument("--out", default="weight_sync_out", help="output folder")
    w.add_argument("--no-progress", action="store_true")
    w.set_defaults(func=_run)


def _bucket_mb(value: str) -> int:
    """'auto' → 0 (the sender chooses), else a positive number of MiB."""
    if value == "auto":
        return 0
    mb = int(value)
    if mb <= 0:
        raise argparse.ArgumentTypeError(f"bucket size must be a positive number of MiB or auto, got {value}")
    return mb


def _run(a) -> int:
    from actors.weight_sync_bench import CPU_SHAPES, GPU_SHAPES, run_bench
    gpu = a.device.startswith("cuda")
    run_bench(transports=a.transports or list(TRANSPORTS), shapes=a.shapes or (GPU_SHAPES if gpu else CPU_SHAPES),
              tp_sizes=a.tp_sizes, bucket_mbs=a.bucket_mb, iters=a.iters, device=a.device,
              dtype=a.dtype or ("bfloat16" if gpu else "float32"), trainer_device=a.trainer_device,
              out_dir=a.out, progress=not a.no_progress)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rollout")
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
