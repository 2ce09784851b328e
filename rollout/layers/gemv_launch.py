"""The skinny GEMMs' launch configs (triton_gemv, triton_gemm_tma, gluon_gemm,
triton_qkv_rope): the `Config` of a launch, the table measured on an H200 for the Qwen2-1.5B and
Qwen3-1.7B decode shapes (`_TUNED`, one entry per (rows rounded up to a power of two, N, K,
gated); None: cuBLAS measured faster), what a GPU that cannot run its Gluon entries takes
instead (`GLUON_FALLBACK`), another GPU's table from a file (`load_tuned`,
ROLLOUT_SKINNY_CONFIGS), and for the shapes the table does not list the one-row rule its entries
share (`one_row_rule`) and a heuristic for more rows (`_config`). Plain Python: the kernels are
in triton_gemv."""
from __future__ import annotations

import json
import os
from typing import NamedTuple, Optional

import triton

MAX_M = 16  # rows served without a tuned entry (the heuristic config)
BATCH_MAX_M = 256  # rows served at all: above MAX_M the dot kernel tiles M (decode batches)
FMA_MAX_M = 16
DOT_M = 16  # rows x is padded to in the dot kernel (tl.dot needs >= 16)
MAX_SPLIT_K = 16
NUM_SMS_H200 = 132


class Config(NamedTuple):
    block_n: int  # weight rows per program (per half, for the gated variant)
    block_k: int  # K chunk per loop iteration
    split_k: int = 1  # programs along K (> 1: fp32 partials + a reduce kernel)
    num_warps: int = 4
    dot: bool = False  # tensor-core kernel (M padded to 16) instead of the FMA one
    num_stages: int = 3
    block_m: int = 16  # dot kernel: rows per program (M above it: more programs along M)
    preload: int = 1  # FMA kernel: K chunks of the weight loaded before the PDL wait (1 to 3)
    lookahead: bool = False  # FMA kernel: load the next K chunk before the FMA on this one
    tma: bool = False  # dot kernel: tiles loaded by TMA (triton_gemm_tma)
    swap_ab: bool = False  # TMA kernel: out^T = W x^T (the weight tile on the MMA's M side)
    prefetch_k: int = 0  # TMA kernel: K columns of its weight rows prefetched into L2 before
    # the PDL wait (0: none)
    pipeline: int = 0  # FMA kernel: > 1, its loop after the preloaded chunks as Triton's
    # software pipeline of this many stages (cp.async into shared memory), instead of lookahead
    dot_preload: int = 0  # dot kernel (not TMA): K chunks of the weight loaded before the PDL
    # wait (0 to 3)
    gluon: bool = False  # a GEMM at 17-128 rows as the warp-specialized Gluon kernel
    # (rollout/layers/gluon_gemm.py; Hopper): block_n = a power of two of 64-256 weight rows a
    # program + 0 or a power of two of extra rows (gluon_gemm.tile_rows),
    # num_warps its consumer warps (4 or 8), num_stages its shared-memory ring, preload the
    # stages whose weight tiles load before the PDL wait; other GPUs take GLUON_FALLBACK


# (M, N, K, gated) -> Config, from benchmarks/gpu_gemv.py's sweep on an H200 (N: the weight's
# rows, 2·I for the gated variant). M is looked up rounded up to a power of two.
# None: cuBLAS (+ the separate SiLU kernel, when gated) measured faster, so `supports` says no.
# Measured on one H200 (`bash benchmarks/gpu_suite.sh gemv`, 2026-11-30) for the Qwen2-1.5B
# shapes: one row, and decode batches (used only where an entry here says the kernel wins: for
# the fused gate/up + SiLU keys 64 and 128, i.e. batches of 33-128 rows; for qkv and o keys 32
# to 128 (split along K: o at 32-128, qkv at 32), for down 32 to 128, all with TMA:
# `bash benchmarks/gpu_suite.sh gemm-tma tma10`, thirteenth session `split-norm`; at 65-128
# rows every projection has since moved to the Gluon GEMM, the entries below);
# other shapes take the heuristic. µs per call in a CUDA graph, weights from HBM.
_TMA_QKV_O = Config(32, 128, 1, 4, True, 6, 64, tma=True)
# the Gluon GEMM at 17-64 rows (forty-eighth session): 64 x rows a program (one consumer
# warpgroup), K chunks of 64, six stages, three of them loaded before the PDL wait; each entry
# sets its K split (and down at 17-32 rows its 128 weight rows a program instead of 64)
_GLUON_64_ROWS = Config(64, 64, 1, 4, True, 6, 64, preload=3, gluon=True)
_TUNED: dict[tuple[int, int, int, bool], Optional[Config]] = {
    # qkv and o: the whole weight row block (3 chunks of 512) loaded before the PDL wait, two
    # rows a program (seventh session, in the engine: batch-1 decode graph 1.324 -> 1.278 ms;
    # alone, without preload: qkv 4.0 µs with 4 rows a program, cuBLAS 5.2; o 3.6, cuBLAS 6.5)
    (1, 2048, 1536, False): Config(2, 512, 1, 4, False, 3, preload=3),
    (1, 1536, 1536, False): Config(2, 512, 1, 2, False, 3, preload=3),
    # gate_up + SiLU: K chunks of 512, two of the three loaded before the PDL wait (eighth
    # session, in the engine: batch-1 graph 1.242 ms with the sixth session's (2, 256) -> 1.156;
    # alone 15.4 µs without the preload, cuBLAS + SiLU 18.2), the third issued right after the
    # wait (lookahead; seventeenth session, benchmarks/ab_seventeenth_session_c.json: batch-1
    # decode graph 1.0584 -> 1.0350 ms; it had loaded after the first two chunks' FMAs)
    (1, 17920, 1536, True): Config(2, 512, 1, 2, False, 3, preload=2, lookahead=True),
    (32, 17920, 1536, True): None,  # 26.4 µs vs cuBLAS+SiLU 20.5 (TMA: graph +6% at batch 32)
    # 33-64 rows: TMA-fed, 64 x 32 tiles (ninth session: alone 19.1 µs vs 23.6 for the kernel
    # without TMA, cuBLAS + SiLU 21.2; batch-64 decode graph 1.6905 -> 1.6751 ms on top of TMA
    # qkv/o; now this key's GLUON_FALLBACK). Forty-ninth session: the Gluon GEMM (64 + 8 weight
    # rows a program, one consumer warpgroup, eight stages, all loaded before the PDL wait) once
    # its gate and up rows shared one wgmma: alone 16.25 µs vs 19.03, in the engine the batch-64
    # decode graph 1.4952 -> 1.4881 ms (benchmarks/ab_fortyninth_session.json, two rounds)
    (64, 17920, 1536, True): Config(72, 64, 1, 4, True, 8, 64, preload=8, gluon=True),
    # 65-128 rows (forty-third session): the warp-specialized Gluon kernel, x's rows on wgmma's M
    # side, 64 + 8 weight rows a program (125 programs for the H200's 132 SMs), two consumer
    # warpgroups, six stages, three stages' weights loaded before the PDL wait. Alone 20.2 µs
    # vs 22.3 for the TMA entry it replaced (GLUON_FALLBACK, below; benchmarks/
    # gpu_gluon_gate_up.py); in the engine (benchmarks/ab_fortythird_session.json, _c.json)
    # the batch-128 decode graph 1.7514 -> 1.7222 ms with all six stages' weights early, 1.7463
    # -> 1.7139 with three (1.7331 with none; 4 consumer warps 1.7712). At 33-64 rows its best
    # config (64-row tiles, 8 stages) took 16.85 µs alone against the TMA entry's 19.14 but tied
    # in the engine (batch-64 graph 1.5363 vs 1.5391, _b.json); at 32 rows it did not beat
    # cuBLAS + SiLU (20.44 vs 20.03). Fiftieth session, after the forty-ninth's one wgmma for
    # gate and up: four stages' weights early (benchmarks/ab_fiftieth_session*.json, batch-128
    # graph 1.6522 -> 1.6449, 1.6518 -> 1.6443, 1.6562 -> 1.6488 ms in three A/Bs; five 1.6611).
    (128, 17920, 1536, True): Config(72, 64, 1, 8, True, 6, 128, preload=4, gluon=True),
    (256, 17920, 1536, True): None,  # 40.0 vs 27.1
    # down: the next K chunk's load issued before the FMA on this one, two chunks before the
    # PDL wait (eighth session: alone 9.9 -> 8.7 µs with the lookahead, cuBLAS 10.9; batch-1
    # graph 1.263 -> 1.242 ms with it, then 1.168 -> 1.160 with the preload)
    # Thirteenth session: K split in 2, the partials summed by the residual add + RMSNorm after
    # down (SplitSum): down + add-norm 9.89 µs vs 10.07 unsplit (10.65 with a reduce kernel);
    # batch-1 decode graph 1.1444 -> 1.1392 ms (benchmarks/ab_thirteenth_session.json).
    # Seventeenth session: three chunks a split before the wait (benchmarks/
    # ab_seventeenth_session_e.json: batch-1 decode graph 1.0344 -> 1.0187 ms; four rows a
    # program 1.0739; four chunks, ab_seventeenth_session_f.json, 1.0225 -> 1.1667).
    (1, 1536, 8960, False): Config(2, 512, 2, 4, False, 3, preload=3, lookahead=True),
    # LM head: 107 µs alone, cuBLAS 113. Twenty-first session: its loop as Triton's software
    # pipeline of 3 stages (cp.async; benchmarks/ab_twentyfirst_session_b.json: batch-1 decode
    # graph 1.0118 -> 1.0097 ms; the same for down and gate/up lost 7-16%, their CTA barriers),
    # then 8 rows a program in K chunks of 512 (ab_twentyfirst_session_c/d.json)
    (1, 151936, 1536, False): Config(8, 512, 1, 4, False, 3, pipeline=3),
    # qkv and o at decode batches: the TMA-fed kernel (triton_gemm_tma), 64 x 32 tiles, K chunks
    # of 128, six in flight (ninth session; alone at 128 rows qkv 5.0 µs vs cuBLAS 6.0, o 4.8 vs
    # 5.5; in the engine the decode graph -2.1% at batches 32, 64 and 128,
    # benchmarks/ab_ninth_session_d.json). The fourth session's M-tiled kernel without TMA lost
    # to cuBLAS at every batch (qkv 6.5-8.3 µs vs 5.3-6.1). 256 rows: not measured, cuBLAS.
    # 32 rows: K split in 2, the partials and bias summed by the rotary kernel that reads qkv
    # (thirteenth session, benchmarks/ab_thirteenth_session_f.json: batch-32 decode graph
    # 1.5858 -> 1.5690 ms; at 64 rows a tie, 1.6025 / 1.6024; at 128 slower, 1.8611 -> 1.9218;
    # split in 3 slower at all three)
    # Forty-eighth session: at 17-64 rows the Gluon GEMM too, with 64-row x tiles (one consumer
    # warpgroup; TMA zero-fills the rows past M), split in 3 as at 128 rows; the entries above
    # are now its GLUON_FALLBACK. In the engine (benchmarks/ab_fortyeighth_session*.json, two
    # rounds each) qkv alone: batch-32 decode graph 1.4943 -> 1.4755 ms, batch 64 1.5351 ->
    # 1.5309; with o (and down at 33-64) on it as well: 1.4610 and 1.5002 (split in 4: 1.5118,
    # 1.5902).
    (32, 2048, 1536, False): _GLUON_64_ROWS._replace(split_k=3),
    (64, 2048, 1536, False): _GLUON_64_ROWS._replace(split_k=3),
    # 65-128 rows (forty-fifth session): the Gluon GEMM (x's rows on wgmma's M side), 64 weight
    # rows a program split along K in 3 (32 x 3 = 96 programs), its partials and bias summed by
    # the rotary kernel. Alone 5.60 µs vs 5.93 for the TMA entry it replaced (GLUON_FALLBACK)
    # and 5.73 for cuBLAS (benchmarks/gpu_gluon_gate_up.py --proj qkv); in the engine
    # (benchmarks/ab_fortyfifth_session.json, _b.json) the batch-128 decode graph 1.7040 ->
    # 1.6797 ms (three rounds each, ranges 1.7036-1.7054 and 1.6791-1.6804). On the same kernel
    # o (5.24 vs the table's 5.11) and down (12.91 vs 12.35, cuBLAS 11.98) did not win alone;
    # in the engine they did (their entries below, forty-seventh session).
    (128, 2048, 1536, False): Config(64, 64, 3, 8, True, 6, 128, preload=3, gluon=True),
    (256, 2048, 1536, False): None,
    # o at decode batches split along K, its partials summed by the post-attention add + RMSNorm
    # (thirteenth session, benchmarks/gpu_split_norm.py --shape o: o + add-norm at 32 / 64 / 128
    # rows 5.17 / 5.15 / 5.68 µs vs 5.93 / 5.74 / 5.86 with the unsplit _TMA_QKV_O; in the
    # engine, benchmarks/ab_thirteenth_session_b.json, decode graph batch 32 1.5996 -> 1.5830
    # ms, 64 1.6312 -> 1.5986, 128 1.8728 -> 1.8692). With a reduce kernel they lose.
    # Forty-eighth session: at 17-64 rows the Gluon GEMM split in 4 (the entries above are its
    # GLUON_FALLBACK): with qkv on it, batch-32 decode graph 1.4755 -> 1.4610 ms, batch 64
    # 1.5309 -> 1.5002 (with down at 33-64; benchmarks/ab_fortyeighth_session_b.json).
    (32, 1536, 1536, False): _GLUON_64_ROWS._replace(split_k=4),
    (64, 1536, 1536, False): _GLUON_64_ROWS._replace(split_k=4),
    # 128 rows, forty-seventh session: the Gluon GEMM (64 weight rows a program, K split in 4:
    # 96 programs), alone 5.24 µs vs 5.11 for the TMA entry it replaced (forty-fifth session), in
    # the engine (benchmarks/ab_fortyseventh_session*.json, two rounds each) batch-128 decode
    # graph 1.6779 -> 1.6733 ms, and with down on the Gluon GEMM 1.6609 -> 1.6532.
    (128, 1536, 1536, False): Config(64, 64, 4, 8, True, 6, 128, preload=3, gluon=True),
    (256, 1536, 1536, False): None,
    # down at decode batches of 17-64 rows: TMA-fed, K = 8,960 split in 7 / 5 (fp32 partials
    # summed in split order), 64-row tiles 128 / 64 columns wide (tenth session; alone 10.5 µs
    # vs cuBLAS 11.5 at 32 rows, 10.6 vs 11.6 at 64; in the engine, benchmarks/
    # ab_tenth_session.json, decode graph batch 32 1.6462 -> 1.6173 ms, batch 64 1.6672 ->
    # 1.6492). At 128 rows no config beat cuBLAS (12.0 µs; 12.05 swapped, 12.35 not).
    # Forty-eighth session: at 17-32 rows the Gluon GEMM in the same tiles, 128 weight rows x 7
    # K ranges (84 programs; the entry above is its GLUON_FALLBACK): batch-32 decode graph 1.4582
    # -> 1.4352 ms (benchmarks/ab_fortyeighth_session_d.json; 64 rows x 5, 7 and 11 ranges lost:
    # 1.5198 in _session.json, 1.5410 and 1.5300).
    (32, 1536, 8960, False): _GLUON_64_ROWS._replace(block_n=128, split_k=7),
    # Forty-eighth session: at 33-64 rows the Gluon GEMM split in 5 (the entry above is its
    # GLUON_FALLBACK): batch-64 decode graph 1.5365 -> 1.5285 ms alone, 1.5151 with o, 1.5002
    # with o and qkv (benchmarks/ab_fortyeighth_session.json).
    (64, 1536, 8960, False): _GLUON_64_ROWS._replace(split_k=5),
    # 128 rows: cuBLAS 12.0 µs, the TMA kernel split 5: 12.05-12.35; in the engine (twelfth
    # session, benchmarks/ab_twelfth_session.json) batch-128 graph 1.8896 -> 1.8987 ms with it
    # and its reduce kernel; with its partials summed by the add + norm after it instead
    # (thirteenth session: down + add-norm 12.85 µs vs cuBLAS + add-norm 13.53) 1.8907 ->
    # 1.8690 ms (benchmarks/ab_thirteenth_session.json). Forty-seventh session: the Gluon GEMM
    # (64 weight rows a program, K split in 5: 120 programs, three of six stages' weight tiles
    # before the PDL wait), which alone had lost to that entry (12.91 vs 12.35 µs, forty-fifth
    # session), in the engine (benchmarks/ab_fortyseventh_session.json, two rounds each):
    # batch-128 decode graph 1.6779 -> 1.6601 ms (128 rows x 11 splits: 1.7095). Fiftieth
    # session, with gate/up's four early stages: four of down's too (ab_fiftieth_session_c/d.json:
    # 1.6499 -> 1.6467, 1.6488 -> 1.6440 ms, every round; two 1.6542).
    (128, 1536, 8960, False): Config(64, 64, 5, 8, True, 6, 128, preload=4, gluon=True),
    (256, 1536, 8960, False): None,  # 25.6 vs 17.7
    # Small decode batches, 2-16 rows (a rollout's tail; thirtieth session). Until then every
    # GEMM at 2-16 rows ran on cuBLAS, outside the PDL chain, and a batch-2 decode step cost
    # 1.56 ms against batch 1's 1.00. Swept alone (`gpu_suite.sh small30b`: gpu_gemv.py
    # --small-batches, µs a call, cuBLAS in brackets), then kept where the engine's decode graph
    # gained (`ab30`, benchmarks/ab_thirtieth_session.json; docs/BENCHMARKS.md). 2 rows: the
    # one-row FMA kernels with their preloads for qkv (3.71 [5.20], with the fused rotary + KV
    # store) and o (2.68 [6.37]), gate/up one row a program (17.05 [19.05]). 4 rows: qkv and o
    # the same (5.08 [5.53], 3.00 [6.56]), gate/up on tensor-core tiles (18.30 [19.16]). Down at
    # 2 and 4 rows on tiles split in 14 with two K chunks loaded before the PDL wait
    # (`dot_preload`): 11.00 [10.92] alone, but in the PDL chain the batch-2 graph 1.2993 ->
    # 1.2469 ms, batch 4 1.4107 -> 1.3662. (qkv at 4 rows on the sweep's tiles, 4.90 alone and
    # without the fused rotary: 1.3910 with down on cuBLAS, 1.4080 with down on tiles.) 8 rows:
    # gate/up on tiles (17.50 [19.38]; graph 1.5273 -> 1.4586 ms, twice), the rest on cuBLAS:
    # the sweep's qkv / o and down tiles each gained 1.6% alone, all four together lost 1%
    # (ab_thirtieth_session_c.json). 16 rows: tiles, qkv and o with dot_preload (4.76 [5.53],
    # 4.30 [5.23]), gate/up 15.59 [19.58], down split in 7 10.56 [11.16]. The LM head stays on
    # cuBLAS (at the copy bandwidth) at 2-16 rows.
    (2, 2048, 1536, False): Config(2, 512, 1, 4, False, 3, preload=3),
    (2, 1536, 1536, False): Config(2, 512, 1, 2, False, 3, preload=3),
    (2, 17920, 1536, True): Config(1, 512, 1, 2, False, 3, preload=2, lookahead=True),
    (2, 1536, 8960, False): Config(64, 128, 14, 4, True, dot_preload=2),
    (2, 151936, 1536, False): None,
    (4, 2048, 1536, False): Config(2, 512, 1, 4, False, 3, preload=3),
    (4, 1536, 1536, False): Config(2, 512, 1, 2, False, 3, preload=3),
    (4, 17920, 1536, True): Config(32, 256, 1, 4, True),
    (4, 1536, 8960, False): Config(64, 128, 14, 4, True, dot_preload=2),
    (4, 151936, 1536, False): None,
    (8, 2048, 1536, False): None,
    (8, 1536, 1536, False): None,
    (8, 17920, 1536, True): Config(32, 128, 1, 4, True),
    (8, 1536, 8960, False): None,
    (8, 151936, 1536, False): None,
    (16, 2048, 1536, False): Config(32, 256, 1, 4, True, dot_preload=2),
    (16, 1536, 1536, False): Config(32, 256, 1, 4, True, dot_preload=2),
    (16, 17920, 1536, True): Config(32, 128, 1, 4, True),
    (16, 1536, 8960, False): Config(32, 256, 7, 4, True),
    (16, 151936, 1536, False): None,
    # Qwen3-1.7B (hidden 2,048, 16 / 8 heads of 128, intermediate 6,144; thirty-eighth
    # session): the Qwen2 entries' analogues, measured in the engine only
    # (benchmarks/ab_thirtyeighth_session_b.json, two rounds). One row: the preloading FMA GEMVs
    # and the pipelined LM head, batch-1 decode graph 1.4453 -> 1.2081 ms, 682 -> 805 tok/s.
    # 17-32 rows: qkv, o and down on the TMA kernel, split along K, batch-32 graph 1.9222 ->
    # 1.8811 ms. The same at 128 rows lost (2.7919 -> 2.8918).
    # Fortieth session, in the engine (benchmarks/ab_fortieth_session*.json, two rounds each):
    # down in K chunks of 1,024 unsplit, three before the PDL wait (the thirty-ninth session's
    # one-row sweep, q39gemv1, alone 7.27 µs vs 10.86 for the Qwen2 analogue's 2 splits of
    # chunks of 512): batch-1 decode graph 1.2168 -> 1.1112 ms (one chunk early 1.1262, two
    # 1.1448 vs three 1.1455 in the next A/B, split in 2 1.1698); then qkv on the sweep's tiles
    # (4 rows a program, one chunk of 1,024 early, 2 warps; alone 4.65 vs 6.32 µs) 1.1455 ->
    # 1.1148 (two chunks early 1.1269). o in chunks of 1,024 lost (1.2168 -> 1.2263).
    (1, 4096, 2048, False): Config(4, 1024, 1, 2, False, 3, preload=1),
    (1, 2048, 2048, False): Config(2, 512, 1, 2, False, 3, preload=3),
    (1, 12288, 2048, True): Config(2, 512, 1, 2, False, 3, preload=2, lookahead=True),
    (1, 2048, 6144, False): Config(2, 1024, 1, 4, False, 3, preload=3, lookahead=True),
    (1, 151936, 2048, False): Config(8, 512, 1, 4, False, 3, pipeline=3),
    (32, 4096, 2048, False): _TMA_QKV_O._replace(split_k=2),
    (32, 2048, 2048, False): Config(64, 128, 4, 4, True, 4, 64, tma=True),
    (32, 2048, 6144, False): Config(128, 128, 6, 4, True, 4, 64, tma=True),
    # 33-128 rows (thirty-ninth session): the TMA tiles swept at these shapes (`gpu_gemm_tma.py
    # --model qwen3-1.7b`, µs a call alone, cuBLAS in brackets; docs/figures/
    # q39gemm_qwen3_h200.json). 128 rows: qkv 7.25 [7.61], o 5.70 [6.55], down split in 4 with
    # swapped A/B 11.02 [12.45, + its split-K reduce]; gate/up stays on cuBLAS + SiLU (18.55
    # [19.30 tiled]). In the engine (benchmarks/ab_thirtyninth_session.json) the batch-128 decode
    # graph 2.7999 -> 2.5948 ms (+5.2% tok/s). 64 rows: qkv 6.46 [7.07], o 5.41 [6.15], down
    # split in 4 9.56 [11.18], gate/up + SiLU 17.01 [17.38]; in the engine
    # (ab_thirtyninth_session_b.json) the batch-64 graph 2.2785 -> 2.0116 ms.
    (64, 4096, 2048, False): Config(32, 128, 1, 4, True, 6, 64, tma=True),
    (64, 2048, 2048, False): Config(32, 128, 1, 4, True, 6, 64, tma=True),
    (64, 12288, 2048, True): Config(32, 128, 1, 4, True, 3, 64, tma=True),
    (64, 2048, 6144, False): Config(64, 128, 4, 4, True, 4, 64, tma=True),
    (128, 4096, 2048, False): Config(64, 128, 1, 4, True, 5, 64, tma=True),
    (128, 2048, 2048, False): Config(32, 128, 1, 4, True, 6, 64, tma=True),
    (128, 12288, 2048, True): None,
    (128, 2048, 6144, False): Config(64, 128, 4, 4, True, 4, 128, tma=True, swap_ab=True),
}


BATCH_HEURISTIC = Config(64, 64, 1, 4, True, 3, 64)  # a decode batch: 64-row tensor-core tiles

# What a GPU that cannot run a Gluon entry (no Hopper, or a Triton without Gluon's Hopper module)
# takes instead: the entries they replaced (gate/up at 33-64 rows: the TMA entry above its
# Gluon entry in _TUNED). Gate/up at 65-128 rows: TMA-fed with swapped A/B
# (the weight tile on wgmma's 64-row side, x's 64 rows on the other; tenth session: alone 22.0
# µs vs 22.8 for the kernel without TMA and 23.1 for cuBLAS + SiLU; batch-128 decode graph
# 1.9803 -> 1.9506 ms, benchmarks/ab_tenth_session_b.json), its first 256 columns prefetched
# into L2 before the PDL wait (thirteenth session, with the other 128-row TMA entries'
# prefetches below; benchmarks/ab_thirteenth_session_c.json: batch-128 decode graph 1.8739 ->
# 1.8602 ms with qkv and o whole, gate/up 256 and down 512 columns; qkv and o alone 1.8687;
# gate/up 512 and down whole 1.9546; at 32 and 64 rows every prefetch lost, 0.3-9%).
GLUON_FALLBACK: dict[tuple[int, int, int, bool], Optional[Config]] = {
    # 17-64 rows (forty-eighth session's Gluon entries): the TMA entries they replaced
    (32, 2048, 1536, False): _TMA_QKV_O._replace(split_k=2),
    (64, 2048, 1536, False): _TMA_QKV_O,
    (32, 1536, 1536, False): Config(64, 128, 4, 4, True, 4, 64, tma=True),
    (64, 1536, 1536, False): Config(32, 128, 2, 4, True, 6, 64, tma=True),
    (32, 1536, 8960, False): Config(128, 128, 7, 4, True, 4, 64, tma=True),
    (64, 1536, 8960, False): Config(64, 128, 5, 4, True, 4, 64, tma=True),
    (64, 17920, 1536, True): Config(32, 64, 1, 4, True, 4, 64, tma=True),
    (128, 17920, 1536, True): Config(64, 64, 1, 4, True, 3, 64, tma=True, swap_ab=True,
                                     prefetch_k=256),
    (128, 2048, 1536, False): _TMA_QKV_O._replace(prefetch_k=1536),  # qkv: the whole rows
    (128, 1536, 1536, False): Config(64, 128, 2, 4, True, 4, 64, tma=True, prefetch_k=1536),
    (128, 1536, 8960, False): Config(64, 128, 5, 4, True, 4, 128, tma=True, swap_ab=True,
                                     prefetch_k=512),  # down: L2 prefetch as gate/up's
}


def load_tuned(path: str) -> int:
    """Add the entries of a configs file written by `benchmarks/gpu_gemv.py --configs-out` (a
    list of {M, N, K, gated, config: {...} or null}) to `_TUNED`; returns how many. Read at
    import from ROLLOUT_SKINNY_CONFIGS when set: another GPU's measured table, without a code
    change."""
    with open(path) as f:
        entries = json.load(f)
    for e in entries:
        cfg = e["config"]
        _TUNED[(int(e["M"]), int(e["N"]), int(e["K"]), bool(e["gated"]))] = (
            Config(**cfg) if cfg is not None else None)
    return len(entries)


if os.environ.get("ROLLOUT_SKINNY_CONFIGS"):
    load_tuned(os.environ["ROLLOUT_SKINNY_CONFIGS"])


# One row of a shape the table does not list: "1" (default) the rule its measured one-row
# entries share (`one_row_rule`), "0" the older heuristic below (no weight loaded before the
# PDL wait, no lookahead, no pipelined LM head).
ONE_ROW_RULES = os.environ.get("ROLLOUT_ONE_ROW_RULES", "1")
if ONE_ROW_RULES not in ("1", "0"):
    raise ValueError(f"ROLLOUT_ONE_ROW_RULES={ONE_ROW_RULES!r}: 1 or 0")
VOCAB_ROWS = 32768  # a weight this tall is an LM head (a vocabulary), not a layer's projection


def one_row_rule(N: int, K: int, gated: bool = False) -> Config:
    """The one-row FMA GEMV's config for a shape the table does not list, by the kind of
    projection its shape says it is: the pattern the measured one-row entries of both tuned
    models share (Qwen2-1.5B, Qwen3-1.7B; see `_TUNED`), so that every dense model's batch-1
    decode gets the measured design, not only the benchmarks' shapes. Two weight rows a program
    (two row pairs when gated) whose first K chunks load before the PDL wait:
      * gate/up + SiLU: chunks of 512, two before the wait, the next issued right after it;
      * the LM head (N >= VOCAB_ROWS): 8 rows a program, its loop a 3-stage software pipeline;
      * down-like (K >= 2·N): chunks of 1,024 (512 where K is no multiple of 1,024, the last
        one masked), three before the wait, lookahead, 4 warps, K split in two where the row
        pairs alone leave fewer than 1,024 programs (Qwen2-1.5B's 768) and each split keeps
        >= 4 chunks;
      * qkv / o (the rest): chunks of 512, three before the wait (the whole row at K = 1,536),
        2 warps, lookahead past 4 chunks (at 4 a tie: Qwen3-1.7B's o, fortieth session).
    The measured entries where a sweep found better than the pattern (Qwen2's qkv with 4 warps,
    Qwen3's qkv with 4 rows of 1,024-chunks) stay in the table."""
    if gated:
        return Config(2, _pow2_divisor(K, 512), 1, 2, False, 3, preload=2, lookahead=True)
    if N >= VOCAB_ROWS:
        return Config(8, _pow2_divisor(K, 512), 1, 4, False, 3, pipeline=3)
    if K >= 2 * N:
        block_k = 1024 if K % 1024 == 0 else 512 if K >= 1024 else _pow2_divisor(K, 512)
        split = 2 if N // 2 < 1024 and K // block_k >= 8 else 1
        return Config(2, block_k, split, 4, False, 3, preload=3, lookahead=True)
    block_k = _pow2_divisor(K, 512)
    return Config(2, block_k, 1, 2, False, 3, preload=3, lookahead=K > 4 * block_k)


def _config(M: int, N: int, K: int, gated: bool = False) -> Config:
    """The launch config for an [M, K] x [N, K]^T GEMM (N: all weight rows, 2·I when gated)."""
    tuned = _TUNED.get((triton.next_power_of_2(M), N, K, gated))
    if tuned is not None:
        return tuned
    rows = N // 2 if gated else N  # output columns; a gated program loads 2·block_n rows
    halves = 2 if gated else 1
    if M > DOT_M:
        return BATCH_HEURISTIC
    if M == 1 and ONE_ROW_RULES == "1":
        return one_row_rule(N, K, gated)
    if M == 1:  # FMA: 32 fp32 accumulators a thread, then enough programs to fill the SMs
        block_k = _pow2_divisor(K, 512)
        block_n = max(4, 4096 // block_k // halves)
        while block_n > 4 and triton.cdiv(rows, block_n) < 4 * NUM_SMS_H200:
            block_n //= 2
        dot = False
    else:  # tensor cores, x padded to 16 rows; cp.async pipelines 3 stages of [block_n, block_k]
        block_k = _pow2_divisor(K, 256 if M <= 8 else 128)
        block_n = 64
        while block_n > 16 and triton.cdiv(rows, block_n) < 2 * NUM_SMS_H200:
            block_n //= 2
        dot = True
    # split K (evenly, >= 4 iterations a split) while the N blocks alone leave SMs idle
    programs, chunks, split_k = triton.cdiv(rows, block_n), triton.cdiv(K, block_k), 1
    for s in range(2, MAX_SPLIT_K + 1):
        if programs * split_k >= 2 * NUM_SMS_H200:
            break
        if chunks % s == 0 and chunks // s >= 4:
            split_k = s
    return Config(block_n, block_k, split_k, 4, dot)


def _pow2_divisor(K: int, cap: int) -> int:
    """The largest power of two <= cap dividing K if >= 64 (no K masks), else min(cap, K's)."""
    b = cap
    while b >= 64:
        if K % b == 0:
            return b
        b //= 2
    return min(cap, max(16, triton.next_power_of_2(K)))


def split_k_range(K: int, cfg: Config) -> tuple[int, int]:
    """(programs along K, K a program covers: whole chunks, the last split's range may run past
    K) for a launch config."""
    split = cfg.split_k
    return split, triton.cdiv(triton.cdiv(K, cfg.block_k), split) * cfg.block_k
