"""Split-KV decode attention over the paged KV cache (one new query token per request).

Stage 1: one program per (request, KV head, KV split) scores the query heads of that KV head
(GQA group, padded to BLOCK_H rows so they share one tl.dot and one read of K/V) against its
share of the request's keys, and leaves a normalised partial output plus its log-sum-exp.
Stage 2: one program per (request, head) merges the splits (with one split, stage 1 writes the
output itself and stage 2 does not run). Splitting the keys keeps the GPU
busy when the batch is small and the sequences long; the number of splits is a constant, so
the launch grid depends on the batch size (and, through `DecodeLaunch`, on whether the longest
context is long: a CUDA graph is captured for each) and never on a device value.
`DecodeConfig.per_head` launches decode_head.py's kernel instead (one program per query head;
selectable through ROLLOUT_DECODE_ATTN_CONFIGS, no default launch uses it).

Contract: seq_lens[b] >= 1; request b's token j lives at slot req_to_token[req_pool_indices[b], j]."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from rollout.attention.triton_kernels.common import (block_dmodel, check_kv, dot_precision,
                                                      merge_partial)
from rollout.attention.triton_kernels.decode_head import decode_attention_per_head
from rollout.layers.triton_ops import _COMPILED, bulk_prefetch_l2
from rollout.triton_pdl import launch_options, pdl_wait

BLOCK_N = 32  # keys per inner step (default)
MIN_BLOCK_H = 16  # tl.dot needs at least 16 rows


class DecodeConfig(NamedTuple):
    """Launch parameters of the split (stage 1) kernel. Any value gives the same function; the
    rounding can differ with `block_n` (the online softmax's blocks) and `splits`, not with
    `preload_kv` (the first block's earlier keys and values loaded before the PDL wait) nor with
    `prefetch_l2` (a cache hint)."""
    splits: int = 8
    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 3
    preload_kv: bool = False
    per_head: bool = False  # decode_head.py's kernel: one program per (request, query head,
    # split); a context of up to block_n + 1 keys in the first split alone, no merge; its first
    # block always preloads
    prefetch_l2: bool = False  # before the PDL wait, the programs of the first KV head ask L2
    # for the earlier keys and values of every KV head in their range (up to PREFETCH_KEYS):
    # a hint (the same bits), so that they stream while the kernel before runs


@triton.jit
def _block_probs(q, k_t, n_mask, m_i, l_i, sm_scale, PRECISION: tl.constexpr):
    """One block of keys in the online softmax: (probabilities, new running max, the factor
    that rescales the earlier sums, new running sum)."""
    s = tl.dot(q, k_t, input_precision=PRECISION) * sm_scale
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    return p, m_new, alpha, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _load_k_t(K, slots, kv_head, stride_kt, stride_kh, offs_d, d_mask, mask):
    """Keys at `slots` (where `mask`) as [BLOCK_D, BLOCK_N] (zeros elsewhere)."""
    return tl.load(K + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                   mask=d_mask[:, None] & mask[None, :], other=0.0)


@triton.jit
def _load_v(V, slots, kv_head, stride_vt, stride_vh, offs_d, d_mask, mask):
    """Values at `slots` (where `mask`) as [BLOCK_N, BLOCK_D] (zeros elsewhere)."""
    return tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                   mask=mask[:, None] & d_mask[None, :], other=0.0)


PREFETCH_KEYS = 256  # keys a program's L2 prefetch covers (from its range's start)


@triton.jit
def _decode_partial_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, PartO, PartLse, sm_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    PRELOAD_KV: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_ROW_BYTES: tl.constexpr,
    PREFETCH_KEYS: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    h_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # Before the PDL wait: the step's inputs, written before its first kernel (a step's
    # kernels write neither).
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    first_n = start + tl.arange(0, BLOCK_N)
    first_mask = first_n < end
    if PRELOAD_KV:
        # and the first block's slots (the table is written before the step's first kernel)
        # and its keys and values but the new token's (earlier steps wrote them): these loads
        # stream in while the kernels before this one run; the new token's come after the wait
        first_slots = tl.load(ReqToToken + row * stride_r2t + first_n, mask=first_mask,
                              other=0).to(tl.int64)
        old = first_mask & (first_n < seq_len - 1)
        k_old = _load_k_t(K, first_slots, kv_head, stride_kt, stride_kh, offs_d, d_mask, old)
        v_old = _load_v(V, first_slots, kv_head, stride_vt, stride_vh, offs_d, d_mask, old)
        new_slot = tl.load(ReqToToken + row * stride_r2t + seq_len - 1).to(tl.int64)
    if PREFETCH_ROW_BYTES > 0:
        if kv_head == 0:  # every KV head's row of a slot: the programs of the other heads,
            # which may become resident only after the kernel before ends, find theirs in L2
            pf_n = start + tl.arange(0, PREFETCH_KEYS)
            pf_old = (pf_n < end) & (pf_n < seq_len - 1)
            pf_slots = tl.load(ReqToToken + row * stride_r2t + pf_n, mask=pf_old,
                               other=0).to(tl.int64)
            eb: tl.constexpr = K.dtype.element_ty.primitive_bitwidth // 8
            size = PREFETCH_ROW_BYTES + 0 * pf_n  # a slot's row of every KV head
            bulk_prefetch_l2(K.to(tl.int64) + pf_slots * stride_kt * eb, size, pf_old)
            bulk_prefetch_l2(V.to(tl.int64) + pf_slots * stride_vt * eb, size, pf_old)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    if start < end:  # short sequences leave the last splits empty; stage 2 skips them
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        loop_start = start
        if PRELOAD_KV:  # the first block: the new token's key and value (this step's) put in
            # as two rows loaded beside q (the value's had loaded after the scores, one memory
            # latency later: seventeenth session, batch-1 decode graph ~2% faster without that)
            new = first_mask & (first_n == seq_len - 1)
            k_new = tl.load(K + new_slot * stride_kt + kv_head * stride_kh + offs_d, mask=d_mask,
                            other=0.0)
            v_new = tl.load(V + new_slot * stride_vt + kv_head * stride_vh + offs_d, mask=d_mask,
                            other=0.0)
            k_t = tl.where(new[None, :], k_new[:, None], k_old)
            v = tl.where(new[:, None], v_new[None, :], v_old)
            p, m_i, alpha, l_i = _block_probs(q, k_t, first_mask, m_i, l_i, sm_scale, PRECISION)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            loop_start = start + BLOCK_N
        for n0 in range(loop_start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            # int64: slot * stride can pass 2**31 in a large pool
            slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=n_mask, other=0).to(tl.int64)
            k_t = _load_k_t(K, slots, kv_head, stride_kt, stride_kh, offs_d, d_mask, n_mask)
            p, m_i, alpha, l_i = _block_probs(q, k_t, n_mask, m_i, l_i, sm_scale, PRECISION)
            v = _load_v(V, slots, kv_head, stride_vt, stride_vh, offs_d, d_mask, n_mask)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        out_ptr = PartO + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        if NUM_SPLITS == 1:  # PartO is the output itself: no partials, no merge kernel
            tl.store(out_ptr, (acc / l_i[:, None]).to(PartO.dtype.element_ty),
                     mask=h_mask[:, None] & d_mask[None, :])
        else:
            tl.store(out_ptr, acc / l_i[:, None], mask=h_mask[:, None] & d_mask[None, :])
            tl.store(PartLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log(l_i),
                     mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    PartO, PartLse, SeqLens, O,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    # a step input (written before the step's first kernel): loaded before the wait, the
    # partials' loads that it masks issue at once after it
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        # empty splits were never written (garbage, maybe NaN): they must weigh exactly 0
        valid = split * split_len < seq_len
        lse = tl.load(PartLse + b * stride_lb + head * stride_lh + split, mask=valid,
                      other=float("-inf"))
        part = tl.load(PartO + b * stride_pb + head * stride_ph + split * stride_ps + offs_d,
                       mask=d_mask, other=0.0)
        part = tl.where(valid, part, 0.0)  # not `valid & d_mask`: the interpreter mistypes it
        m_i, l_i, acc = merge_partial(m_i, l_i, acc, lse, part, False)
    tl.store(O + b * stride_ob + head * stride_oh + offs_d, (acc / l_i).to(O.dtype.element_ty),
             mask=d_mask)


LONG_CONTEXT_KEYS = 257  # past this many keys a context is long: more than one block of the
# per-head kernel (256 earlier keys + the new one); a 128 + 128 token run stays short


class DecodeLaunch(NamedTuple):
    """One batch range's decode attention launches: `short` for a batch whose contexts all have at
    most `long_above` keys, `long` (if any) for a batch with a longer one. The grid of a CUDA graph
    is fixed, so decode graphs are captured for each (`launch_classes`) and the batch's longest
    context picks one (`launch_class`)."""
    short: DecodeConfig
    long: Optional[DecodeConfig] = None
    long_above: int = LONG_CONTEXT_KEYS

    def launch_class(self, max_keys: int) -> int:
        """0: `short`; 1: `long` (a batch whose longest context has `max_keys` keys)."""
        return int(self.long is not None and max_keys > self.long_above)

    def launch_classes(self) -> tuple[int, ...]:
        """A longest context for each class (what its decode graph is captured with)."""
        return (1,) if self.long is None else (1, self.long_above + 1)

    def config(self, max_keys: int) -> DecodeConfig:
        return self.long if self.launch_class(max_keys) else self.short

    def capped(self, max_splits: int) -> "DecodeLaunch":
        """Splits capped by the scratch's."""
        def cap(c: Optional[DecodeConfig]) -> Optional[DecodeConfig]:
            return c if c is None else c._replace(splits=min(max_splits, c.splits))
        return self._replace(short=cap(self.short), long=cap(self.long))


LaunchTable = tuple[tuple[int, DecodeLaunch], ...]  # (largest batch, launches), edges ascending


def launch_table_from_env() -> Optional[LaunchTable]:
    """The table in ROLLOUT_DECODE_ATTN_CONFIGS, if set: another GPU's measured configs without
    a code change (read once, by the backend)."""
    spec = os.environ.get("ROLLOUT_DECODE_ATTN_CONFIGS")
    return parse_launch_table(spec) if spec else None


def parse_launch_table(spec: str) -> LaunchTable:
    """A launch table from
    "MAX_BATCH:splits,block_n,warps,stages[,preload_kv[,per_head[,prefetch_l2]]][|LONG];..." (e.g.
    "2:8,32,4,2,1|8,128,4,3,1;256:2,64,2,3"), LONG the same values for a batch whose longest
    context passes LONG_CONTEXT_KEYS (`DecodeLaunch`). Edges should be CUDA-graph sizes (a
    batch and the graph it is padded to then launch alike)."""
    table = []
    for entry in filter(None, spec.replace(" ", "").split(";")):
        try:
            edge, values = entry.split(":")
            short, *long = (_parse_config(v) for v in values.split("|"))
            if len(long) > 1:
                raise ValueError("one long-context config after '|'")
            launch, edge = DecodeLaunch(short, *long), int(edge)
        except (ValueError, TypeError) as e:
            raise ValueError(f"decode attention config {entry!r}: want MAX_BATCH:splits,block_n,"
                             f"warps,stages[,preload_kv[,per_head[,prefetch_l2]]][|LONG] ({e})"
                             ) from None
        if edge < 1:
            raise ValueError(f"decode attention config {entry!r}: MAX_BATCH positive")
        table.append((edge, launch))
    if not table:
        raise ValueError(f"decode attention configs {spec!r}: no entry")
    return tuple(sorted(table))


def _parse_config(text: str) -> DecodeConfig:
    values = [int(v) for v in text.split(",")]
    if not 4 <= len(values) <= len(DecodeConfig._fields):
        raise ValueError(f"{len(values)} values")
    if any(flag not in (0, 1) for flag in values[4:]):
        raise ValueError("preload_kv, per_head and prefetch_l2 are 0 or 1")
    cfg = DecodeConfig(*values[:4], *map(bool, values[4:]))
    if min(cfg[:4]) < 1 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError("positive values, block_n a power of two")
    return cfg


# One request of up to 2 KV heads (Qwen2-1.5B's; other head counts not measured with it), a
# context of up to LONG_CONTEXT_KEYS keys: a program per query head holding all 256 earlier keys
# before the PDL wait, no merge kernel (`decode_launch`: fifty-second session)
PER_HEAD_ONE_REQUEST = DecodeConfig(1, 256, 8, 2, preload_kv=True, per_head=True)


def decode_launch_config(batch: int, max_splits: int = 8, table: Optional[LaunchTable] = None,
                         max_keys: int = 1, *, kv_heads: int) -> DecodeConfig:
    """The launch config for a decode batch on a GPU whose longest context has `max_keys` keys
    (`decode_launch`)."""
    return decode_launch(batch, max_splits, table, kv_heads=kv_heads).config(max_keys)


def decode_launch(batch: int, max_splits: int = 8, table: Optional[LaunchTable] = None, *,
                  kv_heads: int) -> DecodeLaunch:
    """The launches for a decode batch on a GPU (`DecodeLaunch`) of `kv_heads` KV heads (a
    shard's). Splits: many when few requests must fill the GPU, few when the batch alone does
    (then more splits only add programs and merge work). Past 16 requests, a function of the
    programs a split launches (batch x KV heads, `_many_requests`). A function of coarse batch
    ranges whose edges (16, and 64, 128 or 256 over kv_heads) are default CUDA-graph sizes for
    1, 2, 4 or 8 KV heads, so a batch and the graph it is padded to launch alike (graph replay
    == eager, bit for bit), and of the context class (`DecodeLaunch.launch_class`).
    Keys per block and warps from `benchmarks/gpu_attention.py` (H200, Qwen2-1.5B heads, 129-256
    keys; µs per call, split and merge kernels): batch 1 4.62 (the defaults were best), batch 32
    8.46 → 7.43, batch 128 15.26 → 13.84. In the engine (under PDL) batch 1 prefers two stages:
    decode graph 1.1517 → 1.1451 ms (eighth session, `benchmarks/ab_eighth_session_e.json`; the
    same sums, the stages only pipeline the loads); batch 128's alternatives all lost there.
    Above 64 requests one split of 128 keys a step: the split kernel writes the output, no merge
    kernel (eleventh session, in the engine: batch-128 decode graph 1.9470 -> 1.8887 ms,
    `benchmarks/ab_eleventh_session_b.json`; alone it had measured 14.7 vs 12.9 µs with the
    merge kernel still launched after it; at 17-64 requests one split measured mixed:
    `ab_eleventh_session_c.json`). At batch 128 with long contexts (twelfth session, alone,
    `benchmarks/gpu_attention.py --keys`): 1,024-1,536 keys a tie with two splits (47.8 vs 48.1
    µs), 3,072-4,096 keys two splits 3.8% faster (117.3 vs 121.9) — the config stays a function
    of the batch, as a CUDA graph needs. Up to 16 requests the first block's earlier keys and
    values load before the PDL wait (fifteenth session, in the engine at batch 1: decode graph
    1.0896 -> 1.0842 ms, `benchmarks/ab_fifteenth_session_c.json`; 2 splits or one split of 256
    keys with the preload lost, 1.1048 / 1.1630; at 17-64 requests it lost, 1.5527 -> 1.5867 at
    batch 32, `ab_fifteenth_session_b.json`); and above 64 requests (sixteenth session, batch-128
    decode graph 1.8520 -> 1.8323 ms, `ab_sixteenth_session_d.json`; with 64 keys a block,
    1.9422 at 4 warps and 1.9521 at 2). Seventeenth session (`ab_seventeenth_session*.json`):
    the preloaded first block summed after the split's other blocks, so that their loads issue
    right after the wait, lost at batch 128 (decode graph 1.8346 -> 2.2625 ms: its keys and
    values held across the loop spill registers), and so did the first block's slots alone
    before the wait (32: 1.5538 -> 1.5677; 128: 1.9205) and, again, the keys and values
    preloaded at 17-64 requests (batch 32 1.5339 -> 1.5428 with 2 warps, 1.5422 with 4).
    Twenty-third session: decode_head.py's kernel (`per_head`: a program per query head, 256
    keys a block, 8 warps; a context of up to 257 keys in one program and no merge kernel,
    longer ones in 8 splits merged by the last to arrive) is selectable through a table, not a
    default. Alone (`gpu_attention.py`, batch 1, µs a call) 192 keys 3.78 vs 3.55, 650 keys 5.12
    vs 6.02, 3,072 keys 11.7 vs 27.9. In the engine at batch 1 (128 + 128 tokens; decode graph
    ms, `benchmarks/ab_twentythird_session*.json`) it won in processes running batch 1 alone
    (1.0056 -> 0.9997 with one split, 1.0026 -> 1.0018 with 8) and lost in the decode
    benchmark's process of batches 1, 32 and 128 (1.0087 -> 1.0197, 970.7 -> 962.8 tok/s).
    Twenty-fourth session: launches by context length (`DecodeLaunch.long`, decode graphs of
    their own) up to 16 requests: past 257 keys 8 splits of 128-key blocks, 3 stages. Alone
    (`gpu_attention.py --keys`, µs a call, the short config against the long one; `attn24`,
    `attn24d`-`attn24g`): 2,048-4,096 keys at batch 1 28.3 vs 11.5, batch 2 32.6 vs 14.0, batch
    4 34.7 vs 14.6, batch 8 37.3 vs 17.4, batch 16 42.7 vs 22.5; 8,192-16,384 keys at batch 1
    109.2 vs 31.8, batch 2 81.2 vs 25.7; 300-1,000 keys at batch 1 6.00 vs 5.48, batch 4 9.74 vs
    6.90, batch 16 11.81 vs 10.17. The per-head kernel (8 splits) was as fast at batch 1 and
    2-4k keys (11.7 µs; in the engine at ~4k keys 6% faster a step, `long24d`), slower past 8k
    (42.5) and at 2 requests and more, and one kernel more to compile at every start-up (2 s);
    8 splits of 256-key blocks with 8 warps were the fastest at 8-16k keys (25.7) and not
    measured shorter. At 17-32 requests 8 splits of 64 keys won a little (3,000 keys 34.3 vs
    39.0 µs; the engine's batch-32 step 2.457 -> 2.441 ms), not worth a kernel compiled at
    every start-up; at 33-64 the short config stayed the best. In the engine with a 3,968-token
    prompt (decode graph ms, `long24c`): batch 1 2.003 -> 1.365, 2 2.430 -> 1.780, 4 2.485 ->
    1.833, 8 2.485 -> 1.925, 16 2.611 -> 2.118. Thirty-second session: the L2 prefetch of the
    programs' earlier keys and values before the PDL wait (`prefetch_l2`) at 17-32 requests; in
    the engine (`ab_thirtysecond_session_e.json`, `_f.json`) the batch-32 decode graph 1.5040 ->
    1.4826 ms (two rounds; 19,251 -> 19,745 tok/s), while at 64 it lost (1.5279 -> 1.5524) and at
    128 too (1.7484 -> 1.7632 / 1.7896, one round). Forty-sixth session, batch-128 decode graph
    (docs/BENCHMARKS.md): the second block's slots before the wait 1.6835 -> 1.7502 ms, the
    first block's values after it 1.6792 -> 1.7012, the wait inside a pipelined key loop (async
    copies before it) 1.6820 -> 1.7815, qkv's rotary done in this kernel (no rotary kernel
    before it, under whose run the preload overlaps) 1.6792 -> 1.7513. Fifty-second session: the
    per-head kernel at one request of up to 2 KV heads (`PER_HEAD_ONE_REQUEST`), with step graphs
    at batch 1 only (`config.DEFAULT_STEP_GRAPH_MAX_BS`): in the decode benchmark's own run
    beside HF, two rounds, 975.4 / 976.5 -> 981.9 / 987.1 tok/s, batch-1 decode graph 1.0004 ->
    0.9918 ms; with step graphs up to 16 requests it lost in that process shape (engine alone,
    batches 1, 32 and 128: 1.0066 -> 1.0148 ms), as in the twenty-third session."""
    if table:  # another table (`launch_table_from_env`); past its last edge, its last entry
        launch = next((c for edge, c in table if batch <= edge), table[-1][1])
        return launch.capped(max_splits)
    long = DecodeConfig(max_splits, 128, 4, 3, True)
    if batch == 1 and kv_heads <= 2:
        return DecodeLaunch(PER_HEAD_ONE_REQUEST, long)
    if batch <= 16:
        return DecodeLaunch(DecodeConfig(max_splits, num_stages=2, preload_kv=True), long)
    return DecodeLaunch(_many_requests(batch * kv_heads, max_splits))


def _many_requests(programs: int, max_splits: int) -> DecodeConfig:
    """The launch past 16 requests, by the programs a split launches (requests x KV heads: a
    program's work does not depend on the query heads of its KV head, padded to 16 rows
    anyway). Measured with Qwen2-1.5B's 2 KV heads (above) up to 128 requests, i.e. 256
    programs, and with Qwen3-1.7B's 8 (thirty-ninth session; `benchmarks/gpu_attention.py
    --heads 16 8`, µs a call alone, `docs/figures/q39attn*_qwen3_h200.json`; in the engine,
    `benchmarks/ab_thirtyninth_session*.json`, decode graph ms). 32 requests (256 programs): one
    split of 128-key blocks 11.11 against 14.75 for Qwen2's 4 splits of 64 keys, graph 1.9105 ->
    1.8396. 128 requests (1,024 programs): one split of 64-key blocks and 2 warps 30.59 against
    43.88 for 128-key blocks and 4 warps (whose two stages of keys and values, 128 KB, hold one
    program an SM), graph 2.6007 -> 2.2868; 64 requests (512 programs) 2.0167 -> 1.8961. Past
    256 programs the 64-key blocks therefore serve Qwen2's heads too (129-256 requests)."""
    if programs <= 64:
        return DecodeConfig(min(max_splits, 4), block_n=64, num_warps=2, prefetch_l2=True)
    if programs <= 128:
        return DecodeConfig(min(max_splits, 4), block_n=64, num_warps=2)
    if programs <= 256:
        return DecodeConfig(1, block_n=128, num_warps=4, num_stages=2, preload_kv=True)
    return DecodeConfig(1, block_n=64, num_warps=2, num_stages=4)


class DecodeScratch(NamedTuple):
    """Scratch for the split partials, shared by every layer of a forward."""
    part_o: torch.Tensor  # [batch, heads, splits, head_dim] float32 partial outputs
    part_lse: torch.Tensor  # [batch, heads, splits] float32 log-sum-exps
    arrivals: torch.Tensor  # [batch, heads] int32 arrival counters (decode_head.py), 0 between
    # launches: the last program to arrive sets its counter back


def decode_buffers(batch: int, heads: int, head_dim: int, num_splits: int,
                   device: torch.device) -> DecodeScratch:
    """The partials' scratch (`DecodeScratch`). Allocate once per batch (or once for a CUDA
    graph: a graph of fewer requests uses its first rows)."""
    return DecodeScratch(
        torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=device),
        torch.empty(batch, heads, num_splits, dtype=torch.float32, device=device),
        torch.zeros(batch, heads, dtype=torch.int32, device=device))


def _prefetch_row_bytes(config: DecodeConfig, q: torch.Tensor, k_buffer: torch.Tensor,
                        v_buffer: torch.Tensor) -> int:
    """Bytes of a slot's row (all KV heads) the L2 prefetch asks for; 0: no prefetch (not asked,
    not compiled, or rows that are not one contiguous run of KV heads on 16-byte boundaries, the
    bulk prefetch's unit)."""
    if not (config.prefetch_l2 and _COMPILED and q.is_cuda):
        return 0
    row_bytes = k_buffer.shape[1] * k_buffer.shape[2] * k_buffer.element_size()
    for buf in (k_buffer, v_buffer):
        if (buf.stride(2) != 1 or buf.stride(1) != buf.shape[2] or buf.data_ptr() % 16
                or (buf.stride(0) * buf.element_size()) % 16):
            return 0
    return row_bytes if row_bytes % 16 == 0 else 0


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float,
                     config: DecodeConfig = DecodeConfig(),
                     buffers: DecodeScratch | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q [batch, heads, head_dim]; KV buffers [num_slots, kv_heads, head_dim] →
    [batch, heads, head_dim] in q's dtype. `config`: the launch (`decode_launch_config` per
    batch); `buffers` from `decode_buffers` (made here if None), with room for the batch, the
    heads and the config's splits."""
    group = check_kv(q, k_buffer, v_buffer)
    batch, heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    num_splits = config.splits
    scratch = buffers or decode_buffers(batch, heads, head_dim, num_splits, q.device)
    part_o, part_lse, arrivals = scratch
    if part_o.shape[2] < num_splits:
        raise ValueError(f"scratch for {part_o.shape[2]} splits, {num_splits} asked")
    block_d = block_dmodel(head_dim)
    if config.per_head:  # one program per query head (and split): decode_head.py
        if arrivals.shape[0] < batch or arrivals.shape[1] < heads:
            raise ValueError(f"arrival counters for {tuple(arrivals.shape)} (requests, heads), "
                             f"{(batch, heads)} asked")
        return decode_attention_per_head(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
                                         seq_lens, sm_scale, out, scratch, group, block_d, config)
    # one split: the kernel normalises and writes the output itself (what the merge of a single
    # split computes, bit for bit), one kernel instead of two
    direct = num_splits == 1
    dest, dest_strides = (out, (out.stride(0), out.stride(1), 0)) if direct else (
        part_o, (part_o.stride(0), part_o.stride(1), part_o.stride(2)))
    _decode_partial_kernel[(batch, k_buffer.shape[1], num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, dest, part_lse, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        *dest_strides, part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(MIN_BLOCK_H, triton.next_power_of_2(group)), BLOCK_N=config.block_n,
        NUM_SPLITS=num_splits, PRECISION=dot_precision(q.dtype),
        PRELOAD_KV=bool(config.preload_kv), num_warps=config.num_warps,
        num_stages=config.num_stages,
        PREFETCH_ROW_BYTES=_prefetch_row_bytes(config, q, k_buffer, v_buffer),
        PREFETCH_KEYS=PREFETCH_KEYS, **launch_options())
    if direct:
        return out
    _decode_reduce_kernel[(batch, heads)](
        part_o, part_lse, seq_lens, out,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, num_warps=4, **launch_options())
    return out
