"""Weight-sync latency benchmark (`rollout bench weight-sync`).

For each model shape × TP size × bucket size × transport: push new weights N times into a
RolloutController and report p50/p90 end-to-end latency (trainer call → every replica serving
the new version), the phases inside it, effective GB/s, and the raw floor of the same bytes
measured in the same run: a plain broadcast (nccl), one device copy (ipc), a plain read of the
checkpoint files (disk), a plain ray.put + fetch by the shard (tensor).

ipc is the registered path: the warm-up push registers the trainer's tensors (reported as the
`register` and `first_push` phases), the timed pushes send the layout id only — over the
replicas' push channels when they are single-rank (`fast_channel` says whether every timed push
did; `channel_roundtrip` is a no-op message over it, next to `ray_roundtrip`). A bucket size of
0 MiB ("auto") lets the sender choose it from the replicas' free device memory
(`bucket_bytes`/`bucket_source` in the JSON)."""
from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import ray
import torch

from actors.controller import RolloutController
from rollout.config import EngineConfig, ModelConfig
from rollout.tiny_model import TinyModelSpec, hf_config_dict
from weight_sync import WeightSender
from weight_sync.disk import save_atomic

logger = logging.getLogger(__name__)

SHAPES = {
    "tiny": TinyModelSpec(),
    "small": TinyModelSpec(vocab_size=4096, hidden_size=256, intermediate_size=1024,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2),
    "qwen2-0.5b": TinyModelSpec(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                tie_word_embeddings=True),
    "qwen2-1.5b": TinyModelSpec(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                tie_word_embeddings=True),
    "qwen2-7b": TinyModelSpec(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
    # MoE: the experts travel as a trainer holds them, one 3-D tensor per layer and projection
    "tiny-moe": TinyModelSpec(architecture="Qwen3MoeForCausalLM"),
    "qwen3-30b-a3b": TinyModelSpec(architecture="Qwen3MoeForCausalLM", vocab_size=151936,
                                   hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                   num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                   num_experts=128, num_experts_per_tok=8,
                                   moe_intermediate_size=768),
}
CPU_SHAPES, GPU_SHAPES = ("tiny", "small"), ("qwen2-0.5b", "qwen2-1.5b", "qwen2-7b")


@dataclass
class BenchCase:
    transport: str
    shape: str
    tp_size: int
    bucket_mb: int  # 0: auto (chosen from the receivers' free memory)
    bucket_bytes: int = 0  # the bucket size the sender used
    bucket_source: str = ""
    gbytes: float = 0.0
    latency_s: list[float] = field(default_factory=list)
    p50_s: float = 0.0
    p90_s: float = 0.0
    gb_per_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)  # medians
    floor_s: float = 0.0
    floor_what: str = ""
    ratio_to_floor: float = 0.0
    fast_channel: bool = False  # ipc: every timed push went over the push channels (no Ray call)
    error: Optional[str] = None


def model_dir(shape: str, dtype: str, root: Path) -> Path:
    """A config-only model directory (the engine makes dummy weights: nothing to write)."""
    import json
    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_dict(SHAPES[shape])
    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def trainer_weights(path: Path, dtype: torch.dtype, device: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random HF-named full tensors of the model's parameter table, made on the trainer device."""
    from rollout.models.registry import model_class
    cfg = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        table = model_class(cfg.architecture)(cfg).weight_table
    gen = torch.Generator(device).manual_seed(seed)
    return [(name, (torch.randn(table.slots[name].full_shape, generator=gen, device=device)
                     * 0.02).to(dtype))
            for name in table.names()]


def run_case(ctl: RolloutController, case: BenchCase, weights, iters: int, trainer_device: str,
             sync_dir: Path) -> BenchCase:
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    case.gbytes = nbytes / 1e9
    sender = WeightSender(ctl, case.transport, bucket_bytes=(case.bucket_mb << 20) or None,
                          sync_dir=str(sync_dir / case.transport))
    try:
        _sync(trainer_device)
        t0 = time.perf_counter()
        sender.push(weights)  # warm-up: group set-up, ipc registration, allocator, first-touch
        phases: dict[str, list[float]] = {"pack": [], "transfer_and_load": [],
                                          "first_push": [time.perf_counter() - t0]}
        if "register" in sender.last.extra:
            phases["register"] = [sender.last.extra["register"]]
        case.bucket_bytes, case.bucket_source = sender.bucket_bytes or 0, sender.bucket_source
        channel = []
        for _ in range(iters):
            _sync(trainer_device)
            t0 = time.perf_counter()
            sender.push(weights)
            case.latency_s.append(time.perf_counter() - t0)
            phases["pack"].append(sender.last.pack)
            phases["transfer_and_load"].append(sender.last.transfer)
            channel.append("channel" in sender.last.extra)
        case.fast_channel = case.transport == "ipc" and bool(channel) and all(channel)
        for name, vals in ctl.last_update_phases().items():
            phases[name] = [vals]
        phases["ray_roundtrip"] = _ray_roundtrips(ctl, iters)  # context: a no-op call to replica 0
        if case.fast_channel:  # the same for the push channel
            phases["channel_roundtrip"] = [t for t in (ctl.ping_push_channel(0) for _ in range(iters))
                                           if t is not None]
        case.phases_s = {k: statistics.median(v) for k, v in phases.items() if v}
        case.floor_s, case.floor_what = measure_floor(ctl, sender, case.transport, weights,
                                                     trainer_device, sync_dir, iters)
    except Exception as e:  # noqa: BLE001 — one failed case is reported, the rest still run
        logger.exception("case %s failed", case)
        case.error = f"{type(e).__name__}: {e}"
    finally:
        sender.close()
    if case.latency_s:
        lat = sorted(case.latency_s)
        case.p50_s = statistics.median(lat)
        case.p90_s = lat[min(len(lat) - 1, int(round(0.9 * (len(lat) - 1))))]
        case.gb_per_s = case.gbytes / case.p50_s
        case.ratio_to_floor = case.p50_s / case.floor_s if case.floor_s else 0.0
    return case


def _ray_roundtrips(ctl, n: int) -> list[float]:
    leader = ctl.replicas[0].leader
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(leader.update_phases.remote())
        times.append(time.perf_counter() - t0)
    return times


def measure_floor(ctl, sender: WeightSender, transport: str, weights, device: str, sync_dir: Path,
                  iters: int) -> tuple[float, str]:
    """The same bytes moved the plainest way, median of `iters`."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in weights])
    if transport == "disk":  # written once, read `iters` times (page cache, as the shards read)
        save_atomic(weights, sync_dir / "floor")
    times = []
    for _ in range(iters):
        times.append(_floor_once(ctl, sender, transport, flat, weights, device, sync_dir))
    what = {"nccl": "one broadcast of the same bytes", "ipc": "one device copy of the same bytes",
            "disk": "plain read of the same files (page cache)",
            "tensor": "ray.put + fetch by the shard"}[transport]
    return statistics.median(times), what


def _floor_once(ctl, sender, transport, flat, weights, device, sync_dir) -> float:
    if transport == "nccl":
        return ctl.raw_broadcast_floor(sender, flat)
    if transport == "ipc":
        _sync(device)
        t0 = time.perf_counter()
        flat.clone()
        _sync(device)
        return time.perf_counter() - t0
    if transport == "disk":
        path = sync_dir / "floor"
        t0 = time.perf_counter()
        for f in sorted(path.glob("*.safetensors")):
            f.read_bytes()
        return time.perf_counter() - t0
    cpu = flat.cpu()
    t0 = time.perf_counter()
    ref = ray.put(cpu)
    ray.get(ctl.replicas[0].leader.touch.remote([ref]))
    return time.perf_counter() - t0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def run_bench(transports: Sequence[str], shapes: Sequence[str], tp_sizes: Sequence[int],
              bucket_mbs: Sequence[int], iters: int = 5, device: str = "cpu", dtype: str = "float32",
              trainer_device: Optional[str] = None, out_dir: Optional[str] = None,
              progress: bool = True) -> dict:
    from tqdm import tqdm
    root = Path(tempfile.mkdtemp(prefix="ws-bench-"))
    out = Path(out_dir or ".")
    cases = []
    grid = [(s, tp) for s in shapes for tp in tp_sizes]
    bar = tqdm(total=len(grid) * len(bucket_mbs) * len(transports), disable=not progress,
               desc="weight-sync")
    for shape, tp in grid:
        path = model_dir(shape, dtype, root)
        cfg = EngineConfig(model_path=str(path), device=device, dtype=dtype, tp_size=tp,
                           load_format="dummy", kv_cache_tokens=None if device != "cpu" else 4096,
                           mem_fraction=0.5, cuda_graph=False)
        with RolloutController(cfg, num_replicas=1) as ctl:
            for transport in transports:
                tdev = trainer_device or _trainer_device(device, transport)
                weights = trainer_weights(path, cfg.torch_dtype, tdev, seed=1)
                for mb in bucket_mbs:
                    bar.set_postfix_str(f"{shape} tp{tp} {transport} {mb}MiB")
                    cases.append(run_case(ctl, BenchCase(transport, shape, tp, mb), weights, iters,
                                          tdev, root))
                    bar.update(1)
                del weights
    bar.close()
    result = {"device": device, "dtype": dtype, "iters": iters, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "cases": [asdict(c) for c in cases]}
    write_outputs(result, out)
    return result


def _trainer_device(device: str, transport: str) -> str:
    """ipc: the trainer shares the replica's GPU (cuda:0); else it takes the last GPU."""
    if device == "cpu":
        return "cpu"
    return "cuda:0" if transport == "ipc" else f"cuda:{torch.cuda.device_count() - 1}"


def write_outputs(result: dict, out: Path) -> None:
    import json
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "weight_sync.png")
    print_table(result)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for transport in sorted({c["transport"] for c in result["cases"]}):
        rows = sorted((c for c in result["cases"] if c["transport"] == transport and c["p50_s"]),
                      key=lambda c: c["gbytes"])
        if not rows:
            continue
        line, = ax.plot([c["gbytes"] for c in rows], [c["p50_s"] * 1e3 for c in rows], "o-",
                        label=f"{transport} p50")
        ax.plot([c["gbytes"] for c in rows], [c["floor_s"] * 1e3 for c in rows], "--",
                color=line.get_color(), label=f"{transport} floor")
    ax.set_xlabel("weights pushed (GB)")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"weight sync, {result['device']} {result['dtype']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"weight sync ({result['device']}, {result['dtype']})")
    for col in ("transport", "shape", "tp", "bucket MiB", "GB", "p50 ms", "p90 ms", "GB/s",
                "floor ms", "x floor", "channel"):
        table.add_column(col)
    for c in result["cases"]:
        mib = "-" if not c["bucket_bytes"] else f"{c['bucket_bytes'] >> 20}" + ("" if c["bucket_mb"] else " (auto)")
        table.add_row(c["transport"], c["shape"], str(c["tp_size"]), mib,
                      f"{c['gbytes']:.3f}", f"{c['p50_s'] * 1e3:.1f}", f"{c['p90_s'] * 1e3:.1f}",
                      f"{c['gb_per_s']:.1f}", f"{c['floor_s'] * 1e3:.1f}",
                      f"{c['ratio_to_floor']:.2f}" if not c["error"] else c["error"][:40],
                      _channel_cell(c))
    Console().print(table)


def _channel_cell(c: dict) -> str:
    """ipc: whether the push channel carried the timed pushes, and its round trip vs Ray's."""
    if c["transport"] != "ipc":
        return "-"
    if not c.get("fast_channel"):
        return "no (ray)"
    ph = c["phases_s"]
    return f"{ph.get('channel_roundtrip', 0) * 1e3:.2f} ms rt (ray {ph.get('ray_roundtrip', 0) * 1e3:.2f})"
