// One decode step of a Llama/Qwen2 decoder stack for ONE request as ONE persistent kernel
// (sm_90): every layer's weights stream through a ring of shared-memory slots filled by TMA
// bulk copies, issued by a producer warp that never waits for activations (weights do not
// depend on them) — so the stream runs on across the phase boundaries (grid barriers) and the
// latency-bound work (norms, attention, barriers) hides under it, where a chain of kernels
// restarts its weight stream at every kernel boundary.
//
// Grid: one CTA per SM, all resident (the launcher checks). Each CTA owns a slice of every
// GEMV's output rows. Per layer, five phases separated by grid barriers:
//   qkv   RMSNorm(h) (every CTA, redundantly) -> its qkv rows (+bias)      -> qkv_buf
//   attn  (KV head, key split) items: rotary of q and the new k, the new k/v stored to the
//         cache by the item that holds the last position, online softmax -> partials
//   o     merge of the partials (every CTA) -> its o rows, h[rows] += o
//   gu    RMSNorm(h) -> its gate and up rows (same rows of both, chunk by chunk) -> act
//   down  act -> its down rows, h[rows] += down
// and the final RMSNorm into `out` (CTA 0). Roundings follow HF: bf16 after every GEMV, norm
// as bf16(w * bf16(h * rstd)), SiLU and the product rounded to bf16, residual adds in bf16.
//
// Header-free (NVRTC and nvcc alike); shapes are compile-time macros (-D).
//
// Measured on an H200 (BENCHMARKS.md, thirty-fourth session): correct (as close to an fp32
// reference as torch's bf16 path), but 46 µs a layer against the engine's kernel chain's ~32:
// while the weight stream runs, a grid barrier takes 4-5.5 µs from its last arrival to its
// first departure (0.85 µs when no copy is in flight), and a CTA's fresh stores reach another
// CTA's loads no faster without one (decode_b1_ll.cu of ff09a90 polls tagged data words), so the
// five handoffs a layer cost more than the chain's kernel boundaries under PDL. Not used by
// the engine; kept as the record of that measurement.
#ifndef HIDDEN
#define HIDDEN 1536
#endif
#ifndef INTER
#define INTER 8960
#endif
#ifndef HEADS
#define HEADS 12
#endif
#ifndef KV_HEADS
#define KV_HEADS 2
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef LAYERS
#define LAYERS 28
#endif
#ifndef QKV_BIAS
#define QKV_BIAS 1
#endif
#ifndef RMS_EPS
#define RMS_EPS 1e-6f
#endif
#ifndef NSLOTS
#define NSLOTS 11
#endif
#ifndef SLOT_BYTES
#define SLOT_BYTES 18432
#endif
#ifndef MAX_SPLITS
#define MAX_SPLITS 16
#endif
#ifndef MIN_SPLIT
#define MIN_SPLIT 16
#endif
#ifndef MAX_INFLIGHT
#define MAX_INFLIGHT 2
#endif
#ifndef EVICT_FIRST
#define EVICT_FIRST 1
#endif

#define NCW 8                      // consumer warps
#define NC (NCW * 32)              // consumer threads
#define NTHREADS (NC + 32)         // + one producer warp
#define GQ (HEADS / KV_HEADS)      // query heads per KV head
#define QKV_ROWS ((HEADS + 2 * KV_HEADS) * HEAD_DIM)
#define KEY_BLOCK 64
#define XS_ELEMS (HIDDEN > INTER ? HIDDEN : INTER)
#define RPS_H (SLOT_BYTES / (2 * HIDDEN))   // rows of a K=HIDDEN matrix per slot
#define RPS_I (SLOT_BYTES / (2 * INTER))    // rows of a K=INTER matrix per slot
#define LOG2E 1.4426950408889634f
#define NEG_INF __int_as_float(0xff800000)

static_assert(RPS_H >= 1 && RPS_I >= 1, "a slot must hold one weight row");
#define PAIRS (RPS_H / 2)  // gate/up row pairs a slot
static_assert(MAX_INFLIGHT >= 1 && MAX_INFLIGHT < NSLOTS, "in-flight cap below the ring");
static_assert(PAIRS >= 1, "a slot holds a gate row and its up row");
static_assert(NSLOTS >= NCW, "a warp waits on slot i only once i - NSLOTS was filled (mbarrier parity)");
static_assert(HIDDEN % 8 == 0 && INTER % 8 == 0, "rows are read as 16-byte vectors");
static_assert(NC % HEAD_DIM == 0 && GQ % (NC / HEAD_DIM) == 0, "attention thread layout");
static_assert(SLOT_BYTES % 16 == 0, "bulk copies move multiples of 16 bytes");
static_assert(HEAD_DIM == 128, "a warp reads a key as 32 lanes x 4 elements");

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

struct LayerPtrs {
  const bf16_t* ln1;
  const bf16_t* w_qkv;
  const bf16_t* b_qkv;
  const bf16_t* w_o;
  const bf16_t* ln2;
  const bf16_t* w_gu;
  const bf16_t* w_down;
  bf16_t* k_cache;
  bf16_t* v_cache;
};

// ---------------------------------------------------------------- small helpers
__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float bf2f(bf16_t v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ bf16_t f2bf(float f) {
  bf16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ float round_bf(float f) { return bf2f(f2bf(f)); }
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
  return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
}
__device__ __forceinline__ uint4 make_zero4() {
  uint4 z;
  z.x = z.y = z.z = z.w = 0u;
  return z;
}
__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
  acc = fmaf(bf_lo(w.x), bf_lo(x.x), acc); acc = fmaf(bf_hi(w.x), bf_hi(x.x), acc);
  acc = fmaf(bf_lo(w.y), bf_lo(x.y), acc); acc = fmaf(bf_hi(w.y), bf_hi(x.y), acc);
  acc = fmaf(bf_lo(w.z), bf_lo(x.z), acc); acc = fmaf(bf_hi(w.z), bf_hi(x.z), acc);
  acc = fmaf(bf_lo(w.w), bf_lo(x.w), acc); acc = fmaf(bf_hi(w.w), bf_hi(x.w), acc);
  return acc;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// cross-CTA data is read through L2 (ld.global.cg): L1 is not coherent between SMs
__device__ __forceinline__ bf16_t ld_cg(const bf16_t* p) { return __ldcg(p); }
__device__ __forceinline__ uint4 ld_cg(const uint4* p) { return __ldcg(p); }

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(NC) : "memory"); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* bar,
                                          u64 policy) {
#if EVICT_FIRST
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy) : "memory");
#else
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
#endif
}

// Grid barrier number `idx` of a launch. Counters and flags live on their own 128-byte lines
// and are never reset: launch `epoch` (read at the start, advanced at the end by CTA 0) waits
// for counter (epoch + 1) * G; the last arriver raises the flag to epoch + 1, the others poll
// the flag, a line no atomic contends for.
__device__ __forceinline__ void grid_barrier(u32* counters, int idx, u32 epoch, int ctid) {
  consumer_sync();
  if (ctid == 0) {
    u32* cnt = counters + 32 * (2 * idx);
    u32* flag = counters + 32 * (2 * idx + 1);
    u32 old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(cnt) : "memory");
    if (old == (epoch + 1) * gridDim.x - 1) {
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(epoch + 1) : "memory");
    } else {
      u32 seen;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
      } while (seen != epoch + 1);
    }
  }
  consumer_sync();
}

// ---------------------------------------------------------------- profiling (-DPROFILE=1)
#ifndef PROFILE
#define PROFILE 0
#endif
#define NMARK 24  // per CTA and layer: 15 phase marks, 4 stream-wait sums, producer wait
// global nanoseconds (comparable across SMs, unlike clock64)
__device__ __forceinline__ long long cycles() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------- the weight stream
// The CTA's rows of an R-row matrix: [R*c/G, R*(c+1)/G).
__device__ __forceinline__ int slice_begin(int rows, int c, int g) { return (int)((long long)rows * c / g); }

// Both roles walk the same schedule of slots: for every layer, qkv chunks, o chunks, (gate
// chunk, up chunk) pairs, down chunks. The producer issues them; consumers take them in order.
struct Ring {
  unsigned char* slots;
  u64* full;
  u64* empty;
};

struct Producer {
  Ring ring;
  u32 it;
  u64 policy;
  long long waited;
  // one slot: `bytes` from src, then `bytes2` from src2 right after them
  __device__ __forceinline__ void emit(const bf16_t* src, u32 bytes, const bf16_t* src2 = nullptr,
                                       u32 bytes2 = 0) {
    const u32 s = it % NSLOTS, k = it / NSLOTS;
#if PROFILE
    const long long t0 = cycles();
    if (k > 0) mbar_wait(&ring.empty[s], (k - 1) & 1);
    waited += cycles() - t0;
#else
    if (k > 0) mbar_wait(&ring.empty[s], (k - 1) & 1);
#endif
    // at most MAX_INFLIGHT copies in flight: an SM's loads queue behind its outstanding copies,
    // and the phases' cross-CTA loads (barrier flags, h, act, partials) are on the critical path
    if (it >= MAX_INFLIGHT) {
      const u32 prev = it - MAX_INFLIGHT;
      mbar_wait(&ring.full[prev % NSLOTS], (prev / NSLOTS) & 1);
    }
    mbar_expect_tx(&ring.full[s], bytes + bytes2);
    bulk_load(ring.slots + (size_t)s * SLOT_BYTES, src, bytes, &ring.full[s], policy);
    if (bytes2) bulk_load(ring.slots + (size_t)s * SLOT_BYTES + bytes, src2, bytes2, &ring.full[s], policy);
    ++it;
  }
};

__device__ void produce(const LayerPtrs* layers, Ring ring, long long* prof) {
  Producer p{ring, 0u, 0ull, 0ll};
#if EVICT_FIRST
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p.policy));
#endif
  const int c = blockIdx.x, G = gridDim.x;
  const int q0 = slice_begin(QKV_ROWS, c, G), q1 = slice_begin(QKV_ROWS, c + 1, G);
  const int h0 = slice_begin(HIDDEN, c, G), h1 = slice_begin(HIDDEN, c + 1, G);
  const int g0 = slice_begin(INTER, c, G), g1 = slice_begin(INTER, c + 1, G);
  for (int l = 0; l < LAYERS; ++l) {
    const LayerPtrs L = layers[l];
    for (int r = q0; r < q1; r += RPS_H)
      p.emit(L.w_qkv + (size_t)r * HIDDEN, min(RPS_H, q1 - r) * HIDDEN * 2);
    for (int r = h0; r < h1; r += RPS_H)
      p.emit(L.w_o + (size_t)r * HIDDEN, min(RPS_H, h1 - r) * HIDDEN * 2);
    for (int r = g0; r < g1; r += PAIRS) {  // gate rows, then the same rows of up
      const u32 bytes = min(PAIRS, g1 - r) * HIDDEN * 2;
      p.emit(L.w_gu + (size_t)r * HIDDEN, bytes, L.w_gu + (size_t)(INTER + r) * HIDDEN, bytes);
    }
    for (int r = h0; r < h1; r += RPS_I)
      p.emit(L.w_down + (size_t)r * INTER, min(RPS_I, h1 - r) * INTER * 2);
#if PROFILE
    prof[((size_t)c * LAYERS + l) * NMARK + 19] = p.waited;  // empty-slot waits, this layer
    prof[((size_t)c * LAYERS + l) * NMARK + 20] = cycles();  // last copy of the layer issued
    p.waited = 0;
#endif
  }
}

// Warp w takes slots w, w + NCW, ... of each phase, a whole slot at a time, so that NCW slots
// are worked on at once. Parity waits are safe: a warp waits on slot i after it took i - NCW
// (or the phase before), so i - NSLOTS <= i - NCW has been filled.
struct Consumer {
  Ring ring;
  u32 base;  // the phase's first slot (iteration number)
  int warp, lane;
  long long waited;
  __device__ __forceinline__ const uint4* take(u32 i) {
    const u32 s = i % NSLOTS;
#if PROFILE
    const long long t0 = cycles();
    mbar_wait(&ring.full[s], (i / NSLOTS) & 1);
    waited += cycles() - t0;
#else
    mbar_wait(&ring.full[s], (i / NSLOTS) & 1);
#endif
    return (const uint4*)(ring.slots + (size_t)s * SLOT_BYTES);
  }
  __device__ __forceinline__ void give_back(u32 i) {
    __syncwarp();
    if (lane == 0) mbar_arrive(&ring.empty[i % NSLOTS]);
  }
};

// acc[r] = row r of the slot · x, r < nrows (NR at most), summed over the warp
template <int NR>
__device__ __forceinline__ void rows_dot(const uint4* w, const uint4* x, int nvec, int nrows,
                                         int lane, float* acc) {
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
  for (int v = lane; v < nvec; v += 32) {
    const uint4 xv = x[v];
#pragma unroll
    for (int r = 0; r < NR; ++r)
      if (r < nrows) acc[r] = dot8(w[r * nvec + v], xv, acc[r]);
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = warp_sum(acc[r]);
}

template <int NR>
__device__ __forceinline__ float pick(const float* acc, int r) {
  float v = 0.f;
#pragma unroll
  for (int i = 0; i < NR; ++i)
    if (i == r) v = acc[i];
  return v;
}

__device__ __forceinline__ float row_dot(const uint4* w, const uint4* x, int nvec, int lane) {
  float a0 = 0.f, a1 = 0.f;
  int v = lane;
  for (; v + 32 < nvec; v += 64) {
    a0 = dot8(w[v], x[v], a0);
    a1 = dot8(w[v + 32], x[v + 32], a1);
  }
  if (v < nvec) a0 = dot8(w[v], x[v], a0);
  return warp_sum(a0 + a1);
}

// ---------------------------------------------------------------- phases (consumer threads)
struct Step {
  const LayerPtrs* layers;
  bf16_t* h;
  bf16_t* out;
  const bf16_t* final_ln;
  const bf16_t* rope;  // [positions, 2, HEAD_DIM / 2]: cos, sin
  int position, n_ctx, out_loc;
  const int* req_row;  // req_to_token row of the request
  bf16_t* qkv_buf;
  float* part;         // [HEADS][MAX_SPLITS][HEAD_DIM] partial p·v, then [HEADS][MAX_SPLITS][2] (m, l)
  bf16_t* act;
  u32* counters;  // 2 * NBARRIERS lines of 32, then the epoch
  u32 epoch;
  long long* prof;
};

#define MAX_OWN_ROWS 64
#define NBARRIERS (5 * LAYERS)
#define EPOCH_AT (32 * 2 * NBARRIERS)
#define ATT_OFFSET (HIDDEN * 2)  // attention scratch in xs, past the qkv phase's input

struct Smem {
  bf16_t* xs;     // the phase's input vector (XS_ELEMS); the attention's scratch past HIDDEN
  float* red;     // NCW floats
  float* h_own;   // this CTA's rows of the residual stream (it alone writes them)
};

// xs = bf16(w * bf16(h * rstd)); h read once (one L2 round trip)
__device__ __forceinline__ void rms_norm_to_smem(const bf16_t* h, const bf16_t* w, Smem sm, int ctid) {
  static_assert(HIDDEN / 8 <= NC, "one 16-byte vector of h per thread");
  const int warp = ctid / 32, lane = ctid % 32;
  uint4 hv = make_zero4();
  float ss = 0.f;
  if (ctid < HIDDEN / 8) {
    hv = ld_cg((const uint4*)h + ctid);
    const u32 e[4] = {hv.x, hv.y, hv.z, hv.w};
    for (int i = 0; i < 4; ++i) {
      const float a = bf_lo(e[i]), b = bf_hi(e[i]);
      ss = fmaf(a, a, fmaf(b, b, ss));
    }
  }
  ss = warp_sum(ss);
  if (lane == 0) sm.red[warp] = ss;
  consumer_sync();
  float total = 0.f;
  for (int i = 0; i < NCW; ++i) total += sm.red[i];
  const float rstd = rsqrtf(total / HIDDEN + RMS_EPS);
  if (ctid < HIDDEN / 8) {
    const uint4 wv = ((const uint4*)w)[ctid];
    const u32 he[4] = {hv.x, hv.y, hv.z, hv.w}, we[4] = {wv.x, wv.y, wv.z, wv.w};
    uint4 o;
    o.x = pack_bf2(bf_lo(we[0]) * round_bf(bf_lo(he[0]) * rstd), bf_hi(we[0]) * round_bf(bf_hi(he[0]) * rstd));
    o.y = pack_bf2(bf_lo(we[1]) * round_bf(bf_lo(he[1]) * rstd), bf_hi(we[1]) * round_bf(bf_hi(he[1]) * rstd));
    o.z = pack_bf2(bf_lo(we[2]) * round_bf(bf_lo(he[2]) * rstd), bf_hi(we[2]) * round_bf(bf_hi(he[2]) * rstd));
    o.w = pack_bf2(bf_lo(we[3]) * round_bf(bf_lo(he[3]) * rstd), bf_hi(we[3]) * round_bf(bf_hi(he[3]) * rstd));
    ((uint4*)sm.xs)[ctid] = o;
  }
  consumer_sync();
}

__device__ __forceinline__ void split_plan(int n_ctx, int* splits, int* keys_per_split) {
  // splits of at least MIN_SPLIT keys, at most MAX_SPLITS of them (the merge reads them all)
  int per = (n_ctx + MAX_SPLITS - 1) / MAX_SPLITS;
  per = ((per + MIN_SPLIT - 1) / MIN_SPLIT) * MIN_SPLIT;
  *keys_per_split = per;
  *splits = (n_ctx + per - 1) / per;
}

// The attention item (KV head g, split s) of a CTA: its GQ query heads over keys [k0, k1) in
// blocks of KEY_BLOCK. Earlier keys and values do not depend on this step, so the first block's
// slots and loads are issued before the grid barrier that publishes q (`prefetch`), and the
// barrier's wait hides their latency.
struct AttnScratch {
  float* qs;     // [GQ][HEAD_DIM], pre-scaled (log2 domain)
  float* knew;   // [HEAD_DIM]
  float* vnew;   // [HEAD_DIM]
  float* sc;     // [GQ][KEY_BLOCK]
  float* mrun;   // [GQ]
  float* lrun;   // [GQ]
  float* alpha;  // [GQ]
  int* slot;     // [KEY_BLOCK]
  __device__ explicit AttnScratch(Smem sm) {
    qs = (float*)((unsigned char*)sm.xs + ATT_OFFSET);
    knew = qs + GQ * HEAD_DIM;
    vnew = knew + HEAD_DIM;
    sc = vnew + HEAD_DIM;
    mrun = sc + GQ * KEY_BLOCK;
    lrun = mrun + GQ;
    alpha = lrun + GQ;
    slot = (int*)(alpha + GQ);
  }
};

struct AttnItem {
  int g, s, k0, k1;
  uint2 kraw[KEY_BLOCK / NCW];
  u32 vraw[KEY_BLOCK / 2];  // two keys' values at this thread's dim, packed
};

// slots of keys [b0, b0 + nb) into smem (-1: the new token, not in the cache yet)
__device__ __forceinline__ void attn_slots(const Step& st, AttnScratch& a, int b0, int nb, int ctid) {
  if (ctid < nb) a.slot[ctid] = (b0 + ctid == st.n_ctx - 1) ? -1 : st.req_row[b0 + ctid];
}

// every K and V load of a block issued before any is used (after attn_slots + a sync)
__device__ __forceinline__ void attn_load(const LayerPtrs& L, AttnScratch& a, AttnItem& it, int nb,
                                          int ctid) {
  const int warp = ctid / 32, lane = ctid % 32, d = ctid % HEAD_DIM;
#pragma unroll
  for (int i = 0; i < KEY_BLOCK / NCW; ++i) {
    const int j = warp + i * NCW;
    if (j < nb && a.slot[j] >= 0)
      it.kraw[i] = *(const uint2*)(L.k_cache + ((size_t)a.slot[j] * KV_HEADS + it.g) * HEAD_DIM + lane * 4);
  }
#pragma unroll
  for (int j = 0; j < KEY_BLOCK; j += 2) {
    u32 lo = 0u, hi = 0u;
    if (j < nb && a.slot[j] >= 0) lo = L.v_cache[((size_t)a.slot[j] * KV_HEADS + it.g) * HEAD_DIM + d];
    if (j + 1 < nb && a.slot[j + 1] >= 0) hi = L.v_cache[((size_t)a.slot[j + 1] * KV_HEADS + it.g) * HEAD_DIM + d];
    it.vraw[j / 2] = lo | (hi << 16);
  }
}

__device__ __forceinline__ void attention_compute(const Step& st, const LayerPtrs& L, AttnScratch& a, AttnItem& it,
                                  int ctid) {
  const int warp = ctid / 32, lane = ctid % 32, g = it.g;
  const bf16_t* cs = st.rope + (size_t)st.position * HEAD_DIM;  // cos[HEAD_DIM/2], sin[HEAD_DIM/2]
  const float scale = rsqrtf((float)HEAD_DIM) * LOG2E;
  constexpr int HALF = HEAD_DIM / 2;
  for (int i = ctid; i < (GQ + 1) * HALF; i += NC) {  // q heads, then the new key
    const int hq = i / HALF, e = i % HALF;
    const bf16_t* row = st.qkv_buf + (hq < GQ ? (g * GQ + hq) * HEAD_DIM : HEADS * HEAD_DIM + g * HEAD_DIM);
    const float x1 = bf2f(ld_cg(row + e)), x2 = bf2f(ld_cg(row + e + HALF));
    const float c = bf2f(cs[e]), sn = bf2f(cs[HALF + e]);
    const float r1 = round_bf(x1 * c - x2 * sn), r2 = round_bf(x2 * c + x1 * sn);
    if (hq < GQ) {
      a.qs[hq * HEAD_DIM + e] = r1 * scale;
      a.qs[hq * HEAD_DIM + e + HALF] = r2 * scale;
    } else {
      a.knew[e] = r1;
      a.knew[e + HALF] = r2;
    }
  }
  if (ctid < HEAD_DIM)
    a.vnew[ctid] = bf2f(ld_cg(st.qkv_buf + (HEADS + KV_HEADS) * HEAD_DIM + g * HEAD_DIM + ctid));
  if (ctid < GQ) {
    a.mrun[ctid] = NEG_INF;
    a.lrun[ctid] = 0.f;
  }
  consumer_sync();
  if (it.k1 == st.n_ctx && ctid < HEAD_DIM) {  // the item holding the new token stores its k, v
    const size_t at = ((size_t)st.out_loc * KV_HEADS + g) * HEAD_DIM + ctid;
    L.k_cache[at] = f2bf(a.knew[ctid]);
    L.v_cache[at] = f2bf(a.vnew[ctid]);
  }
  constexpr int HPT = GQ / (NC / HEAD_DIM);  // heads per thread in p·v
  const int d = ctid % HEAD_DIM, hset = ctid / HEAD_DIM;
  float acc[HPT];
  for (int i = 0; i < HPT; ++i) acc[i] = 0.f;
  for (int b0 = it.k0; b0 < it.k1; b0 += KEY_BLOCK) {
    const int nb = min(KEY_BLOCK, it.k1 - b0);
    if (b0 != it.k0) {  // the first block was loaded before the barrier
      consumer_sync();
      attn_slots(st, a, b0, nb, ctid);
      consumer_sync();
      attn_load(L, a, it, nb, ctid);
    }
#pragma unroll
    for (int i = 0; i < KEY_BLOCK / NCW; ++i) {
      const int j = warp + i * NCW;
      if (j >= nb) continue;
      float kv[4];
      if (a.slot[j] < 0) {
        for (int e = 0; e < 4; ++e) kv[e] = a.knew[lane * 4 + e];
      } else {
        kv[0] = bf_lo(it.kraw[i].x); kv[1] = bf_hi(it.kraw[i].x);
        kv[2] = bf_lo(it.kraw[i].y); kv[3] = bf_hi(it.kraw[i].y);
      }
      for (int hq = 0; hq < GQ; ++hq) {
        const float* q = a.qs + hq * HEAD_DIM + lane * 4;
        float p = q[0] * kv[0];
        p = fmaf(q[1], kv[1], p); p = fmaf(q[2], kv[2], p); p = fmaf(q[3], kv[3], p);
        p = warp_sum(p);
        if (lane == 0) a.sc[hq * KEY_BLOCK + j] = p;
      }
    }
    consumer_sync();
    if (warp < GQ) {  // online softmax, one warp a head
      float* row = a.sc + warp * KEY_BLOCK;
      float mb = NEG_INF;
      for (int j = lane; j < nb; j += 32) mb = fmaxf(mb, row[j]);
      mb = warp_max(mb);
      const float mold = a.mrun[warp], mnew = fmaxf(mold, mb);
      float lb = 0.f;
      for (int j = lane; j < nb; j += 32) {
        const float p = exp2f(row[j] - mnew);
        row[j] = p;
        lb += p;
      }
      lb = warp_sum(lb);
      __syncwarp();
      if (lane == 0) {
        const float al = exp2f(mold - mnew);
        a.alpha[warp] = al;
        a.lrun[warp] = a.lrun[warp] * al + lb;
        a.mrun[warp] = mnew;
      }
    }
    consumer_sync();
    for (int i = 0; i < HPT; ++i) acc[i] *= a.alpha[hset + i * (NC / HEAD_DIM)];
#pragma unroll
    for (int j = 0; j < KEY_BLOCK; ++j) {
      if (j >= nb) continue;
      const float v = a.slot[j] < 0 ? a.vnew[d] : (j % 2 ? bf_hi(it.vraw[j / 2]) : bf_lo(it.vraw[j / 2]));
      for (int i = 0; i < HPT; ++i) acc[i] = fmaf(a.sc[(hset + i * (NC / HEAD_DIM)) * KEY_BLOCK + j], v, acc[i]);
    }
  }
  const int s = it.s;
  for (int i = 0; i < HPT; ++i) {
    const int hq = g * GQ + hset + i * (NC / HEAD_DIM);
    st.part[((size_t)hq * MAX_SPLITS + s) * HEAD_DIM + d] = acc[i];
    if (d == 0) {
      float* ml = st.part + (size_t)HEADS * MAX_SPLITS * HEAD_DIM + ((size_t)hq * MAX_SPLITS + s) * 2;
      ml[0] = a.mrun[hq - g * GQ];
      ml[1] = a.lrun[hq - g * GQ];
    }
  }
}

// xs = the attention output (HEADS * HEAD_DIM), merged from the splits' partials. A thread
// takes 8 dims of one head and loads, in one round, its head's (m, l) pairs and its partial
// vectors of MERGE_BATCH splits (more splits: further rounds, merged online).
#define MERGE_BATCH 4
__device__ __forceinline__ void merge_attention(const Step& st, int splits, Smem sm, int ctid) {
  constexpr int GROUPS = HEADS * HEAD_DIM / 8;
  static_assert(GROUPS <= NC, "one 8-dim group per thread");
  const float* ml = st.part + (size_t)HEADS * MAX_SPLITS * HEAD_DIM;
  if (ctid < GROUPS) {
    const int hq = ctid / (HEAD_DIM / 8), d8 = ctid % (HEAD_DIM / 8);
    const float4* p = (const float4*)(st.part + (size_t)hq * MAX_SPLITS * HEAD_DIM) + 2 * d8;
    const float2* mlh = (const float2*)ml + hq * MAX_SPLITS;
    float m_run = NEG_INF, den = 0.f, o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = 0.f;
    for (int s0 = 0; s0 < splits; s0 += MERGE_BATCH) {
      float2 w[MERGE_BATCH];
      float4 a[MERGE_BATCH], b[MERGE_BATCH];
#pragma unroll
      for (int i = 0; i < MERGE_BATCH; ++i) {
        if (s0 + i < splits) {
          w[i] = __ldcg(mlh + s0 + i);
          a[i] = __ldcg(p + (s0 + i) * (HEAD_DIM / 4));
          b[i] = __ldcg(p + (s0 + i) * (HEAD_DIM / 4) + 1);
        }
      }
      float mb = m_run;
#pragma unroll
      for (int i = 0; i < MERGE_BATCH; ++i)
        if (s0 + i < splits) mb = fmaxf(mb, w[i].x);
      const float scale_old = exp2f(m_run - mb);
      den *= scale_old;
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] *= scale_old;
#pragma unroll
      for (int i = 0; i < MERGE_BATCH; ++i) {
        if (s0 + i < splits) {
          const float f = exp2f(w[i].x - mb);
          den = fmaf(f, w[i].y, den);
          o[0] = fmaf(f, a[i].x, o[0]); o[1] = fmaf(f, a[i].y, o[1]);
          o[2] = fmaf(f, a[i].z, o[2]); o[3] = fmaf(f, a[i].w, o[3]);
          o[4] = fmaf(f, b[i].x, o[4]); o[5] = fmaf(f, b[i].y, o[5]);
          o[6] = fmaf(f, b[i].z, o[6]); o[7] = fmaf(f, b[i].w, o[7]);
        }
      }
      m_run = mb;
    }
    const float inv = 1.f / den;
    uint4 packed;
    packed.x = pack_bf2(o[0] * inv, o[1] * inv);
    packed.y = pack_bf2(o[2] * inv, o[3] * inv);
    packed.z = pack_bf2(o[4] * inv, o[5] * inv);
    packed.w = pack_bf2(o[6] * inv, o[7] * inv);
    ((uint4*)sm.xs)[ctid] = packed;
  }
  consumer_sync();
}

// The CTA's rows [r0, r1) of a K = HIDDEN matrix, RPS_H rows a slot, a warp a slot; lane j of
// the warp hands row j's dot product to `epilogue(row, value)`
template <class Epilogue>
__device__ __forceinline__ void hidden_rows(Consumer& cn, int r0, int r1, const uint4* x, int lane,
                                            Epilogue epilogue) {
  const int units = (r1 - r0 + RPS_H - 1) / RPS_H;
  for (int u = cn.warp; u < units; u += NCW) {
    const int r = r0 + u * RPS_H, n = min(RPS_H, r1 - r);
    const uint4* w = cn.take(cn.base + u);
    float acc[RPS_H];
    rows_dot<RPS_H>(w, x, HIDDEN / 8, n, lane, acc);
    cn.give_back(cn.base + u);
    if (lane < n) epilogue(r + lane, pick<RPS_H>(acc, lane));
  }
  cn.base += units;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

__device__ void consume(const Step& st, Ring ring, Smem sm, int ctid) {
  const int c = blockIdx.x, G = gridDim.x, lane = ctid % 32;
  Consumer cn{ring, 0u, ctid / 32, ctid % 32, 0ll};
#if PROFILE
  long long* prof = st.prof + (size_t)c * LAYERS * NMARK;
#define MARK(k) if (ctid == 0) prof[l * NMARK + (k)] = cycles()
#define WAITED(k) if (ctid == 0) { prof[l * NMARK + (k)] = cn.waited; cn.waited = 0; }
#else
#define MARK(k)
#define WAITED(k)
#endif
  const int q0 = slice_begin(QKV_ROWS, c, G), q1 = slice_begin(QKV_ROWS, c + 1, G);
  const int h0 = slice_begin(HIDDEN, c, G), h1 = slice_begin(HIDDEN, c + 1, G);
  const int g0 = slice_begin(INTER, c, G), g1 = slice_begin(INTER, c + 1, G);
  const uint4* x = (const uint4*)sm.xs;
  int splits, per;
  split_plan(st.n_ctx, &splits, &per);
  const bool has_item = c < KV_HEADS * splits;
  AttnScratch a(sm);
  AttnItem it;
  it.g = c / splits;
  it.s = c % splits;
  it.k0 = it.s * per;
  it.k1 = min(it.k0 + per, st.n_ctx);
  const int nb0 = min(KEY_BLOCK, it.k1 - it.k0);
  for (int r = h0 + ctid; r < h1; r += NC) sm.h_own[r - h0] = bf2f(st.h[r]);
  int barrier = 0;
  for (int l = 0; l < LAYERS; ++l) {
    const LayerPtrs L = st.layers[l];
    MARK(0);
    if (has_item) attn_slots(st, a, it.k0, nb0, ctid);  // published by the norm's syncs
    // qkv
    rms_norm_to_smem(st.h, L.ln1, sm, ctid);
    MARK(1);
    hidden_rows(cn, q0, q1, x, lane, [&](int row, float v) {
#if QKV_BIAS
      v += bf2f(L.b_qkv[row]);
#endif
      st.qkv_buf[row] = f2bf(v);
    });
    MARK(2);
    WAITED(15);
    if (has_item) attn_load(L, a, it, nb0, ctid);  // in flight across the barrier
    grid_barrier(st.counters, barrier++, st.epoch, ctid);
    MARK(3);
    // attention
    if (has_item) attention_compute(st, L, a, it, ctid);
    MARK(4);
    grid_barrier(st.counters, barrier++, st.epoch, ctid);
    MARK(5);
    // o, residual
    merge_attention(st, splits, sm, ctid);
    MARK(6);
    hidden_rows(cn, h0, h1, x, lane, [&](int row, float v) {
      const float hn = round_bf(sm.h_own[row - h0] + round_bf(v));
      sm.h_own[row - h0] = hn;
      st.h[row] = f2bf(hn);
    });
    MARK(7);
    WAITED(16);
    grid_barrier(st.counters, barrier++, st.epoch, ctid);
    MARK(8);
    // gate / up
    rms_norm_to_smem(st.h, L.ln2, sm, ctid);
    MARK(9);
    {
      const int units = (g1 - g0 + PAIRS - 1) / PAIRS;
      for (int u = cn.warp; u < units; u += NCW) {
        const int r = g0 + u * PAIRS, n = min(PAIRS, g1 - r);
        const uint4* w = cn.take(cn.base + u);
        float acc[2 * PAIRS];
        rows_dot<2 * PAIRS>(w, x, HIDDEN / 8, 2 * n, lane, acc);
        cn.give_back(cn.base + u);
        if (lane < n) {
          const float gate = round_bf(pick<2 * PAIRS>(acc, lane));
          const float up = round_bf(pick<2 * PAIRS>(acc, n + lane));
          st.act[r + lane] = f2bf(round_bf(silu(gate)) * up);
        }
      }
      cn.base += units;
    }
    MARK(10);
    WAITED(17);
    grid_barrier(st.counters, barrier++, st.epoch, ctid);
    MARK(11);
    // down, residual
    for (int v = ctid; v < INTER / 8; v += NC) ((uint4*)sm.xs)[v] = ld_cg((const uint4*)st.act + v);
    consumer_sync();
    MARK(12);
    {
      static_assert(RPS_I == 1, "down: one row a slot");
      const int units = h1 - h0;
      for (int u = cn.warp; u < units; u += NCW) {
        const int r = h0 + u;
        const uint4* w = cn.take(cn.base + u);
        const float dn = round_bf(row_dot(w, x, INTER / 8, lane));
        cn.give_back(cn.base + u);
        if (lane == 0) {
          const float hn = round_bf(sm.h_own[r - h0] + dn);
          sm.h_own[r - h0] = hn;
          st.h[r] = f2bf(hn);
        }
      }
      cn.base += units;
    }
    MARK(13);
    WAITED(18);
    grid_barrier(st.counters, barrier++, st.epoch, ctid);
    MARK(14);
  }
  if (c == 0) {
    rms_norm_to_smem(st.h, st.final_ln, sm, ctid);
    for (int v = ctid; v < HIDDEN / 8; v += NC) ((uint4*)st.out)[v] = ((const uint4*)sm.xs)[v];
  }
}

#define SMEM_RING (NSLOTS * SLOT_BYTES)
#define SMEM_BARS (2 * NSLOTS * 8)
#define SMEM_XS (XS_ELEMS * 2)
#define SMEM_TOTAL (SMEM_RING + SMEM_BARS + SMEM_XS + NCW * 4 + MAX_OWN_ROWS * 4)
static_assert(ATT_OFFSET + 4 * (GQ * HEAD_DIM + 2 * HEAD_DIM + GQ * KEY_BLOCK + 3 * GQ + KEY_BLOCK) <= SMEM_XS,
              "the attention scratch fits in xs past the qkv input");

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
decode_b1(const LayerPtrs* layers, bf16_t* h, bf16_t* out, const bf16_t* final_ln,
          const bf16_t* rope, const long long* position, const long long* seq_len,
          const long long* out_loc, const long long* req_index, const int* req_to_token,
          int req_to_token_stride, bf16_t* qkv_buf, float* part, bf16_t* act, u32* counters,
          long long* prof) {
  extern __shared__ __align__(128) unsigned char smem[];
  Ring ring{smem, (u64*)(smem + SMEM_RING), (u64*)(smem + SMEM_RING) + NSLOTS};
  unsigned char* rest = smem + SMEM_RING + SMEM_BARS;
  Smem sm{(bf16_t*)rest, (float*)(rest + SMEM_XS), (float*)(rest + SMEM_XS + NCW * 4)};
  const int tid = threadIdx.x;
  if (HIDDEN / gridDim.x + 1 > MAX_OWN_ROWS) __trap();  // more rows a CTA than h_own holds
  if (tid == 0) {
    for (int s = 0; s < NSLOTS; ++s) {
      mbar_init(&ring.full[s], 1);
      mbar_init(&ring.empty[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid >= NC) {  // the producer warp: one thread issues every copy
    if (tid == NC) produce(layers, ring, prof);
    return;
  }
  Step st{layers, h, out, final_ln, rope, (int)*position, (int)*seq_len, (int)*out_loc,
          req_to_token + (size_t)(*req_index) * req_to_token_stride, qkv_buf, part, act, counters,
          __ldcg(counters + EPOCH_AT), prof};
  consume(st, ring, sm, tid);
  if (blockIdx.x == 0 && tid == 0) counters[EPOCH_AT] = st.epoch + 1;  // after the last barrier
}

// dynamic shared memory the launch needs
extern "C" __global__ void smem_bytes_probe(int* out) { *out = SMEM_TOTAL; }
