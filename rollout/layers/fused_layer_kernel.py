"""One decoder layer at batch 1 as one persistent Triton kernel (the kernel; `fused_layer` launches it).

Why: a one-row decode step is a chain of ~9 kernels a layer. The four GEMVs stream 93 MB a layer
(22 µs at the copy bandwidth), but between them sit the norms, rotary, attention and its merge:
each waits for its predecessor's last write and holds the weight stream back (41 µs a layer
measured with PDL). Here every program of one resident grid walks the layer's five phases, so
a dependency costs a grid barrier (a counter in L2) instead of a kernel's drain and launch:

  A  r1 = h + residual; x = rmsnorm(r1) (every program computes the norm's scale itself);
     qkv = x Wqkvᵀ + b, rows split over the programs                          → barrier
  B  attention, one item per (KV head, KV split): q and the new key rotated in registers, the
     new key and value used in place of their cache slot and stored to it; the last item of a
     KV head to finish merges that head group's splits                        → barrier
  C  o = att Woᵀ; r2 = o + r1 (the layer's residual out)                        → barrier
  D  x2 = rmsnorm(r2); act = silu(x2 Wgateᵀ) · (x2 Wupᵀ)                        → barrier
  E  h_out = act Wdownᵀ

Each GEMV phase is one flat stream of [BN, BK] weight tiles over the program's rows and all of
K, pipelined by Triton (cp.async stages: no stall at row-block edges). Rounding follows
the unfused kernels (triton_ops, triton_gemv, the decode attention): every tensor the unfused
path materialises in the model's dtype is rounded here too; the sums run in fp32 in another order
(GEMV chunks of BK, the splits merged in one weighted sum), so outputs match the unfused path to
rounding, not bit for bit.

SYNC=False compiles no barrier: the launcher then runs the phases as separate launches
(FIRST == LAST), which is how the CPU interpreter runs it, one program at a time."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from rollout.layers.grid_sync import arrive, grid_barrier
from rollout.layers.triton_ops import _round
from rollout.triton_pdl import pdl_wait

CTR_SLOTS = 16  # int32 counters a layer: [0] the grid barrier, [1 + g] KV head g's arrivals

# epilogues of the GEMV phases
EPI_QKV, EPI_RESIDUAL, EPI_GATED, EPI_PLAIN = 0, 1, 2, 3


@triton.jit
def _row_range(N):
    """This program's rows [row0, row1) of an N-row weight (empty past the end)."""
    per = tl.cdiv(N, tl.num_programs(0))
    row0 = tl.program_id(0) * per
    return row0, tl.minimum(row0 + per, N)


@triton.jit
def _num_tiles(row0, row1, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    return tl.cdiv(tl.maximum(row1 - row0, 0), BN) * tl.cdiv(K, BK)


@triton.jit
def _tile(W, row0, row1, t, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Weight tile t of the program's stream: row block t // (K / BK), K chunk t % (K / BK)."""
    n_kc: tl.constexpr = (K + BK - 1) // BK
    rows = row0 + (t // n_kc) * BN + tl.arange(0, BN)
    ks = (t % n_kc) * BK + tl.arange(0, BK)
    mask = (rows < row1)[:, None] & (ks < K)[None, :]
    return tl.load(W + rows.to(tl.int64)[:, None] * K + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _row_scale(A, B, HAS_B: tl.constexpr, inv_n, eps, N: tl.constexpr, BLOCK: tl.constexpr,
               COMPILED: tl.constexpr):
    """(rsqrt(mean(r²) + eps), r) for the row r = A (+ B, rounded) as the RMSNorm kernel."""
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    r = tl.load(A + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if HAS_B:
        b = tl.load(B + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        r = _round(r + b, A.dtype.element_ty, COMPILED)
    var = tl.sum(r * r, axis=0) * inv_n
    if COMPILED:
        scale = libdevice.rsqrt(var + eps)
    else:
        scale = tl.math.rsqrt(var + eps)
    return scale, r


@triton.jit
def _normed_row(A, B, HAS_B: tl.constexpr, NW, XN, inv_n, eps, N: tl.constexpr,
                BLOCK: tl.constexpr, COMPILED: tl.constexpr):
    """RMSNorm of the row A (+ B, rounded) into XN (the program's own copy, read back by its
    GEMV); returns the row r."""
    scale, r = _row_scale(A, B, HAS_B, inv_n, eps, N, BLOCK, COMPILED)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = XN.dtype.element_ty
    w = tl.load(NW + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(XN + offs, _round(_round(r * scale, dt, COMPILED) * w, dt, COMPILED), mask=mask)
    tl.debug_barrier()  # the row is the whole program's input
    return r


@triton.jit
def _silu_mul(gate, up, dt: tl.constexpr, COMPILED: tl.constexpr):
    if COMPILED:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    return _round(_round(tl.math.div_rn(gate, 1.0 + e), dt, COMPILED) * up, dt, COMPILED)


@triton.jit
def _gemv_epilogue(acc, acc_up, rows, row1, OUT, AUX, EPI: tl.constexpr, HAS_AUX: tl.constexpr,
                   COMPILED: tl.constexpr):
    """Finished rows of a GEMV phase: rounded as the unfused kernels round, stored to OUT."""
    mask = rows < row1
    dt = OUT.dtype.element_ty
    if EPI == 0:  # EPI_QKV: + bias
        if HAS_AUX:
            acc += tl.load(AUX + rows, mask=mask, other=0.0).to(tl.float32)
        out = _round(acc, dt, COMPILED)
    elif EPI == 1:  # EPI_RESIDUAL: the projection rounded, then + the residual, rounded
        res = tl.load(AUX + rows, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        out = _round(_round(acc, dt, COMPILED) + res, dt, COMPILED)
    elif EPI == 2:  # EPI_GATED
        out = _silu_mul(_round(acc, dt, COMPILED), _round(acc_up, dt, COMPILED), dt, COMPILED)
    else:
        out = _round(acc, dt, COMPILED)
    tl.store(OUT + rows, out, mask=mask)


@triton.jit
def _gemv_phase(W, W_UP, row0, row1, X, OUT, AUX, K: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, STAGES: tl.constexpr, EPI: tl.constexpr, HAS_AUX: tl.constexpr,
                COMPILED: tl.constexpr):
    """OUT[row0:row1] = the program's rows of W times the row X, from a stream of [BN, BK]
    weight tiles. STAGES > 1: Triton pipelines the loop (cp.async copies of the next tiles
    into shared memory); STAGES == 1: plain loads straight into registers, the next tile's
    issued before this one is used, and x loaded in the tile's own layout (no shared memory, no
    CTA barrier in the loop)."""
    n_kc: tl.constexpr = (K + BK - 1) // BK
    n_tiles = _num_tiles(row0, row1, K, BN, BK)
    # products summed elementwise, reduced across K once a row block is done: no cross-warp
    # reduction (and its CTA barrier) in every step of the stream
    acc = tl.zeros([BN, BK], tl.float32)
    acc_up = tl.zeros([BN, BK], tl.float32)
    if STAGES > 1:
        for t in tl.range(0, n_tiles, num_stages=STAGES):
            kc = t % n_kc
            ks = kc * BK + tl.arange(0, BK)
            x = tl.load(X + ks, mask=ks < K, other=0.0, cache_modifier=".cg").to(tl.float32)
            acc += _tile(W, row0, row1, t, K, BN, BK).to(tl.float32) * x[None, :]
            if EPI == 2:
                acc_up += _tile(W_UP, row0, row1, t, K, BN, BK).to(tl.float32) * x[None, :]
            if kc == n_kc - 1:
                rows = row0 + (t // n_kc) * BN + tl.arange(0, BN)
                _gemv_epilogue(tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), rows, row1, OUT,
                               AUX, EPI, HAS_AUX, COMPILED)
                acc = tl.zeros([BN, BK], tl.float32)
                acc_up = tl.zeros([BN, BK], tl.float32)
    else:
        last = tl.maximum(n_tiles - 1, 0)
        w_next = _tile(W, row0, row1, 0, K, BN, BK)
        wu_next = w_next
        if EPI == 2:
            wu_next = _tile(W_UP, row0, row1, 0, K, BN, BK)
        col = tl.arange(0, BK)[None, :] + tl.zeros([BN, 1], tl.int32)  # x in the tile's layout
        for t in range(0, n_tiles):
            w, wu = w_next, wu_next
            w_next = _tile(W, row0, row1, tl.minimum(t + 1, last), K, BN, BK)  # the last: L2 hit
            if EPI == 2:
                wu_next = _tile(W_UP, row0, row1, tl.minimum(t + 1, last), K, BN, BK)
            kc = t % n_kc
            ks = kc * BK + col
            x = tl.load(X + ks, mask=ks < K, other=0.0, cache_modifier=".cg").to(tl.float32)
            acc += w.to(tl.float32) * x
            if EPI == 2:
                acc_up += wu.to(tl.float32) * x
            if kc == n_kc - 1:
                rows = row0 + (t // n_kc) * BN + tl.arange(0, BN)
                _gemv_epilogue(tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), rows, row1, OUT,
                               AUX, EPI, HAS_AUX, COMPILED)
                acc = tl.zeros([BN, BK], tl.float32)
                acc_up = tl.zeros([BN, BK], tl.float32)


@triton.jit
def _rotated(ROW, COS, SIN, offs_d, HALF: tl.constexpr, mask, COMPILED: tl.constexpr):
    """rotate-half rope of the head rows at ROW + offs_d (full head dim), rounded as the rotary
    kernel: x·cos and partner·(∓sin) each rounded, then their sum."""
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    d_mask = offs_d < 2 * HALF
    cos = tl.load(COS + offs_d % HALF, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + offs_d % HALF, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.where(first, -sin, sin)
    x = tl.load(ROW + offs_d, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    xp = tl.load(ROW + partner, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    dt = ROW.dtype.element_ty
    return _round(_round(x * cos, dt, COMPILED) + _round(xp * sin, dt, COMPILED), dt, COMPILED)


@triton.jit
def _attention_item(QKV, COS, SIN, K_BUF, V_BUF, REQ_TO_TOKEN, row, seq_len, slot_new,
                    PART_O, PART_LSE, g, split, sm_scale,
                    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, COMPILED: tl.constexpr):
    """KV head g's query heads over split `split` of the keys → normalised partial + lse; the
    split holding the new token stores its rotated key and its value into the cache."""
    GROUP: tl.constexpr = HEADS // KV_HEADS
    HALF: tl.constexpr = HEAD_DIM // 2
    KV_ROW: tl.constexpr = KV_HEADS * HEAD_DIM  # a slot's stride in the cache
    offs_g = tl.arange(0, BLOCK_H)
    heads = g * GROUP + offs_g
    h_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        pos = seq_len - 1  # the new token: its key and value come from qkv, not the cache
        dt = QKV.dtype.element_ty
        q = _rotated(QKV + heads[:, None] * HEAD_DIM, COS, SIN, offs_d[None, :], HALF,
                     h_mask[:, None] & d_mask[None, :], COMPILED).to(dt)
        k_new = _rotated(QKV + (HEADS + g) * HEAD_DIM, COS, SIN, offs_d, HALF, d_mask, COMPILED)
        v_new = tl.load(QKV + (HEADS + KV_HEADS + g) * HEAD_DIM + offs_d, mask=d_mask, other=0.0,
                        cache_modifier=".cg").to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_KEYS):
            offs_n = n0 + tl.arange(0, BLOCK_KEYS)
            n_mask = offs_n < end
            cached = offs_n < pos
            slots = tl.load(REQ_TO_TOKEN + row + offs_n, mask=cached, other=0).to(tl.int64)
            k_t = tl.load(K_BUF + slots[None, :] * KV_ROW + g * HEAD_DIM + offs_d[:, None],
                          mask=d_mask[:, None] & cached[None, :], other=0.0)  # [BLOCK_D, KEYS]
            k_t = tl.where((offs_n == pos)[None, :], k_new.to(k_t.dtype)[:, None], k_t)
            s = tl.dot(q, k_t.to(dt), input_precision=PRECISION) * sm_scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_BUF + slots[:, None] * KV_ROW + g * HEAD_DIM + offs_d[None, :],
                        mask=cached[:, None] & d_mask[None, :], other=0.0)  # [KEYS, BLOCK_D]
            v = tl.where((offs_n == pos)[:, None], v_new.to(v.dtype)[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p.to(dt), v.to(dt), input_precision=PRECISION)
            m_i = m_new
        part = PART_O + (heads[:, None] * NUM_SPLITS + split) * HEAD_DIM + offs_d[None, :]
        tl.store(part, acc / l_i[:, None], mask=h_mask[:, None] & d_mask[None, :])
        tl.store(PART_LSE + heads * NUM_SPLITS + split, m_i + tl.log(l_i), mask=h_mask)
        if end == seq_len:
            kv = slot_new * KV_ROW + g * HEAD_DIM + offs_d
            tl.store(K_BUF + kv, k_new.to(K_BUF.dtype.element_ty), mask=d_mask)
            tl.store(V_BUF + kv, v_new.to(V_BUF.dtype.element_ty), mask=d_mask)


@triton.jit
def _merge_group(PART_O, PART_LSE, ATT, g, seq_len, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                 NUM_SPLITS: tl.constexpr):
    """KV head g's query heads: the splits' partials weighted by exp(lse), one sum → ATT."""
    GROUP: tl.constexpr = HEADS // KV_HEADS
    offs_g = tl.arange(0, BLOCK_H)
    heads = g * GROUP + offs_g
    h_mask = offs_g < GROUP
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    valid = offs_s * tl.cdiv(seq_len, NUM_SPLITS) < seq_len  # empty splits were never written
    lse = tl.load(PART_LSE + heads[:, None] * NUM_SPLITS + offs_s[None, :],
                  mask=h_mask[:, None] & valid[None, :], other=0.0, cache_modifier=".cg")
    lse = tl.where(valid[None, :], lse, float("-inf"))  # split 0 is never empty: finite max
    w = tl.exp(lse - tl.max(lse, 1)[:, None])  # [BLOCK_H, NUM_SPLITS]
    m3 = h_mask[:, None, None] & valid[None, :, None] & d_mask[None, None, :]
    part = tl.load(PART_O + (heads[:, None, None] * NUM_SPLITS + offs_s[None, :, None]) * HEAD_DIM
                   + offs_d[None, None, :], mask=m3, other=0.0, cache_modifier=".cg")
    out = tl.sum(part * w[:, :, None], 1) / tl.sum(w, 1)[:, None]
    tl.store(ATT + heads[:, None] * HEAD_DIM + offs_d[None, :], out.to(ATT.dtype.element_ty),
             mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def fused_layer_kernel(
    H_IN, R_IN, H_OUT, R_OUT,
    NORM1, QKV_W, QKV_B, O_W, NORM2, GU_W, DOWN_W,
    COS, SIN, K_BUF, V_BUF, LOC, REQ_TO_TOKEN, REQ_POOL_IDX, SEQ_LENS,
    QKV, R1, XN, ATT, PART_O, PART_LSE, ACT, CTR,
    eps, inv_hidden, sm_scale, stride_r2t,
    HIDDEN: tl.constexpr, BLOCK_HID: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, INTER: tl.constexpr,
    BK: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
    BN_DOWN: tl.constexpr, STAGES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_KEYS: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_QKV_BIAS: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr, SYNC: tl.constexpr,
    THREADS: tl.constexpr, COMPILED: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    N_QKV: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    Q_DIM: tl.constexpr = HEADS * HEAD_DIM
    # ---- A: residual add + norm + qkv ------------------------------------------------------
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    if FIRST == 0:
        xn = XN + pid * HIDDEN
        r1 = _normed_row(H_IN, R_IN, HAS_RESIDUAL, NORM1, xn, inv_hidden, eps, HIDDEN, BLOCK_HID,
                         COMPILED)
        if pid == 0:
            offs = tl.arange(0, BLOCK_HID)
            tl.store(R1 + offs, r1.to(R1.dtype.element_ty), mask=offs < HIDDEN)
        row0, row1 = _row_range(N_QKV)
        _gemv_phase(QKV_W, QKV_W, row0, row1, xn, QKV, QKV_B, HIDDEN, BN_QKV, BK, STAGES, 0,
                    HAS_QKV_BIAS, COMPILED)
    # ---- B: attention ------------------------------------------------------------------------
    if FIRST <= 1 and LAST >= 1:
        if SYNC and FIRST < 1:
            grid_barrier(CTR, progs, THREADS)
        seq_len = tl.load(SEQ_LENS).to(tl.int32)
        row = tl.load(REQ_POOL_IDX).to(tl.int64) * stride_r2t
        slot_new = tl.load(LOC).to(tl.int64)
        for item in range(pid, KV_HEADS * NUM_SPLITS, progs):
            g = item // NUM_SPLITS
            _attention_item(QKV, COS, SIN, K_BUF, V_BUF, REQ_TO_TOKEN, row, seq_len, slot_new,
                            PART_O, PART_LSE, g, item % NUM_SPLITS, sm_scale, HEADS, KV_HEADS,
                            HEAD_DIM, BLOCK_D, BLOCK_H, BLOCK_KEYS, NUM_SPLITS, PRECISION,
                            COMPILED)
            if arrive(CTR + 1 + g, NUM_SPLITS):
                _merge_group(PART_O, PART_LSE, ATT, g, seq_len, HEADS, KV_HEADS, HEAD_DIM,
                             BLOCK_D, BLOCK_H, NUM_SPLITS)
    # ---- C: o + residual ---------------------------------------------------------------------
    if FIRST <= 2 and LAST >= 2:
        if SYNC and FIRST < 2:
            grid_barrier(CTR, 2 * progs, THREADS)
        row0, row1 = _row_range(HIDDEN)
        _gemv_phase(O_W, O_W, row0, row1, ATT, R_OUT, R1, Q_DIM, BN_O, BK, STAGES, 1, True,
                    COMPILED)
    # ---- D: norm + gate/up + SiLU ------------------------------------------------------------
    if FIRST <= 3 and LAST >= 3:
        if SYNC and FIRST < 3:
            grid_barrier(CTR, 3 * progs, THREADS)
        xn = XN + pid * HIDDEN
        _normed_row(R_OUT, R_OUT, False, NORM2, xn, inv_hidden, eps, HIDDEN, BLOCK_HID, COMPILED)
        row0, row1 = _row_range(INTER)
        _gemv_phase(GU_W, GU_W + INTER * HIDDEN, row0, row1, xn, ACT, ACT, HIDDEN, BN_GU, BK,
                    STAGES, 2, False, COMPILED)
    # ---- E: down -----------------------------------------------------------------------------
    if FIRST <= 4 and LAST >= 4:
        if SYNC and FIRST < 4:
            grid_barrier(CTR, 4 * progs, THREADS)
        row0, row1 = _row_range(HIDDEN)
        _gemv_phase(DOWN_W, DOWN_W, row0, row1, ACT, H_OUT, H_OUT, INTER, BN_DOWN, BK, STAGES, 3,
                    False, COMPILED)
