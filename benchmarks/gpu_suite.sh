#!/usr/bin/env bash
# One device call runs one or more stages; each stage has its own timeout and writes its log and
# JSON under $OUT. Usage (on the device machine, from the repo root):
#   bash benchmarks/gpu_suite.sh smoke decode ...
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0

run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc"
  tail -n 25 "$OUT/$name.log"
}

ab_shape() {  # ab_shape NAME VARIANTS_FILE SECONDS SHAPE ROUNDS BATCH...: an engine A/B of a shape
  local name=$1 variants=$2 secs=$3 shape=$4 rounds=$5; shift 5
  run "$name" "$secs" python3 benchmarks/engine_ab.py --variants "$variants" --shape "$shape" \
    --rounds "$rounds" --batch-sizes "$@" --repeats 2 --timeout-s 150 --out "$OUT/$name.json"
}

ab_stage() {  # ab_stage NAME VARIANTS_FILE SECONDS BATCH...: an engine A/B of Qwen2-1.5B's shape
  local name=$1 variants=$2 secs=$3; shift 3
  ab_shape "$name" "$variants" "$secs" qwen2-1.5b "${ROUNDS:-2}" "$@"
}

make_model() {  # make_model NAME SHAPE SECONDS: the shape's random checkpoint made once in
  # BENCH_MODEL_CACHE (exported here) under its own timeout, for the processes after to share
  export BENCH_MODEL_CACHE=/tmp/bench_models
  run "$1" "$3" python3 -c "from benchmarks.decode_throughput import model_dir_for; print(model_dir_for('$2'))"
}

drop_model() {  # drop_model SHAPE: remove make_model's checkpoint (7-8B: 15-16 GB of disk)
  rm -rf "$BENCH_MODEL_CACHE/$1"
  unset BENCH_MODEL_CACHE
}

ab_cached() {  # ab_cached NAME VARIANTS_FILE SECONDS SHAPE ROUNDS BATCH...: ab_shape with the shape's
  # checkpoint made once for all the A/B's processes, and removed after
  make_model "${1}_make" "$4" 120
  ab_shape "$@"
  drop_model "$4"
}

for stage in "$@"; do
  case $stage in
    info) run info 60 bash -c 'nvidia-smi; python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__,torch.cuda.device_count())"' ;;
    smoke) run smoke 300 python3 -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_fused_ops.py \
              tests/test_overlap_schedule.py tests/test_triton_gemv.py tests/test_triton_sampler.py \
              tests/test_triton_pdl.py tests/test_triton_qkv_rope.py tests/test_triton_norm_qkv_rope.py \
              tests/test_sampler.py -p no:cacheprovider ;;
    # the fused Triton sampler on and off (ROLLOUT_FUSED_SAMPLER), engine alone
    sampler-ab) run sampler_ab 300 bash -c 'for s in 1 0; do ROLLOUT_FUSED_SAMPLER=$s python3 benchmarks/decode_throughput.py \
              --shape qwen2-1.5b --device cuda --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 \
              --new-tokens 128 --repeats 2 --skip-hf --out $OUT/sampler_$s.json; done' ;;
    # skinny-GEMM sweep; its table (gemv_configs.json) is what skinny-ab then runs with
    gemv) run gemv 330 python3 benchmarks/gpu_gemv.py --budget-s 150 --out "$OUT/gemv.json" \
              --configs-out "$OUT/gemv_configs.json" ;;
    # decode batches only: the M-tiled kernel's sweep (gemv_batch_configs.json), then the engine
    # with that table added and without it (the baked-in one), engine alone
    gemv-batch) run gemv_batch 420 python3 benchmarks/gpu_gemv.py --budget-s 240 --rows \
              --batch-rows 32 64 128 256 --shapes qkv o down gate_up --out "$OUT/gemv_batch.json" \
              --configs-out "$OUT/gemv_batch_configs.json" ;;
    batch-ab) run batch_ab 540 bash -c 'for t in with without; do \
              if [ $t = with ]; then export ROLLOUT_SKINNY_CONFIGS=${BATCH_CONFIGS:-$OUT/gemv_batch_configs.json}; \
              else unset ROLLOUT_SKINNY_CONFIGS; fi; python3 benchmarks/decode_throughput.py --shape qwen2-1.5b \
              --device cuda --dtype bfloat16 --batch-sizes 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 \
              --skip-hf --out $OUT/batch_$t.json; done' ;;
    # programmatic dependent launch on and off (ROLLOUT_PDL), engine alone
    pdl-ab) run pdl_ab 540 bash -c 'for s in 1 0; do ROLLOUT_PDL=$s python3 benchmarks/decode_throughput.py \
              --shape qwen2-1.5b --device cuda --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 \
              --new-tokens 128 --repeats 4 --skip-hf --out $OUT/pdl_$s.json; done' ;;
    # rotary + KV store in one kernel on and off (ROLLOUT_FUSED_ROPE_KV), engine alone
    rope-ab) run rope_ab 540 bash -c 'for r in 1a 0a 1b 0b; do ROLLOUT_FUSED_ROPE_KV=${r:0:1} python3 \
              benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda --dtype bfloat16 --batch-sizes 1 32 128 \
              --prompt-len 128 --new-tokens 128 --repeats 2 --skip-hf --out $OUT/rope_$r.json; done' ;;
    # batch 1 with a skinny-GEMM table override (CONFIGS=file, as written by gpu_gemv.py
    # --configs-out) and without, engine alone
    table-ab) run table_ab 400 bash -c 'for t in with without; do \
              if [ $t = with ]; then export ROLLOUT_SKINNY_CONFIGS=$CONFIGS; else unset ROLLOUT_SKINNY_CONFIGS; fi; \
              python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda --dtype bfloat16 \
              --batch-sizes 1 --prompt-len 128 --new-tokens 128 --repeats 6 --skip-hf --out $OUT/table_$t.json; done' ;;
    gemv-test) run gemv_test 240 python3 -m pytest -q -m gpu tests/test_triton_gemv.py -p no:cacheprovider ;;
    # the skinny-GEMM kernels on and off (ROLLOUT_SKINNY_GEMM), engine alone, small batches
    skinny-ab) [ -f "$OUT/gemv_configs.json" ] && export ROLLOUT_SKINNY_CONFIGS=$OUT/gemv_configs.json
              run skinny_ab 420 bash -c 'for s in 1 0; do ROLLOUT_SKINNY_GEMM=$s python3 benchmarks/decode_throughput.py \
              --shape qwen2-1.5b --device cuda --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 \
              --new-tokens 128 --repeats 2 --skip-hf --out $OUT/skinny_$s.json; done' ;;
    # the 128-row decode GEMMs as CUTLASS kernels with clusters (TMA multicast of x) next to cuBLAS
    # and the Triton table; carry .cutlass_build (the library built here, and CUTLASS's headers
    # to build it again on the device when it does not load)
    # batch 1's decoder stack as one persistent CUDA kernel, built by NVRTC on the device
    mk34) run mk34 300 python3 benchmarks/gpu_megakernel.py --out "$OUT/megakernel.json" ${MK_ARGS:-} ;;
    cutlass33) if ! python3 -c "import ctypes; ctypes.CDLL('.cutlass_build/libgemm_probe.so')"; then
              run cutlass_build 300 python3 benchmarks/gpu_cutlass_gemm.py --build .cutlass_build \
              --cutlass-include .cutlass_build/cutlass/include --jobs 16; fi
              run cutlass33 400 python3 benchmarks/gpu_cutlass_gemm.py --lib .cutlass_build/libgemm_probe.so \
              --out "$OUT/cutlass33.json" ;;
    decode) run decode 480 python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda \
              --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 \
              --out "$OUT/decode.json" ;;
    # one-request prefill graphs on and off, batch 1, engine alone, alternated
    prefill-ab) run prefill_ab 560 bash -c 'for r in on1 off1 on2 off2; do \
              if [ ${r:0:2} = on ]; then F=; else F=--no-prefill-graphs; fi; python3 benchmarks/decode_throughput.py \
              --shape qwen2-1.5b --device cuda --dtype bfloat16 --batch-sizes 1 --prompt-len 128 --new-tokens 128 \
              --repeats 3 --skip-hf $F --out $OUT/prefill_$r.json; done' ;;
    # the batch-1 prefill's host time by Python function (cProfile), with its wall and GPU time
    prefill-host) run prefill_host 300 python3 benchmarks/prefill_host_profile.py --out "$OUT/prefill_host.txt" ;;
    # batch 1: the one-row qkv / o GEMV launch configs (preload of the weight before the PDL
    # wait, block_n, warps), variants alternated (VARIANTS: see the script)
    preload-ab) run preload_ab 560 bash benchmarks/gpu_preload_ab.sh ${ROUNDS:-2} ${VARIANTS:-} ;;
    # eighth session: the one-row sweep with the K-chunk lookahead (down, gate/up, LM head), then
    # the engine A/B of benchmarks/ab_eighth_session.json (lookahead at batch 1; M-blocks inner in
    # the tensor-core grid, Triton qkv/o/down at batch 128)
    gemv-la) run gemv_la 150 python3 benchmarks/gpu_gemv.py --budget-s 60 --rows 1 --batch-rows \
              --shapes down gate_up lm_head --out "$OUT/gemv_la.json" --configs-out "$OUT/gemv_la_configs.json" ;;
    ab8) run ab8 540 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eighth_session.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 128 --out "$OUT/ab8.json" ;;
    # second round: one-row gate/up configs, and the fused gate/up + SiLU at 128 rows re-swept
    # with the M blocks innermost
    gemv-b128) run gemv_b128 150 env ROLLOUT_GEMM_M_INNER=1 python3 benchmarks/gpu_gemv.py --budget-s 60 \
              --rows --batch-rows 128 --shapes gate_up --out "$OUT/gemv_b128.json" --configs-out "$OUT/gemv_b128_configs.json" ;;
    # third round: the new table against gate/up and down preload variants (batch 1)
    ab8c) run ab8c 540 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eighth_session_c.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 128 --out "$OUT/ab8c.json" ;;
    # fourth round: the decode graph's logits cast to float32 inside the graph vs handed to the
    # sampler in the head's dtype
    ab8d) run ab8d 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eighth_session_d.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 32 128 --out "$OUT/ab8d.json" ;;
    # fifth round: decode attention launch configs in the engine (ROLLOUT_DECODE_ATTN_CONFIGS)
    ab8e) run ab8e 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eighth_session_e.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 128 --out "$OUT/ab8e.json" ;;
    ab8b) run ab8b 540 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eighth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 128 --out "$OUT/ab8b.json" ;;
    # ninth session: the TMA-fed decode-batch GEMM's sweep against cuBLAS and the table, then the
    # engine with TMA qkv/o (and gate/up) entries vs without, then the final table vs the eighth
    # session's; the decode attention over three slot layouts (the allocator's, random, contiguous)
    gemm-tma) run gemm_tma 330 python3 benchmarks/gpu_gemm_tma.py --case-budget-s ${CASE_S:-25} \
              --rows ${ROWS_TMA:-128 64} --out "$OUT/tma.json" --configs-out "$OUT/tma_configs.json" ;;
    ab9d) run ab9d 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_ninth_session_d.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 64 128 --out "$OUT/ab9d.json" ;;
    ab9e) run ab9e 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_ninth_session_e.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 128 --out "$OUT/ab9e.json" ;;
    attn-layouts) run attn_layouts 240 python3 benchmarks/gpu_attention.py --current-only --batches 1 32 128 \
              --layouts random engine contiguous --out "$OUT/attn_layouts.json" ;;
    # tenth session: the TMA kernel split along K and with swapped A/B, one row and decode
    # batches (down, the rest of gate/up at 128 rows, swapped gate/up at 32), and a prefill
    # chunk's fused gate/up + SiLU against cuBLAS + the SiLU kernel; the batch-128 prefill's kernels
    tma10) run tma10_rows1 200 python3 benchmarks/gpu_gemm_tma.py --case-budget-s ${CASE_S:-30} --rows 1 \
              --shapes gate_up down qkv o --out "$OUT/tma10_rows1.json" --configs-out "$OUT/tma10_rows1_configs.json"
           run tma10_down 160 python3 benchmarks/gpu_gemm_tma.py --case-budget-s ${CASE_S:-30} --rows 128 64 32 \
              --shapes down --out "$OUT/tma10_down.json" --configs-out "$OUT/tma10_down_configs.json"
           run tma10_gate_up 120 python3 benchmarks/gpu_gemm_tma.py --case-budget-s ${CASE_S:-30} --rows 128 32 \
              --shapes gate_up --out "$OUT/tma10_gate_up.json" --configs-out "$OUT/tma10_gate_up_configs.json"
           run tma10_prefill 120 python3 benchmarks/gpu_gemm_tma.py --case-budget-s 50 --rows 8192 \
              --shapes gate_up --out "$OUT/tma10_prefill.json" ;;
    tma10b) run tma10b 150 bash -c 'python3 benchmarks/gpu_gemm_tma.py --case-budget-s 25 --rows 128 \
              --shapes gate_up down --out $OUT/tma10b.json && python3 benchmarks/gpu_gemm_tma.py --case-budget-s 15 \
              --rows 8192 --shapes gate_up --out $OUT/tma10b_prefill.json' ;;
    tma10c) run tma10c 260 python3 benchmarks/gpu_gemm_tma.py --case-budget-s 20 --rows 128 64 32 \
              --shapes qkv o --out "$OUT/tma10c.json" --configs-out "$OUT/tma10c_configs.json"
            run tma10d 120 python3 benchmarks/gpu_gemm_tma.py --case-budget-s 25 --rows 64 \
              --shapes gate_up --out "$OUT/tma10d.json" --configs-out "$OUT/tma10d_configs.json"
            run tma10e 90 python3 benchmarks/gpu_gemm_tma.py --case-budget-s 25 --rows 128 \
              --shapes lm_head --out "$OUT/tma10e.json" --configs-out "$OUT/tma10e_configs.json" ;;
    ab10d) run ab10d 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_tenth_session_d.json \
              --rounds ${ROUNDS:-2} --repeats 3 --batch-sizes 128 --out "$OUT/ab10d.json" ;;
    extend) run extend 200 python3 benchmarks/gpu_extend.py --out "$OUT/extend.json" ;;
    ab10) run ab10 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_tenth_session.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 64 --out "$OUT/ab10.json" ;;
    ab10b) run ab10b 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_tenth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes 128 --out "$OUT/ab10b.json" ;;
    ab11b) run ab11b 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eleventh_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes 128 --out "$OUT/ab11b.json" ;;
    ab11c) run ab11c 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eleventh_session_c.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 64 --out "$OUT/ab11c.json" ;;
    prefill-host-graphed) run prefill_host_graphed 200 python3 benchmarks/prefill_host_profile.py --graphed \
              --calls 20 --out "$OUT/prefill_host_graphed.txt" ;;
    prefill-host128) run prefill_host128 200 python3 benchmarks/prefill_host_profile.py --batch 128 --calls 3 \
              --out "$OUT/prefill_host128.txt" ;;
    tma10-prefill) run tma10_prefill 120 python3 benchmarks/gpu_gemm_tma.py --case-budget-s 30 --rows 8192 \
              --shapes gate_up --out "$OUT/tma10_prefill.json" ;;
    prefill-kernels) run prefill_kernels 200 python3 benchmarks/prefill_kernel_profile.py --batch 128 \
              --out "$OUT/prefill_kernels.json" ;;
    # the decode graph kernel by kernel (PDL off, so that durations add up)
    kernels) run kernels 300 env ROLLOUT_PDL=0 python3 benchmarks/graph_kernel_profile.py --out "$OUT/kernels.json" ;;
    profile) run profile 400 python3 benchmarks/profile_decode.py --out "$OUT/profile.txt" ;;
    decode-quick) run decode_quick 300 python3 benchmarks/decode_throughput.py --shape qwen2-1.5b \
              --device cuda --dtype bfloat16 --batch-sizes 1 128 --prompt-len 128 --new-tokens 64 \
              --repeats 1 --skip-hf --out "$OUT/decode_quick.json" ;;
    parity) run parity 500 python3 benchmarks/gpu_parity.py --hf-control --out "$OUT/parity.json" ;;
    parity32) run parity32 500 python3 benchmarks/gpu_parity.py --dtype float32 --out "$OUT/parity32.json" ;;
    parity_fi) run parity_fi 400 bash -c 'fi_env=$(bash scripts/flashinfer_wheels.sh install) && eval "$fi_env" \
              && python3 benchmarks/gpu_parity.py --skip-tp --flashinfer --out $OUT/parity_fi.json \
              && python3 benchmarks/gpu_parity.py --skip-tp --flashinfer --hf-control --dtype float16 \
                 --out $OUT/parity_fi16.json' ;;
    wsync) run wsync 540 python3 benchmarks/gpu_weight_sync.py --out "$OUT/weight_sync_check.json" \
              --bench-out "$OUT" ;;
    memory_release) run memory_release 240 bash -c "python3 benchmarks/gpu_memory_release.py --shape qwen2-1.5b \
              --out $OUT/memory_release.json && python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_memory_release.py" ;;
    grpo) run grpo 300 bash -c "python3 examples/grpo.py --device cuda --dtype bfloat16 --transport nccl --steps 6 \
              && python3 examples/grpo.py --device cuda --dtype bfloat16 --transport ipc --steps 6" ;;
    wsq) run wsq 240 python3 -c "import ray, sys; ray.init(num_gpus=1, num_cpus=16, include_dashboard=False); \
              from actors.bench_cli import main; sys.exit(main(['bench', 'weight-sync', '--device', 'cuda', \
              '--transports', 'nccl', 'ipc', '--shapes', 'qwen2-1.5b', 'qwen2-7b', '--iters', '7', '--bucket-mb', '512', \
              '--out', '$OUT/wsq', '--no-progress']))" ;;
    wsync-test) run wsync_test 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ipc_registered_gpu.py ;;
    # registered ipc (issue #7), one GPU is enough; then again with every copy through _foreach_copy_
    wsipc) run wsipc 480 bash -c "python3 -c \"import ray, sys; ray.init(num_gpus=1, num_cpus=16, include_dashboard=False); \
              from actors.bench_cli import main; sys.exit(main(['bench', 'weight-sync', '--device', 'cuda', \
              '--transports', 'ipc', '--shapes', 'qwen2-1.5b', 'qwen2-7b', '--iters', '9', '--out', '$OUT/wsipc', '--no-progress']))\" \
              && WEIGHT_SYNC_DIRECT_COPY_MB=-1 python3 -c \"import ray, sys; ray.init(num_gpus=1, num_cpus=16, include_dashboard=False); \
              from actors.bench_cli import main; sys.exit(main(['bench', 'weight-sync', '--device', 'cuda', \
              '--transports', 'ipc', '--shapes', 'qwen2-1.5b', '--iters', '9', '--out', '$OUT/wsipc_foreach', '--no-progress']))\"" ;;
    flashinfer) run flashinfer 540 bash -c 'fi_env=$(bash scripts/flashinfer_wheels.sh install) && eval "$fi_env" \
              && python3 -c "import flashinfer, tvm_ffi; print(flashinfer.__version__, tvm_ffi.__version__)" \
              && python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_flashinfer_backend.py \
              && for b in flashinfer triton; do python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda \
                 --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 --skip-hf \
                 --attention-backend $b --out $OUT/decode_$b.json; done' ;;
    # twelfth session: the decode attention at batch 128 with long contexts, one split (the
    # table's) against two and four splits + the merge kernel
    attn-long) for keys in "1024 1536" "3072 4096"; do
         run attn_long_${keys%% *} 150 python3 benchmarks/gpu_attention.py --batches 128 --keys $keys \
              --configs 2,64,2,3 4,64,2,3 2,128,4,2 --out "$OUT/attn_long_${keys%% *}.json"
         done ;;
    # a decode layer's main kernels alone under Nsight Compute (little memory to save and restore
    # between its passes), at NCU_ROWS rows (128, 1); details and raw pages as CSV
    ncu-kernels) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
         for r in ${NCU_ROWS:-128}; do
           run ncu_kernels_r$r 200 "$NCU" --profile-from-start off --clock-control none --set detailed -f \
              --export "$OUT/ncu_kernels_r$r" python3 benchmarks/ncu_kernels.py --rows $r
           "$NCU" --import "$OUT/ncu_kernels_r$r.ncu-rep" --csv --page details > "$OUT/ncu_kernels_r${r}_details.csv" 2>&1
           "$NCU" --import "$OUT/ncu_kernels_r$r.ncu-rep" --csv --page raw > "$OUT/ncu_kernels_r${r}_raw.csv" 2>&1
           rm -f "$OUT/ncu_kernels_r$r.ncu-rep"
           python3 benchmarks/ncu_summary.py --details "$OUT/ncu_kernels_r${r}_details.csv" \
              --raw "$OUT/ncu_kernels_r${r}_raw.csv" --label "$r rows" --out "$OUT/ncu_kernels_r$r.json"
         done ;;
    # the attention's one split with 256 keys a step, alone; then the engine A/B of down through
    # the TMA kernel at 65-128 rows and of that attention config
    attn-256) run attn_256 120 python3 benchmarks/gpu_attention.py --batches 128 \
              --configs 1,256,8,2 1,256,4,2 1,128,8,2 1,256,8,1 --out "$OUT/attn_256.json" ;;
    ab12) run ab12 420 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twelfth_session.json \
              --rounds ${ROUNDS:-2} --batch-sizes 128 --out "$OUT/ab12.json" ;;
    # qkv and o at decode batches: narrow weight tiles (16 rows) or K split in 2, alone; then the
    # engine with the winners (the sweep's configs file) against the table
    tma-narrow) run tma_narrow 200 python3 benchmarks/gpu_gemm_tma.py --narrow --case-budget-s 25 \
              --rows 128 64 32 --shapes qkv o --out "$OUT/tma_narrow.json" --configs-out "$OUT/tma_narrow_configs.json"
              cat "$OUT/tma_narrow_configs.json" ;;
    ab12b) run ab12b 280 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twelfth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 64 128 --timeout-s 120 --out "$OUT/ab12b.json" ;;
    # thirteenth session: down's split-K partials summed by the residual add + RMSNorm after it
    # (its GPU specs; down + add-norm pairs alone over split configs; the engine A/B)
    split-test) run split_test 300 python3 -m pytest -q -m gpu tests/test_split_sum.py tests/test_fused_ops.py \
              tests/test_triton_gemv.py -p no:cacheprovider ;;
    split-norm) for shape in ${SPLIT_SHAPES:-down}; do
              run split_norm_$shape 300 python3 benchmarks/gpu_split_norm.py --shape $shape \
              --rows ${SPLIT_ROWS:-1 128 64 32} --case-budget-s ${CASE_S:-45} --out "$OUT/split_norm_$shape.json" \
              --configs-out "$OUT/split_norm_${shape}_configs.json"
              cat "$OUT/split_norm_${shape}_configs.json"; done ;;
    ab13b) run ab13b 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirteenth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1 32 64 128} --timeout-s 150 --out "$OUT/ab13b.json" ;;
    ab13c) run ab13c 540 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirteenth_session_c.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-32 64 128} --timeout-s 150 --out "$OUT/ab13c.json" ;;
    ab13d) run ab13d 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirteenth_session_d.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 --timeout-s 120 --out "$OUT/ab13d.json" ;;
    ab13e) run ab13e 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirteenth_session_e.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 32 64 128 --timeout-s 120 --out "$OUT/ab13e.json" ;;
    ab13f) run ab13f 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirteenth_session_f.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 64 128 --timeout-s 100 --out "$OUT/ab13f.json" ;;
    ab13) run ab13 560 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirteenth_session.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1 32 64 128} --timeout-s 150 --out "$OUT/ab13.json" ;;
    # fourteenth session: PDL's trigger before the wait (ROLLOUT_PDL_EARLY_TRIGGER): its GPU
    # specs (the same bits), then the engine A/B
    pdl-test) run pdl_test 240 python3 -m pytest -q -m gpu tests/test_triton_pdl.py -p no:cacheprovider ;;
    ab14b) run ab14b 540 python3 benchmarks/engine_ab.py --variants benchmarks/ab_fourteenth_session.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1 32 64 128} --timeout-s 150 --out "$OUT/ab14b.json" ;;
    ab14c) run ab14c 480 python3 benchmarks/engine_ab.py --variants benchmarks/ab_fourteenth_session_c.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 --timeout-s 100 --out "$OUT/ab14c.json" ;;
    ab14d) run ab14d 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_fourteenth_session_d.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 --timeout-s 100 --out "$OUT/ab14d.json" ;;
    ab14f) run ab14f 190 python3 benchmarks/engine_ab.py --variants benchmarks/ab_fourteenth_session_f.json \
              --rounds ${ROUNDS:-1} --batch-sizes 32 64 128 --timeout-s 60 --out "$OUT/ab14f.json" ;;
    # fifteenth session: the one-row qkv GEMV with the rotary and the KV store in its epilogue
    # (its GPU specs and those of the kernels it shares code with; the engine A/B at batch 1)
    qkv-rope-test) run qkv_rope_test 300 python3 -m pytest -q -m gpu tests/test_triton_qkv_rope.py \
              tests/test_triton_gemv.py tests/test_triton_pdl.py -p no:cacheprovider ;;
    ab15) run ab15 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_fifteenth_session.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1} --timeout-s 100 --out "$OUT/ab15.json" ;;
    # the decode attention's earlier keys and values loaded before its PDL wait: GPU specs, A/B
    attn-preload-test) run attn_preload_test 200 python3 -m pytest -q -m gpu tests/test_triton_kernels.py \
              -k "decode_after or decode_kernel" -p no:cacheprovider ;;
    ab15b) run ab15b 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_fifteenth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1 32} --timeout-s 100 --out "$OUT/ab15b.json" ;;
    ab15c) run ab15c 480 python3 benchmarks/engine_ab.py --variants benchmarks/ab_fifteenth_session_c.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1} --timeout-s 100 --out "$OUT/ab15c.json" ;;
    # the TMA qkv tiles with the rotary in their epilogue: GPU specs, the A/B at decode batches,
    # then the decode benchmark with the A/B's winner (ROLLOUT_FUSED_QKV_ROPE)
    final15) run qkv_rope_gpu 170 python3 -m pytest -q -m gpu tests/test_triton_qkv_rope.py \
              tests/test_triton_gemv.py -p no:cacheprovider
         run ab15d 320 python3 benchmarks/engine_ab.py --variants benchmarks/ab_fifteenth_session_d.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 64 128 --timeout-s 100 --out "$OUT/ab15d.json"
         mode=$(python3 -c "import json; s = json.load(open('$OUT/ab15d.json'))['summary']; \
              t = {v: sum(r['graph_replay_ms'] for r in s[v].values()) for v in s}; \
              print('1' if t['fused'] < t['rotary_kernel'] else 'one_row')" 2>/dev/null || echo one_row)
         echo "decode with ROLLOUT_FUSED_QKV_ROPE=$mode"
         export ROLLOUT_FUSED_QKV_ROPE=$mode
         run decode 240 python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda \
              --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 \
              --out "$OUT/decode.json"
         unset ROLLOUT_FUSED_QKV_ROPE ;;
    # what each op of a layer costs the decode step (the step without it; decode_ablated.py)
    ablation) run ablation 560 python3 benchmarks/engine_ab.py --variants benchmarks/ab_fifteenth_session_ablation.json \
              --rounds ${ROUNDS:-1} --batch-sizes ${AB_BATCHES:-1 128} --repeats 1 --timeout-s 90 --out "$OUT/ablation.json" ;;
    # a generate call laid out on the GPU's timeline: prefill, steps, idle gaps, sampler, tail
    timeline) run timeline 300 python3 benchmarks/step_timeline.py --batch-sizes ${TL_BATCHES:-1 128} \
              --out "$OUT/timeline.json" ;;
    # sixteenth session: the attention's merge kernel's cost to the step (ablated), batch 1
    ab16-merge) run ab16_merge 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_sixteenth_session_merge.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1} --repeats 2 --timeout-s 90 --out "$OUT/ab16_merge.json" ;;
    # sixteenth session: the specs of the one-pass sampler and the fewer per-step ops; what the
    # engine samples before / with the two-pass sampler / now; the engine A/B of the three
    # (base16.tar: `git archive 8ece7e2`, carried untracked, not committed)
    smoke16) run smoke16 300 python3 -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_triton_sampler.py \
              tests/test_overlap_schedule.py tests/test_batch_builder.py tests/test_memory_release.py tests/test_sampler.py \
              -p no:cacheprovider ;;
    # (parity16 ran at commit dedc409, when ROLLOUT_SAMPLER_PASSES=2 still chose the two-pass kernels)
    parity16) mkdir -p /tmp/base16 && tar -xf base16.tar -C /tmp/base16
              run parity16 240 bash -c 'PYTHONPATH=/tmp/base16:$PYTHONPATH python3 benchmarks/sample_dump.py --out $OUT/samples_before.json \
              && ROLLOUT_SAMPLER_PASSES=2 python3 benchmarks/sample_dump.py --out $OUT/samples_two_pass.json \
              && python3 benchmarks/sample_dump.py --out $OUT/samples_now.json \
              && python3 benchmarks/sample_dump.py --compare $OUT/samples_before.json $OUT/samples_two_pass.json \
              && python3 benchmarks/sample_dump.py --compare $OUT/samples_two_pass.json $OUT/samples_now.json' ;;
    ab16c) mkdir -p /tmp/base16 && tar -xf base16.tar -C /tmp/base16
              run ab16c 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_sixteenth_session_c.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 128 --repeats 2 --timeout-s 100 --out "$OUT/ab16c.json" ;;
    # batch 128's decode attention with the first block preloaded before the PDL wait
    ab16d) run ab16d 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_sixteenth_session_d.json \
              --rounds ${ROUNDS:-2} --batch-sizes 128 --repeats 2 --timeout-s 90 --out "$OUT/ab16d.json" ;;
    # seventeenth session: the decode attention's preloaded first block summed last, the slots
    # alone preloaded; `before` is commit 5c2ee26's tree (git archive 5c2ee26 -o base17.tar)
    attn-test) run attn_test 240 python3 -m pytest -q -m gpu tests/test_triton_kernels.py -k decode -p no:cacheprovider ;;
    ab17a) mkdir -p /tmp/base17 && tar -xf base17.tar -C /tmp/base17
           run ab17a 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_seventeenth_session.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 32 --repeats 2 --timeout-s 100 --out "$OUT/ab17a.json" ;;
    ab17b) mkdir -p /tmp/base17 && tar -xf base17.tar -C /tmp/base17
           run ab17b 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_seventeenth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes 128 --repeats 2 --timeout-s 100 --out "$OUT/ab17b.json" ;;
    kernels-test) run kernels_test 300 python3 -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_fused_ops.py \
              tests/test_triton_qkv_rope.py tests/test_triton_gemv.py tests/test_triton_pdl.py -p no:cacheprovider ;;
    ab17c) mkdir -p /tmp/base17 && tar -xf base17.tar -C /tmp/base17
           run ab17c 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_seventeenth_session_c.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 --repeats 2 --timeout-s 100 --out "$OUT/ab17c.json" ;;
    ab17d) mkdir -p /tmp/base17 && tar -xf base17.tar -C /tmp/base17
           run ab17d 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_seventeenth_session_d.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 128 --repeats 2 --timeout-s 100 --out "$OUT/ab17d.json" ;;
    ab17e) run ab17e 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_seventeenth_session_e.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 --repeats 2 --timeout-s 100 --out "$OUT/ab17e.json" ;;
    ab17f) run ab17f 200 python3 benchmarks/engine_ab.py --variants benchmarks/ab_seventeenth_session_f.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 --repeats 2 --timeout-s 100 --out "$OUT/ab17f.json" ;;
    ab17g) run ab17g 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_seventeenth_session_g.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 32 --repeats 2 --timeout-s 100 --out "$OUT/ab17g.json" ;;
    # the engine's sampled tokens and logprobs: commit 5c2ee26's tree against this one's
    parity17) mkdir -p /tmp/base17 && tar -xf base17.tar -C /tmp/base17
              run parity17 240 bash -c 'PYTHONPATH=/tmp/base17:$PYTHONPATH python3 benchmarks/sample_dump.py --out $OUT/samples_before.json \
              && python3 benchmarks/sample_dump.py --out $OUT/samples_now.json \
              && python3 benchmarks/sample_dump.py --compare $OUT/samples_before.json $OUT/samples_now.json' ;;
    # eighteenth session: down two chunks ahead; the norm / merge kernels' warps (patched trees).
    # Each patches the code it was measured on: run it from that tree (ab18b: d03a162; ab18c and
    # ab18d: fe1a4d2; ab18e: d07210a with FEW_ROWS_NORM_ELEMENTS_PER_THREAD = 4); on later code
    # the patches match nothing (the stage's grep counts print 0) and the variants equal "now".
    ab18b) for t in nw4 nw16 mw1; do rm -rf /tmp/$t && mkdir -p /tmp/$t && cp -r rollout benchmarks /tmp/$t/; done
           sed -i '135s/num_warps=_num_warps(block)/num_warps=4/' /tmp/nw4/rollout/layers/triton_ops.py
           sed -i '135s/num_warps=_num_warps(block)/num_warps=16/' /tmp/nw16/rollout/layers/triton_ops.py
           sed -i '304s/num_warps=4/num_warps=1/' /tmp/mw1/rollout/attention/triton_kernels/decode.py
           grep -c "num_warps=4, enable_fp" /tmp/nw4/rollout/layers/triton_ops.py; grep -c "num_warps=16, enable" /tmp/nw16/rollout/layers/triton_ops.py
           grep -c "NUM_SPLITS=num_splits, num_warps=1" /tmp/mw1/rollout/attention/triton_kernels/decode.py
           run ab18b 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eighteenth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 --repeats 2 --timeout-s 100 --out "$OUT/ab18b.json" ;;
    ab18c) for t in nw8 nw32 mw2; do rm -rf /tmp/$t && mkdir -p /tmp/$t && cp -r rollout benchmarks /tmp/$t/; done
           sed -i 's/^ONE_ROW_NORM_ELEMENTS_PER_THREAD = 4/ONE_ROW_NORM_ELEMENTS_PER_THREAD = 8/' /tmp/nw8/rollout/layers/triton_ops.py
           sed -i 's/^ONE_ROW_NORM_ELEMENTS_PER_THREAD = 4/ONE_ROW_NORM_ELEMENTS_PER_THREAD = 2/' /tmp/nw32/rollout/layers/triton_ops.py
           sed -i '304s/num_warps=4/num_warps=2/' /tmp/mw2/rollout/attention/triton_kernels/decode.py
           grep -h "^ONE_ROW_NORM" /tmp/nw8/rollout/layers/triton_ops.py /tmp/nw32/rollout/layers/triton_ops.py
           grep -c "NUM_SPLITS=num_splits, num_warps=2" /tmp/mw2/rollout/attention/triton_kernels/decode.py
           run ab18c 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eighteenth_session_c.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 --repeats 2 --timeout-s 100 --out "$OUT/ab18c.json" ;;
    ab18d) rm -rf /tmp/nw16r && mkdir -p /tmp/nw16r && cp -r rollout benchmarks /tmp/nw16r/
           sed -i 's/    if programs == 1:/    if programs <= 256:/' /tmp/nw16r/rollout/layers/triton_ops.py
           grep -c "if programs <= 256:" /tmp/nw16r/rollout/layers/triton_ops.py
           run ab18d 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eighteenth_session_d.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 128 --repeats 2 --timeout-s 100 --out "$OUT/ab18d.json" ;;
    ab18e) rm -rf /tmp/nw32r && mkdir -p /tmp/nw32r && cp -r rollout benchmarks /tmp/nw32r/
           sed -i 's/^FEW_ROWS_NORM_ELEMENTS_PER_THREAD = 4/FEW_ROWS_NORM_ELEMENTS_PER_THREAD = 2/' /tmp/nw32r/rollout/layers/triton_ops.py
           grep -c "^FEW_ROWS_NORM_ELEMENTS_PER_THREAD = 2" /tmp/nw32r/rollout/layers/triton_ops.py
           run ab18e 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_eighteenth_session_e.json \
              --rounds ${ROUNDS:-2} --batch-sizes 32 128 --repeats 2 --timeout-s 100 --out "$OUT/ab18e.json" ;;
    # the engine's sampled tokens and logprobs: the session's starting tree (ac27f7b) against this one's
    parity18) mkdir -p /tmp/base18 && tar -xf base18.tar -C /tmp/base18
              run parity18 220 bash -c 'PYTHONPATH=/tmp/base18:$PYTHONPATH python3 benchmarks/sample_dump.py --out $OUT/samples_before.json \
              && python3 benchmarks/sample_dump.py --out $OUT/samples_now.json \
              && python3 benchmarks/sample_dump.py --compare $OUT/samples_before.json $OUT/samples_now.json' ;;
    # the fused sampler's specs on the GPU (both launch shapes of the tests, chi-square)
    sampler-test) run sampler_test 200 python3 -m pytest -q -m gpu tests/test_triton_sampler.py -p no:cacheprovider ;;
    # nineteenth session: a call's wall time split unprofiled (fixed cost, a step's slope, the
    # graph's replay: what a step spends outside the graph), engine alone
    breakdown) run breakdown 300 python3 benchmarks/call_breakdown.py --batch-sizes ${BD_BATCHES:-1 128} \
              --out "$OUT/breakdown.json" ;;
    # nineteenth session: the specs of the step's new outside-graph path (the graph's input kernel,
    # the pinned sampler pack, the copy stream), of the embedding + rotary kernel, and the
    # engine-level ones around them
    smoke19) run smoke19 360 bash -c 'python3 -m pytest -q tests/test_graph_inputs.py tests/test_triton_embed.py -p no:cacheprovider \
              && python3 -m pytest -q -m gpu tests/test_triton_sampler.py tests/test_overlap_schedule.py tests/test_triton_kernels.py \
              tests/test_batch_builder.py tests/test_sampler.py tests/test_fused_ops.py -p no:cacheprovider' ;;
    # the session's start (base19.tar: `git archive 724580c`, carried untracked) against now and
    # the three changes one at a time off
    ab19a) mkdir -p /tmp/base19 && tar -xf base19.tar -C /tmp/base19
           run ab19a 420 python3 benchmarks/engine_ab.py --variants benchmarks/ab_nineteenth_session.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1 128} --repeats 2 --timeout-s 100 --out "$OUT/ab19a.json" ;;
    ab19b) run ab19b 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_nineteenth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes 128 --repeats 2 --timeout-s 100 --out "$OUT/ab19b.json" ;;
    ab19c) run ab19c 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_nineteenth_session_c.json \
              --rounds ${ROUNDS:-2} --batch-sizes 1 128 --repeats 2 --timeout-s 100 --out "$OUT/ab19c.json" ;;
    parity19) mkdir -p /tmp/base19 && tar -xf base19.tar -C /tmp/base19
              run parity19 220 bash -c 'PYTHONPATH=/tmp/base19:$PYTHONPATH python3 benchmarks/sample_dump.py --out $OUT/samples_before.json \
              && python3 benchmarks/sample_dump.py --out $OUT/samples_now.json \
              && python3 benchmarks/sample_dump.py --compare $OUT/samples_before.json $OUT/samples_now.json' ;;
    # twenty-sixth session: the one-request prefill graphs with the decode forwards' early PDL
    # trigger: their GPU spec under it, the prefill alone (one new token) and the batch-1 call,
    # on and off alternated (benchmarks/ab_twentysixth_session.json; the switch was removed in
    # 1454af7: no gain)
    prefill26) run prefill26 300 env ROLLOUT_PDL_EARLY_PREFILL_GRAPHS=1 python3 -m pytest -q -m gpu \
              tests/test_triton_kernels.py -k "prefill_graphs" -p no:cacheprovider ;;
    pre26) run pre26 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twentysixth_session.json \
              --rounds 3 --batch-sizes 1 --new-tokens 1 --repeats 30 --timeout-s 120 --out "$OUT/pre26.json" ;;
    ab26a) ab_stage ab26a benchmarks/ab_twentysixth_session.json 300 1 ;;
    # twenty-seventh session: per-head attention at batch 1 with the small graph inputs; wider
    # own input tables at batches 4 and 16; the first multi-request generates' compiles
    ab27a) ab_stage ab27a benchmarks/ab_twentyseventh_session.json 240 1 ;;
    ab27b) ab_stage ab27b benchmarks/ab_twentyseventh_session_b.json 260 4 16 ;;
    ab27c) ab_stage ab27c benchmarks/ab_twentyseventh_session_c.json 420 1 ;;
    # a prompt's samples sharing its KV (prompt_group): the GPU spec, then GRPO-shaped batches
    # (16 / 4 prompts x 8 samples) with sharing (and HF) and without
    share28) run share28_specs 200 python3 -m pytest -q -m gpu tests/test_prompt_sharing.py -p no:cacheprovider
              run share28_on 240 python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda \
              --dtype bfloat16 --batch-sizes 32 128 --samples-per-prompt 8 --prompt-len 128 \
              --new-tokens 128 --repeats 2 --out "$OUT/share28_on.json"
              run share28_off 180 python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda \
              --dtype bfloat16 --batch-sizes 32 128 --samples-per-prompt 8 --prompt-len 128 \
              --new-tokens 128 --repeats 2 --no-share-prompt-kv --skip-hf --out "$OUT/share28_off.json" ;;
    # where a GRPO-shaped call's time goes with and without sharing (one prefill + steps)
    share28b) run share28b_specs 200 python3 -m pytest -q -m gpu tests/test_prompt_sharing.py -p no:cacheprovider
              for s in on off; do flag=; [ $s = off ] && flag=--no-share-prompt-kv
              run share28b_$s 200 python3 benchmarks/call_breakdown.py --batch-sizes 32 128 \
              --samples-per-prompt 8 --repeats 3 $flag --out "$OUT/share28b_$s.json"; done ;;
    # long shared prompts: does a group's one copy of its prompt's KV also cut decode time?
    share28c) for s in on off; do flag=; [ $s = off ] && flag=--no-share-prompt-kv
              run share28c_$s 240 python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda \
              --dtype bfloat16 --batch-sizes 128 --samples-per-prompt 8 --prompt-len 2048 \
              --new-tokens 64 --repeats 2 --skip-hf $flag --out "$OUT/share28c_$s.json"; done ;;
    sync27) run sync27 200 python3 benchmarks/sync_audit.py --batch-sizes 1 8 128 --out "$OUT/sync27.json" ;;
    lead27) run lead27 200 python3 benchmarks/prefill_host_lead.py --batch 128 --cprofile 30 --out "$OUT/lead27.json" ;;
    startup27) run startup27 200 python3 benchmarks/startup_time.py --workers 16 --rounds 1 \
              --timeout-s 150 --out "$OUT/startup27.json" ;;
    # the eager multi-request prefills compiled ahead (eager_prefill_ahead), extend / embed
    # kernels unspecialized on their index views' alignment: the GPU specs touched, a start-up
    ahead27) run ahead27 500 python3 -m pytest -q -m gpu tests/test_compile_ahead.py tests/test_triton_kernels.py tests/test_triton_embed.py \
              tests/test_fused_ops.py -p no:cacheprovider ;;
    # the step's kernels outside the graphs compiled ahead too: the GPU specs of the compile-ahead
    # and of the kernels whose batch sizes are no longer specialized; a cold and a warm start-up
    ahead26) run ahead26 400 python3 -m pytest -q -m gpu tests/test_compile_ahead.py tests/test_graph_inputs.py \
              tests/test_triton_sampler.py tests/test_overlap_schedule.py -p no:cacheprovider ;;
    startup26) run startup26 300 python3 benchmarks/startup_time.py --workers 16 --rounds 1 \
              --timeout-s 120 --out "$OUT/startup26.json" ;;
    # the per-head decode attention at batch 1 against the split kernel, by the engine's sizing
    # (benchmarks/ab_twentysixth_session_b.json)
    shape26) run shape26 560 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twentysixth_session_b.json \
              --rounds 2 --batch-sizes 1 --repeats 2 --timeout-s 120 --out "$OUT/shape26.json" ;;
    # the batch-1 decode graph's Triton variants by the engine's sizing (graph_variants.py)
    variants26) run variants26 300 python3 benchmarks/graph_variants.py --shapes 128: 128:1 1: \
              --out "$OUT/variants26.json" ;;
    # the batch-1 graph's memory: own pools, capture order (benchmarks/ab_twentysixth_session_c.json)
    pool26) run pool26 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twentysixth_session_c.json \
              --rounds 2 --batch-sizes 1 --repeats 2 --timeout-s 120 --out "$OUT/pool26.json" ;;
    # the batch-1 graph: all graph sizes, sizes 1 and 128, size 1 (ab_twentysixth_session_d.json)
    sizes26) run sizes26 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twentysixth_session_d.json \
              --rounds 2 --batch-sizes 1 --repeats 2 --timeout-s 120 --out "$OUT/sizes26.json" ;;
    # the batch-1 graph with static inputs or attention scratch of its own (ab_twentysixth_session_e.json)
    tiers26) run tiers26 330 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twentysixth_session_e.json \
              --rounds 2 --batch-sizes 1 --repeats 2 --timeout-s 100 --out "$OUT/tiers26.json" ;;
    # twenty-fifth session: cold start-ups (an empty Triton cache each) with the graphs' kernels
    # compiled ahead in threads and one at a time, alternated, then each once more on its warm
    # cache; the compile-ahead GPU spec; the batch-1 decode graph in the decode benchmark's
    # process, timed through its states (engine alone, right after HF calls, after one action
    # each) beside nvidia-smi's clocks (benchmarks/process_shape.py)
    startup25) run startup25 560 python3 benchmarks/startup_time.py --workers 16 0 --rounds 2 \
              --timeout-s 120 --out "$OUT/startup25.json" ;;
    ahead25) run ahead25 400 python3 -m pytest -q -m gpu tests/test_compile_ahead.py tests/test_overlap_schedule.py \
              -p no:cacheprovider ;;
    shape25) run shape25 300 python3 benchmarks/process_shape.py --out "$OUT/shape25.json" \
              --smi-log "$OUT/shape25_smi.csv" ;;
    # twenty-third session: the decode attention a program per query head (decode_head.py):
    # the GPU specs of the attention kernels, the kernels alone, the engine A/B at batch 1
    # twenty-fourth session: the per-head kernel in one split at batch 1 in the decode benchmark's
    # process shape; batches 1-8 at long contexts alone (split + merge vs per-head splits); the
    # engine at batch 1 and 4 with a 3,968-token prompt, split + merge vs per-head
    ab24a) ab_stage ab24a benchmarks/ab_twentyfourth_session.json 330 1 32 128 ;;
    attn24) run attn24 200 python3 benchmarks/gpu_attention.py --batches 1 2 4 8 --keys 2048 4096 \
              --configs 8,32,4,2,1 8,256,8,2,1,1 4,256,8,2,1,1 2,256,8,2,1,1 1,256,8,2,1,1 --out "$OUT/attn24.json"
            run attn24b 200 python3 benchmarks/gpu_attention.py --batches 1 2 4 --keys 8192 16384 \
              --configs 8,32,4,2,1 8,256,8,2,1,1 4,256,8,2,1,1 2,256,8,2,1,1 --out "$OUT/attn24b.json" ;;
    long24) run long24 300 bash -c 'for v in split head; do if [ $v = head ]; then \
              export ROLLOUT_DECODE_ATTN_CONFIGS="1:8,256,8,2,1,1;4:2,256,8,2,1,1;16:8,32,4,2,1;64:4,64,2,3;256:1,128,4,2,1"; \
              else unset ROLLOUT_DECODE_ATTN_CONFIGS; fi; python3 benchmarks/decode_throughput.py --shape qwen2-1.5b \
              --device cuda --dtype bfloat16 --batch-sizes 1 4 --prompt-len 3968 --new-tokens 128 --repeats 2 \
              --skip-hf --out $OUT/long24_$v.json | grep -E "graph_replay_ms|\"tok_per_s\"|startup" | head -6; done' ;;
    # the launch classes (decode graphs per context class): the kernel specs compiled, the new
    # GPU graph spec among them; the engine at one and two requests with a 3,968-token prompt,
    # the built-in launches against the table before them; the split kernel's configs at 4-32
    # requests with long contexts
    attn24c) run attn24c 300 python3 -m pytest -q -m gpu tests/test_triton_kernels.py -p no:cacheprovider ;;
    long24b) run long24b 300 bash -c 'for v in now before; do if [ $v = before ]; then \
              export ROLLOUT_DECODE_ATTN_CONFIGS="16:8,32,4,2,1;64:4,64,2,3;256:1,128,4,2,1"; \
              else unset ROLLOUT_DECODE_ATTN_CONFIGS; fi; python3 benchmarks/decode_throughput.py --shape qwen2-1.5b \
              --device cuda --dtype bfloat16 --batch-sizes 1 2 --prompt-len 3968 --new-tokens 128 --repeats 2 \
              --skip-hf --out $OUT/long24b_$v.json | grep -E "graph_replay_ms|\"tok_per_s\"|startup" | head -6; done' ;;
    attn24d) run attn24d 200 python3 benchmarks/gpu_attention.py --batches 4 8 16 32 --keys 2048 4096 \
              --configs 8,32,4,2,1 8,64,4,2,1 8,128,4,2,1 8,64,8,2,1 8,128,8,2,1 8,128,4,3,1 8,64,4,2,0 \
              --out "$OUT/attn24d.json" ;;
    # the long class's config per batch: the per-head kernel and the split kernel's 128-key
    # blocks at 1-64 requests, at 2-4k keys and at 300-1,000 (near the class edge, 257)
    attn24e) run attn24e 200 python3 benchmarks/gpu_attention.py --batches 1 2 4 64 --keys 2048 4096 \
              --configs 8,32,4,2,1 8,256,8,2,1,1 4,256,8,2,1,1 8,128,4,3,1 8,128,4,2,1 8,128,8,3,1 4,128,4,3,1 \
              8,64,4,2,0 --out "$OUT/attn24e.json"
             run attn24f 200 python3 benchmarks/gpu_attention.py --batches 1 2 4 8 16 32 --keys 300 1000 \
              --configs 8,32,4,2,1 8,256,8,2,1,1 4,256,8,2,1,1 8,128,4,3,1 8,64,4,2,0 4,64,2,3 \
              --out "$OUT/attn24f.json" ;;
    # the engine with a 3,968-token prompt at 1-16 requests (1-32 in its first run): the launch classes' table against
    # the table before them (one launch whatever the context)
    long24c) run long24c 400 bash -c 'for v in now before; do if [ $v = before ]; then \
              export ROLLOUT_DECODE_ATTN_CONFIGS="16:8,32,4,2,1;64:4,64,2,3;256:1,128,4,2,1"; \
              else unset ROLLOUT_DECODE_ATTN_CONFIGS; fi; python3 benchmarks/decode_throughput.py --shape qwen2-1.5b \
              --device cuda --dtype bfloat16 --batch-sizes 1 2 4 8 16 --prompt-len 3968 --new-tokens 128 \
              --repeats 2 --skip-hf --out $OUT/long24c_$v.json | grep -E "^\{\"batch|startup" | head -8; done' ;;
    # the extra graphs in the decode benchmark's shape; greedy parity at long contexts (float32
    # and bf16): batched (the batch-8 graph's long class) and each prompt alone (batch 1's)
    ab24b) ab_stage ab24b benchmarks/ab_twentyfourth_session_b.json 330 1 32 128 ;;
    parity24) run parity24 300 bash -c 'python3 benchmarks/gpu_parity.py --skip-tp --dtype float32 \
              --prompt-lens 300 5 517 260 1030 64 2000 129 --kv-cache-tokens 65536 --out $OUT/parity24_fp32.json \
              && python3 benchmarks/gpu_parity.py --skip-tp --prompt-lens 300 5 517 260 1030 64 2000 129 \
              --kv-cache-tokens 65536 --out $OUT/parity24.json' ;;
    # batch 1's long class: the per-head kernel against the split kernel's 128-key blocks (one
    # kernel fewer to compile at start-up), alone at 8-16k keys and in the engine at ~4k
    long24d) run attn24g 200 python3 benchmarks/gpu_attention.py --batches 1 2 --keys 8192 16384 \
              --configs 8,32,4,2,1 8,256,8,2,1,1 8,128,4,3,1 8,256,8,3,1 8,128,8,3,1 --out "$OUT/attn24g.json"
             run long24d 300 bash -c 'for v in now split; do if [ $v = split ]; then \
              export ROLLOUT_DECODE_ATTN_CONFIGS="16:8,32,4,2,1|8,128,4,3,1;32:4,64,2,3|8,64,4,2;64:4,64,2,3;256:1,128,4,2,1"; \
              else unset ROLLOUT_DECODE_ATTN_CONFIGS; fi; python3 benchmarks/decode_throughput.py --shape qwen2-1.5b \
              --device cuda --dtype bfloat16 --batch-sizes 1 --prompt-len 3968 --new-tokens 128 \
              --repeats 3 --skip-hf --out $OUT/long24d_$v.json | grep -E "^\{\"batch|startup" | head -3; done' ;;
    parity24b) run parity24b 200 python3 benchmarks/gpu_parity.py --skip-tp --dtype float32 \
              --prompt-lens 300 5 517 260 1030 64 2000 129 --kv-cache-tokens 65536 --out $OUT/parity24b_fp32.json ;;
    attn23) run attn23 300 python3 -m pytest -q -m gpu tests/test_triton_kernels.py -p no:cacheprovider ;;
    attn23b) run attn23b 240 python3 benchmarks/gpu_attention.py --batches 1 8 32 128 --configs 8,32,4,2,1 \
              1,256,16,2,1,1 1,256,8,2,1,1 1,128,8,2,1,1 1,256,32,2,1,1 --out "$OUT/attn23b.json" ;;
    ab23a) ab_stage ab23a benchmarks/ab_twentythird_session.json 330 1 ;;
    # the per-head kernel with its long-context splits (merged by the last to arrive): alone at
    # batch 1 (short and long contexts) and 8, and the engine A/B at batch 1 against split + merge
    attn23d) run attn23d 200 bash -c 'python3 benchmarks/gpu_attention.py --batches 1 8 --configs 8,32,4,2,1 \
              8,256,8,2,1,1 --out $OUT/attn23d_short.json && python3 benchmarks/gpu_attention.py --batches 1 \
              --keys 2048 4096 --configs 8,32,4,2,1 8,256,8,2,1,1 8,128,8,2,1,1 --out $OUT/attn23d_long.json \
              && python3 benchmarks/gpu_attention.py --batches 1 --keys 300 1000 --configs 8,32,4,2,1 \
              --out $OUT/attn23d_mid.json' ;;
    ab23b) ab_stage ab23b benchmarks/ab_twentythird_session_b.json 240 1 ;;
    # the per-head kernel's splits at batch 1: long contexts alone, then the engine A/B
    attn23e) run attn23e 100 python3 benchmarks/gpu_attention.py --batches 1 --keys 2048 4096 --configs \
              4,256,8,2,1,1 2,256,8,2,1,1 --out "$OUT/attn23e.json" ;;
    ab23c) ab_stage ab23c benchmarks/ab_twentythird_session_c.json 420 1 ;;
    # the decode benchmark at batch 1 beside HF (as `decode` runs it), per-head kernel and the
    # split + merge kernels alternated, two processes each
    decode23) run decode23 420 bash -c 'for r in 0 1; do for v in head split; do if [ $v = split ]; then \
              export ROLLOUT_DECODE_ATTN_CONFIGS="16:8,32,4,2,1;64:4,64,2,3;256:1,128,4,2,1"; \
              else unset ROLLOUT_DECODE_ATTN_CONFIGS; fi; python3 benchmarks/decode_throughput.py --shape qwen2-1.5b \
              --device cuda --dtype bfloat16 --batch-sizes 1 --prompt-len 128 --new-tokens 128 --repeats 2 \
              --out $OUT/decode23_${v}_$r.json | grep -E "graph_replay_ms|\"tok_per_s\"" | head -3; done; done' ;;
    # the same A/B as ab23b with the decode benchmark's three batches in each process
    ab23d) ab_stage ab23d benchmarks/ab_twentythird_session_b.json 300 1 32 128 ;;
    # with it the batch-1 default: greedy parity (each prompt alone too: the batch-1 graph), bf16
    # and float32; batch 1 at long contexts against the split + merge
    parity23) run parity23 300 bash -c 'python3 benchmarks/gpu_parity.py --skip-tp --out $OUT/parity23.json \
              && python3 benchmarks/gpu_parity.py --skip-tp --dtype float32 --out $OUT/parity23_fp32.json' ;;
    attn23c) run attn23c 150 python3 benchmarks/gpu_attention.py --batches 1 --keys 2048 4096 \
              --configs 8,32,4,2,1 1,128,8,2,1,1 --out "$OUT/attn23c.json" ;;
    # twenty-second session: the one-row MLP's gate/up -> down hand-off (rollout/layers/
    # mlp_handoff.py, commits d49ca97..dae5377, reverted: they need that tree): its spec and the
    # kernels it changed, compiled; batch-1 samples with it off and on (the same bits); the A/Bs
    handoff22) run handoff22 300 python3 -m pytest -q tests/test_mlp_handoff.py tests/test_triton_gemv.py \
              tests/test_triton_qkv_rope.py -p no:cacheprovider ;;
    parity22) run parity22 240 bash -c 'ROLLOUT_MLP_HANDOFF=0 python3 benchmarks/sample_dump.py --batch 1 \
              --out $OUT/samples22_off.json && python3 benchmarks/sample_dump.py --batch 1 --out $OUT/samples22_on.json \
              && python3 benchmarks/sample_dump.py --compare $OUT/samples22_off.json $OUT/samples22_on.json' ;;
    ab22a) ab_stage ab22a benchmarks/ab_twentysecond_session.json 420 1 ;;
    # its spin on relaxed loads (ab22a lost 19%) and its knobs (sleep, trigger, signal)
    handoff22b) run handoff22b 200 python3 -m pytest -q tests/test_mlp_handoff.py -p no:cacheprovider ;;
    ab22b) ab_stage ab22b benchmarks/ab_twentysecond_session_b.json 560 1 ;;
    ab22c) ab_stage ab22c benchmarks/ab_twentysecond_session_c.json 400 1 ;;
    # the hand-off's second form: its spec and the kernels it touches (the norm zeroes the
    # counters), compiled; batch-1 samples off and on; the engine A/B
    handoff22d) run handoff22d 300 python3 -m pytest -q tests/test_mlp_handoff.py tests/test_split_sum.py \
              tests/test_fused_ops.py -p no:cacheprovider ;;
    ab22d) ab_stage ab22d benchmarks/ab_twentysecond_session_d.json 400 1 ;;
    ab22e) ab_stage ab22e benchmarks/ab_twentysecond_session_e.json 270 1 ;;
    # twenty-first session: weights kept in the L2 across decode steps (commit 8929065, reverted:
    # its l2_residency module read ROLLOUT_L2_RESIDENT_MB / _KINDS / ROLLOUT_L2_STREAM)
    ab21a) ab_stage ab21a benchmarks/ab_twentyfirst_session.json 560 1 128 ;;
    # the one-row GEMVs' loop as Triton's software pipeline (Config.pipeline): the GEMV spec file
    # compiled (CPU cases and GPU ones); the engine A/Bs at batch 1 (down, gate/up, the LM head)
    gemv21) run gemv21 200 python3 -m pytest -q tests/test_triton_gemv.py -p no:cacheprovider ;;
    ab21b) ab_stage ab21b benchmarks/ab_twentyfirst_session_b.json 560 1 ;;
    ab21c) ab_stage ab21c benchmarks/ab_twentyfirst_session_c.json 300 1 ;;
    ab21d) ab_stage ab21d benchmarks/ab_twentyfirst_session_d.json 330 1 ;;
    ab20a) run ab20a 420 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twentieth_session.json \
              --rounds ${ROUNDS:-2} --batch-sizes 128 --repeats 2 --timeout-s 120 --out "$OUT/ab20a.json" ;;
    # twentieth session: the sampler alone, the session's start (base20.tar: `git archive 697f9a0`,
    # carried untracked) and now; its GPU specs; the engine A/B; the samples of both trees
    sampler20) mkdir -p /tmp/base20 && tar -xf base20.tar -C /tmp/base20
              run sampler20_base 150 env PYTHONPATH=/tmp/base20:${PYTHONPATH} python3 benchmarks/gpu_sampler.py \
              --rows 1 128 --out "$OUT/sampler20_base.json"
              run sampler20_now 150 python3 benchmarks/gpu_sampler.py --rows 1 128 --out "$OUT/sampler20_now.json" ;;
    smoke20) run smoke20 300 python3 -m pytest -q tests/test_triton_sampler.py tests/test_triton_kernels.py -p no:cacheprovider \
              && run smoke20_gpu 300 python3 -m pytest -q -m gpu tests/test_triton_sampler.py tests/test_sampler.py \
              tests/test_overlap_schedule.py -p no:cacheprovider ;;
    ab20b) mkdir -p /tmp/base20 && tar -xf base20.tar -C /tmp/base20
           run ab20b 420 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twentieth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1 128} --repeats 2 --timeout-s 100 --out "$OUT/ab20b.json" ;;
    parity20) mkdir -p /tmp/base20 && tar -xf base20.tar -C /tmp/base20
              run parity20 220 bash -c 'PYTHONPATH=/tmp/base20:$PYTHONPATH python3 benchmarks/sample_dump.py --out $OUT/samples_before.json \
              && python3 benchmarks/sample_dump.py --out $OUT/samples_now.json \
              && python3 benchmarks/sample_dump.py --compare $OUT/samples_before.json $OUT/samples_now.json' ;;
    # the sampler at T = 1 (the engine's shortcut) over more launch shapes
    sampler20b) run sampler20b 200 python3 benchmarks/gpu_sampler.py --rows 1 128 --unit-temperature \
              --launches 4,4,8 2,4,8 4,2,8 8,4,8 2,2,8 4,4,4 4,4,16 1,8,8 1,4,8 1,16,8 --out "$OUT/sampler20b.json" ;;
    # the sampler with random temperatures (the division), the session's start and now
    sampler20c) mkdir -p /tmp/base20 && tar -xf base20.tar -C /tmp/base20
              run sampler20c_base 150 env PYTHONPATH=/tmp/base20:${PYTHONPATH} python3 benchmarks/gpu_sampler.py \
              --rows 1 128 --launches 1,8,8 4,4,8 --out "$OUT/sampler20c_base.json"
              run sampler20c_now 150 python3 benchmarks/gpu_sampler.py --rows 1 128 --launches 1,8,8 4,4,8 \
              --out "$OUT/sampler20c_now.json" ;;
    # the kernel and sampler spec files compiled (their CPU specs too) and the engine A/B again
    # with the packed extend kernel (ab20c: base = the session's start, as ab20b)
    smoke20b) run smoke20b 400 python3 -m pytest -q tests/test_triton_kernels.py tests/test_triton_sampler.py \
              tests/test_graph_inputs.py -p no:cacheprovider ;;
    ab20c) mkdir -p /tmp/base20 && tar -xf base20.tar -C /tmp/base20
           run ab20c 420 python3 benchmarks/engine_ab.py --variants benchmarks/ab_twentieth_session_b.json \
              --rounds ${ROUNDS:-2} --batch-sizes ${AB_BATCHES:-1 128} --repeats 2 --timeout-s 100 --out "$OUT/ab20c.json" ;;
    # twenty-ninth session: prefill CUDA graphs of many requests. Their GPU specs; then the
    # continuous-batching rollout (staggered_rollout.py) and the GRPO-shaped calls with the
    # one-request graphs only ("one") and with the new ones ("all"), processes alternated
    prefill29) run prefill29_kernels 300 python3 -m pytest -q -m gpu tests/test_triton_kernels.py \
              -k "prefill or graph" -p no:cacheprovider
              run prefill29_specs 240 python3 -m pytest -q -m gpu tests/test_prompt_sharing.py \
              tests/test_compile_ahead.py -p no:cacheprovider ;;
    stag29) for r in ${ROUNDS_LIST:-a b}; do for v in one all; do flag=; [ $v = one ] && flag="--prefill-graph-requests 1"
              run stag29_${v}_$r 150 python3 benchmarks/staggered_rollout.py $flag --out "$OUT/stag29_${v}_$r.json"
              done; done ;;
    # regression after the change (test_memory_release needs Ray: not here): the GPU specs, the kernel specs compiled, whole-engine parity
    # (float32 and bf16), the sync audit; then a GRPO-shaped continuous-batching rollout
    regress29) run regress29_gpu 300 python3 -m pytest -q -m gpu tests/test_batch_builder.py \
              tests/test_compile_ahead.py tests/test_overlap_schedule.py \
              tests/test_prompt_sharing.py tests/test_triton_kernels.py tests/test_triton_sampler.py \
              tests/test_fused_ops.py tests/test_triton_gemv.py -p no:cacheprovider
              run regress29_kernels 240 python3 -m pytest -q tests/test_triton_kernels.py -p no:cacheprovider
              run parity29_fp32 200 python3 benchmarks/gpu_parity.py --skip-tp --dtype float32 \
              --out "$OUT/parity29_fp32.json"
              run parity29_bf16 200 python3 benchmarks/gpu_parity.py --skip-tp --out "$OUT/parity29_bf16.json"
              run sync29 150 python3 benchmarks/sync_audit.py --batch-sizes 1 8 128 --out "$OUT/sync29.json" ;;
    stagshare29) for v in one all; do flag=; [ $v = one ] && flag="--prefill-graph-requests 1"
              run stagshare29_$v 150 python3 benchmarks/staggered_rollout.py --samples-per-prompt 8 $flag \
              --out "$OUT/stagshare29_$v.json"; done ;;
    # mixed admission steps (EngineConfig.mixed_steps) off and on, the prefill graphs on; their
    # specs (CPU ones and the GPU one)
    mixed29) run mixed29_specs 200 python3 -m pytest -q tests/test_mixed_steps.py -p no:cacheprovider
              for r in ${ROUNDS_LIST:-a b}; do for v in off on; do flag=; [ $v = off ] && flag=--no-mixed-steps
              run mixed29_${v}_$r 150 python3 benchmarks/staggered_rollout.py $flag --out "$OUT/mixed29_${v}_$r.json"
              done; done ;;
    mixedshare29) for v in off on; do flag=; [ $v = off ] && flag=--no-mixed-steps
              run mixedshare29_$v 150 python3 benchmarks/staggered_rollout.py --samples-per-prompt 8 $flag \
              --out "$OUT/mixedshare29_$v.json"; done ;;
    # where a continuous-batching rollout's time goes, step by step (rollout_timeline.py): the
    # staggered rollout, its GRPO-grouped form and a decode-heavy one (responses 256-1,024)
    tl30) run tl30_stag 240 python3 benchmarks/rollout_timeline.py --out "$OUT/tl30_stag.json"
              run tl30_grpo 240 python3 benchmarks/rollout_timeline.py --samples-per-prompt 8 --out "$OUT/tl30_grpo.json"
              run tl30_long 300 python3 benchmarks/rollout_timeline.py --new-min 256 --new-max 1024 \
              --out "$OUT/tl30_long.json" ;;
    # small decode batches (2-16 rows): the engine before, the GEMV sweep at 2-16 rows (FMA
    # preloads and dot tiles, small_batch_candidates), the engine with the sweep's table
    small30) dec="python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda --dtype bfloat16 \
              --batch-sizes 1 2 4 8 16 --prompt-len 128 --new-tokens 128 --repeats 2 --skip-hf"
              run small30_before 150 $dec --out "$OUT/small30_before.json"
              run small30_sweep 300 python3 benchmarks/gpu_gemv.py --small-batches --rows 2 4 8 16 --batch-rows \
              --budget-s 220 --out "$OUT/small30_sweep.json" --configs-out "$OUT/small30_configs.json"
              ROLLOUT_SKINNY_CONFIGS=$OUT/small30_configs.json run small30_after 150 $dec --out "$OUT/small30_after.json" ;;
    # the same with the dot kernel's weight preload (dot_preload) in the sweep, without the LM
    # head (cuBLAS reads it at the copy bandwidth); the engine without, with the whole table, and
    # with its 2-4 row entries only
    small30b) dec="python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda --dtype bfloat16 \
              --batch-sizes 1 2 4 8 16 --prompt-len 128 --new-tokens 128 --repeats 2 --skip-hf"
              run small30b_sweep 300 python3 benchmarks/gpu_gemv.py --small-batches --rows 2 4 8 16 --batch-rows \
              --shapes qkv o gate_up down --budget-s 230 --out "$OUT/small30b_sweep.json" \
              --configs-out "$OUT/small30b_configs.json"
              python3 -c "import json,sys; e=json.load(open(sys.argv[1])); json.dump([x for x in e if x['M']<=4],open(sys.argv[2],'w'))" \
              "$OUT/small30b_configs.json" "$OUT/small30b_configs_upto4.json"
              run small30b_before 120 $dec --out "$OUT/small30b_before.json"
              ROLLOUT_SKINNY_CONFIGS=$OUT/small30b_configs.json run small30b_all 120 $dec --out "$OUT/small30b_all.json"
              ROLLOUT_SKINNY_CONFIGS=$OUT/small30b_configs_upto4.json run small30b_upto4 120 $dec --out "$OUT/small30b_upto4.json"
              rm -f $OUT/*.log ;;
    # the baked small-batch table against cuBLAS at 2-16 rows and two alternatives (engine_ab,
    # benchmarks/ab_thirtieth_session.json), after the GEMV specs (GPU, and the CPU specs of the
    # dot kernel's preload compiled)
    ab30) run ab30_specs 200 python3 -m pytest -q tests/test_triton_gemv.py tests/test_triton_qkv_rope.py \
              tests/test_split_sum.py -m gpu -p no:cacheprovider
              run ab30_specs_cpu 120 python3 -m pytest -q tests/test_triton_gemv.py -k "dot_preload" -p no:cacheprovider
              ab_stage ab30 benchmarks/ab_thirtieth_session.json 380 1 2 4 8 16
              rm -f $OUT/*.log ;;
    # the final small-batch table: the GEMV specs, the engine against cuBLAS at 2-16 rows
    # (ab_thirtieth_session_b.json: "now" is the code), and continuous batching with at most 4
    # requests running (a rollout's tail, an evaluation or agent loop with few requests at once)
    final30) run final30_specs 150 python3 -m pytest -q tests/test_triton_gemv.py tests/test_triton_qkv_rope.py \
              tests/test_split_sum.py -m gpu -p no:cacheprovider
              python3 -c "import json; v=json.load(open('benchmarks/ab_thirtieth_session_b.json')); v['now']={}; \
              json.dump(v, open('/tmp/ab30b.json','w')); json.dump(v['cublas']['configs'], open('/tmp/cublas30.json','w'))"
              ROUNDS=1 ab_stage ab30b /tmp/ab30b.json 150 1 2 4 8 16
              for v in now cublas; do env=; [ $v = cublas ] && env=ROLLOUT_SKINNY_CONFIGS=/tmp/cublas30.json
              run final30_few_$v 120 env $env python3 benchmarks/staggered_rollout.py --requests 32 --max-running 4 \
              --out "$OUT/final30_few_$v.json"
              [ -n "${SIXTEEN:-}" ] && run final30_sixteen_$v 120 env $env python3 benchmarks/staggered_rollout.py \
              --requests 128 --max-running 16 --out "$OUT/final30_sixteen_$v.json"; done
              rm -f $OUT/*.log ;;
    # batch 8: the sweep's kernels one at a time in the engine (ab_thirtieth_session_c.json)
    ab30c) ROUNDS=${ROUNDS:-1} ab_stage ab30c benchmarks/ab_thirtieth_session_c.json 300 8 16
              rm -f $OUT/*.log ;;
    startup29) run startup29 200 python3 benchmarks/startup_time.py --workers 16 --rounds 1 \
              --timeout-s 150 --out "$OUT/startup29.json" ;;
    grpo29) for v in one all; do flag=; [ $v = one ] && flag="--prefill-graph-requests 1"
              run grpo29_$v 200 python3 benchmarks/call_breakdown.py --batch-sizes 32 128 \
              --samples-per-prompt 8 --repeats 3 $flag --out "$OUT/grpo29_$v.json"; done ;;
    # what a decode step costs outside its graph, and what capturing more of it would take off
    probe31) run probe31 300 python3 benchmarks/step_graph_probe.py --out "$OUT/probe31.json"
              rm -f $OUT/*.log ;;
    qkvrope31) run qkvrope31 200 python3 -m pytest -q -m gpu tests/test_triton_qkv_rope.py -p no:cacheprovider
              rm -f $OUT/*.log ;;
    # the per-head decode attention at batch 1 in the decode benchmark's process (three rounds)
    ab31a) ROUNDS=${ROUNDS:-3} ab_stage ab31a benchmarks/ab_thirtyfirst_session.json 540 1 32 128
              rm -f $OUT/*.log ;;
    # batch 1's fixed cost: the one-request prefill's kernels and idle gaps, and the call's timeline
    pk31) run pk31_prefill 200 python3 benchmarks/prefill_kernel_profile.py --batch 1 --calls 10 \
              --out "$OUT/pk31_prefill_b1.json"
          run pk31_timeline 200 python3 benchmarks/step_timeline.py --batch-sizes 1 --out "$OUT/pk31_timeline_b1.json"
          rm -f $OUT/*.log ;;
    # the batch-128 decode attention's stages, warps and key blocks (two rounds, batch 128)
    ab31b) ab_stage ab31b benchmarks/ab_thirtyfirst_session_b.json 560 128
              rm -f $OUT/*.log ;;
    # the decode attention's L2 prefetch of the context before its PDL wait: GPU spec, then the
    # engine at batches 32 and 128 (ab_thirtysecond_session_e)
    pf32spec) run pf32spec 200 python3 -m pytest -q tests/test_triton_kernels.py \
              -k "prefetch or after_the_kernel" -p no:cacheprovider
              rm -f $OUT/*.log ;;
    ab32e) ROUNDS=${ROUNDS:-1} ab_stage ab32e benchmarks/ab_thirtysecond_session_e.json 420 32 128
              rm -f $OUT/*.log ;;
    ab32f) ab_stage ab32f benchmarks/ab_thirtysecond_session_f.json 240 32 64
              rm -f $OUT/*.log ;;
    # batch 1's pre-attention add + RMSNorm folded into the qkv + rotary kernel: GPU spec, the
    # engine's batch-1 samples with it off and on, then the engine A/B (ab_thirtyfifth_session)
    ab35spec) run ab35spec 240 python3 -m pytest -q -m gpu tests/test_triton_norm_qkv_rope.py \
              tests/test_triton_qkv_rope.py -p no:cacheprovider
              rm -f $OUT/*.log ;;
    ab35samples) run ab35samples 300 bash -c 'python3 benchmarks/sample_dump.py --batch 1 --new-tokens 128 --out $OUT/s35_off.json \
              && ROLLOUT_FUSED_NORM_QKV=1,4 python3 benchmarks/sample_dump.py --batch 1 --new-tokens 128 --out $OUT/s35_1_4.json \
              && ROLLOUT_FUSED_NORM_QKV=4,8 python3 benchmarks/sample_dump.py --batch 1 --new-tokens 128 --out $OUT/s35_4_8.json \
              && python3 benchmarks/sample_dump.py --compare $OUT/s35_off.json $OUT/s35_1_4.json \
              && python3 benchmarks/sample_dump.py --compare $OUT/s35_off.json $OUT/s35_4_8.json'
              rm -f $OUT/*.log ;;
    ab35a) ab_stage ab35a benchmarks/ab_thirtyfifth_session.json 560 1
              rm -f $OUT/*.log ;;
    ab35b) ab_stage ab35b benchmarks/ab_thirtyfifth_session_b.json 300 1
              rm -f $OUT/*.log ;;
    # where batch 1's decode step goes now: every op ablated once (the fifteenth session's file)
    abl35) ROUNDS=1 ab_stage abl35 benchmarks/ab_fifteenth_session_ablation.json 260 1
              rm -f $OUT/*.log ;;
    ab35c) run ab35cspec 200 python3 -m pytest -q -m gpu tests/test_triton_norm_qkv_rope.py -p no:cacheprovider
              ab_stage ab35c benchmarks/ab_thirtyfifth_session_c.json 380 1
              rm -f $OUT/*.log ;;
    # thirty-sixth session: the prefix cache's GPU specs (with stop strings and prompt sharing),
    # then multi-turn rollouts with the cache on and off, with and without an RL step's weight
    # update every two turns
    pc36) run pc36spec 300 python3 -m pytest -q -m gpu tests/test_prefix_cache.py \
              tests/test_stop_strings.py tests/test_prompt_sharing.py -p no:cacheprovider
          run pc36bench 300 python3 benchmarks/multi_turn_rollout.py --shape qwen2-1.5b --device cuda \
              --conversations 64 --turns 6 --out "$OUT/multi_turn36_h200.json"
          run pc36upd 240 python3 benchmarks/multi_turn_rollout.py --shape qwen2-1.5b --device cuda \
              --conversations 64 --turns 6 --weight-update-every 2 --out "$OUT/multi_turn36_upd_h200.json" ;;
    # an agent loop's rollout: concurrent agenerate tasks vs lockstep calls vs one call at a time
    # (bf16 at the benchmark shape; float32 on a small shape, where the modes' samples must agree)
    agent36) run agent36 300 python3 benchmarks/agent_loop.py --shape qwen2-1.5b --device cuda \
              --conversations 64 --turns 4 --prompt-len 256 --new-tokens 128 --reply-len 64 \
              --serial-conversations 4 --out "$OUT/agent_loop36_h200.json"
             run agent36f32 200 python3 benchmarks/agent_loop.py --shape cpu-small --device cuda \
              --dtype float32 --conversations 32 --turns 3 --prompt-len 64 --new-tokens 32 \
              --reply-len 16 --serial-conversations 32 --out "$OUT/agent_loop36_fp32_h200.json" ;;
    # thirty-seventh session: Qwen3-MoE — its specs on the GPU (fp32 graphs vs HF, bf16 decode
    # without host syncs), then Qwen3-30B-A3B's shape at 24 of its 48 layers, engine vs HF
    moe37) run moe37spec 300 python3 -m pytest -q tests/test_moe.py -p no:cacheprovider
           run moe37bench 540 python3 benchmarks/moe_decode.py --layers 24 --batch-sizes 1 32 128 \
              --out "$OUT/moe37_h200.json" ;;
    # the MoE decode graphs' kernels (no HF), and the in-process update from device tensors
    moe37b) run moe37bspec 200 python3 -m pytest -q -m gpu tests/test_moe.py -p no:cacheprovider
            run moe37prof 400 python3 benchmarks/moe_decode.py --layers 24 --batch-sizes 1 8 32 128 \
              --repeats 1 --skip-hf-generate --profile --out "$OUT/moe37_profile_h200.json" ;;
    # the decode MoE kernels (triton_moe): specs, then the engine with them up to 32 tokens in two
    # configs against the grouped GEMMs everywhere (12 of the 48 layers, no HF)
    moe37c) run moe37cspec 300 python3 -m pytest -q tests/test_triton_moe.py tests/test_moe.py -p no:cacheprovider
            for v in "0 16,256,8,256,4" "32 16,256,8,256,4" "32 8,512,4,256,4" "32 32,128,16,128,8"; do
              read -r n cfg <<< "$v"
              run "moe37c_${n}_${cfg//,/-}" 200 env ROLLOUT_MOE_DECODE_TOKENS=$n ROLLOUT_MOE_DECODE_CONFIG=$cfg \
                python3 benchmarks/moe_decode.py --layers 12 --batch-sizes 1 4 8 16 32 --repeats 2 \
                --skip-hf-generate --out "$OUT/moe37c_${n}_${cfg//,/-}.json"
            done ;;
    # the decode MoE kernels' configs, up to 16 tokens
    moe37d) run moe37dspec 200 python3 -m pytest -q -m gpu tests/test_triton_moe.py tests/test_moe.py -p no:cacheprovider
            for cfg in 8,512,4,256,4 4,512,4,256,4 8,1024,4,256,4 8,512,2,256,4 8,512,4,256,2; do
              run "moe37d_${cfg//,/-}" 200 env ROLLOUT_MOE_DECODE_TOKENS=16 ROLLOUT_MOE_DECODE_CONFIG=$cfg \
                python3 benchmarks/moe_decode.py --layers 12 --batch-sizes 1 4 8 16 --repeats 2 \
                --skip-hf-generate --out "$OUT/moe37d_${cfg//,/-}.json"
            done ;;
    # the final MoE figures: specs, then Qwen3-30B-A3B's shape at 24 layers, engine vs HF
    moe37e) run moe37espec 200 python3 -m pytest -q -m gpu tests/test_triton_moe.py tests/test_moe.py -p no:cacheprovider
            run moe37e 400 python3 benchmarks/moe_decode.py --layers 24 --batch-sizes 1 16 128 \
              --out "$OUT/moe37e_h200.json" ;;
    # the sorted-blocks MoE kernels past 16 tokens against the grouped GEMMs (12 layers, no HF)
    moe37f) run moe37fspec 150 python3 -m pytest -q -m gpu tests/test_triton_moe.py -p no:cacheprovider
            for v in "0 16,64,64,64,64,4,3" "256 16,64,64,64,64,4,3" "256 16,128,64,128,64,4,3" "256 16,64,128,64,128,8,3"; do
              read -r n cfg <<< "$v"
              run "moe37f_${n}_${cfg//,/-}" 120 env ROLLOUT_MOE_BLOCK_TOKENS=$n ROLLOUT_MOE_BLOCK_CONFIG=$cfg \
                python3 benchmarks/moe_decode.py --layers 12 --batch-sizes 32 64 128 --repeats 2 \
                --skip-hf-generate --out "$OUT/moe37f_${n}_${cfg//,/-}.json"
            done ;;
    # moe37f again after the routing kernel's NaN fix (the padded graph rows' ids), two variants
    moe37g) run moe37gspec 100 python3 -m pytest -q -m gpu tests/test_triton_moe.py -p no:cacheprovider
            for n in 256 0; do
              run "moe37g_$n" 80 env ROLLOUT_MOE_BLOCK_TOKENS=$n python3 benchmarks/moe_decode.py \
                --layers 12 --batch-sizes 32 128 --repeats 2 --skip-hf-generate --out "$OUT/moe37g_$n.json"
            done ;;
    # Qwen3: the q/k norms in the rotary kernel (specs, then the engine A/B on qwen3-1.7b), the
    # routing record on the GPU path
    q38spec) run q38spec 300 python3 -m pytest -q -m gpu tests/test_fused_ops.py tests/test_split_sum.py \
              tests/test_moe.py tests/test_triton_moe.py -p no:cacheprovider
             run q38model 200 python3 -m pytest -q tests/test_triton_kernels.py -p no:cacheprovider \
              -k "model_with_triton_backend_matches_hf or cuda_graph_greedy_matches_eager or cuda_graph_after_weight_reload" ;;
    q38ab) run q38ab 560 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirtyeighth_session.json \
              --shape qwen3-1.7b --rounds ${ROUNDS:-2} --batch-sizes 1 32 128 --repeats 2 --timeout-s 200 \
              --out "$OUT/q38ab.json" ;;
    q38b) run q38b 300 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirtyeighth_session_b.json \
              --shape qwen3-1.7b --rounds ${ROUNDS:-2} --batch-sizes 1 32 128 --repeats 2 --timeout-s 120 \
              --out "$OUT/q38b.json" ;;
    moe38spec) run moe38spec 180 python3 -m pytest -v -m gpu tests/test_moe.py tests/test_triton_moe.py -p no:cacheprovider
               grep -E "PASSED|FAILED|ERROR|Error|error:|Fatal|assert" "$OUT/moe38spec.log" | head -40 ;;
    moe38spec2) run moe38spec2 120 python3 -m pytest -v -m gpu tests/test_moe.py -p no:cacheprovider \
                  -k "routing_record or sorted_blocks"
                grep -E "PASSED|FAILED|ERROR|Error|error:|Fatal|assert" "$OUT/moe38spec2.log" | head -20
                run moe38spec3 120 python3 -m pytest -v -m gpu tests/test_moe.py tests/test_triton_moe.py -p no:cacheprovider
                grep -E "PASSED|FAILED|ERROR|Error|error:|Fatal|assert" "$OUT/moe38spec3.log" | head -20 ;;
    moe38hf) run moe38hf 330 python3 benchmarks/moe_decode.py --layers 24 --batch-sizes 1 16 128 \
              --out "$OUT/moe38_h200.json" ;;
    q38hf) run q38hf 400 python3 benchmarks/decode_throughput.py --shape qwen3-1.7b --device cuda \
              --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 \
              --out "$OUT/decode_qwen3_h200.json" ;;
    # MoE past 16 tokens: sorted blocks (configs) against the grouped GEMMs; routing record cost
    moe38) for v in "0 16,64,64,64,64,4,3" "256 16,64,64,64,64,4,3" "256 16,128,64,128,64,4,3" "256 16,64,128,64,128,4,4"; do
              read -r n cfg <<< "$v"
              run "moe38_${n}_${cfg//,/-}" 150 env ROLLOUT_MOE_BLOCK_TOKENS=$n ROLLOUT_MOE_BLOCK_CONFIG=$cfg \
                python3 benchmarks/moe_decode.py --layers 12 --batch-sizes 32 64 128 --repeats 2 \
                --skip-hf-generate --out "$OUT/moe38_${n}_${cfg//,/-}.json"
            done ;;
    moe38r) for r in off on; do flag=; [ $r = on ] && flag=--record-routed-experts
              run "moe38r_$r" 150 python3 benchmarks/moe_decode.py --layers 12 --batch-sizes 1 128 \
                --repeats 2 --skip-hf-generate $flag --out "$OUT/moe38r_$r.json"
            done ;;
    # Qwen3-1.7B at decode batches: where the graph's time goes (PDL off), the decode attention's
    # launch configs at its 16 / 8 heads, the TMA GEMM's tiles at its shapes
    q39prof) run q39prof 200 env ROLLOUT_PDL=0 python3 benchmarks/graph_kernel_profile.py --shape qwen3-1.7b \
              --batch-sizes 1 32 128 --out "$OUT/q39prof.json" ;;
    q39attn) run q39attn 130 python3 benchmarks/gpu_attention.py --heads 16 8 --batches 32 128 \
              --budget-s 90 --out "$OUT/q39attn.json" ;;
    q39gemm) run q39gemm 230 python3 benchmarks/gpu_gemm_tma.py --model qwen3-1.7b --rows 128 64 \
              --case-budget-s 18 --out "$OUT/q39gemm.json" --configs-out "$OUT/q39gemm_configs.json" ;;
    q39attn128) run q39attn128 170 python3 benchmarks/gpu_attention.py --heads 16 8 --batches 128 \
              --splits 1 2 --budget-s 120 --out "$OUT/q39attn128.json" ;;
    q39ab) run q39ab 400 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirtyninth_session.json \
              --shape qwen3-1.7b --rounds ${ROUNDS:-2} --batch-sizes 32 128 --repeats 2 --timeout-s 120 \
              --out "$OUT/q39ab.json" ;;
    q39spec) run q39spec 150 python3 -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_triton_gemv.py \
              -p no:cacheprovider -k "kv_heads or after_the_kernel_that_writes or decode_batch_entries or decode_batches" ;;
    q39ab2) run q39ab2 390 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirtyninth_session_b.json \
              --shape qwen3-1.7b --rounds ${ROUNDS:-2} --batch-sizes 32 64 128 --repeats 2 --timeout-s 120 \
              --out "$OUT/q39ab2.json" ;;
    q39hf) run q39hf 300 python3 benchmarks/decode_throughput.py --shape qwen3-1.7b --device cuda \
              --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 \
              --out "$OUT/decode_qwen3_h200.json" ;;
    q39q2) run q39q2 170 python3 benchmarks/engine_ab.py --variants benchmarks/ab_thirtyninth_session_c.json \
              --shape qwen2-1.5b --rounds ${ROUNDS:-2} --batch-sizes 256 --repeats 2 --timeout-s 80 \
              --out "$OUT/q39q2.json" ;;
    q39gemv1) run q39gemv1 170 python3 benchmarks/gpu_gemv.py --model qwen3-1.7b --rows 1 --batch-rows \
              --budget-s 110 --out "$OUT/q39gemv1.json" ;;
    q40spec) run q40spec 170 python3 -m pytest -q -m gpu tests/test_triton_norm_qkv_rope.py \
              tests/test_triton_kernels.py -p no:cacheprovider -k "qwen3 or shapes or kv_heads or fold" ;;
    q40ab) ab_shape q40ab benchmarks/ab_fortieth_session.json 400 qwen3-1.7b ${ROUNDS:-2} 1 ;;
    q40q2) ab_shape q40q2 benchmarks/ab_fortieth_session_b.json 200 qwen2-1.5b ${ROUNDS:-2} 1 ;;
    q40ab2) ab_shape q40ab2 benchmarks/ab_fortieth_session_c.json 300 qwen3-1.7b ${ROUNDS:-2} 1 ;;
    q40ab3) ab_shape q40ab3 benchmarks/ab_fortieth_session_d.json 170 qwen3-1.7b ${ROUNDS:-3} 1 ;;
    q40spec2) run q40spec2 150 python3 -m pytest -q -m gpu tests/test_triton_gemv.py \
              tests/test_triton_norm_qkv_rope.py -p no:cacheprovider -k "one_row_entries or qwen3 or fold" ;;
    # the Qwen3 decode table, the fold set as q40ab3 (run before it) measured it faster
    q40hf) fold=$(python3 -c "import json; s = json.load(open('$OUT/q40ab3.json'))['summary']; \
print('2,4' if s['fold']['1']['graph_replay_ms'] < s['no_fold']['1']['graph_replay_ms'] else '0')" \
              2>/dev/null || echo 2,4); echo "ROLLOUT_FUSED_NORM_QKV=$fold"
           ROLLOUT_FUSED_NORM_QKV=$fold run q40hf 300 python3 benchmarks/decode_throughput.py \
              --shape qwen3-1.7b --device cuda --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 \
              --new-tokens 128 --repeats 2 --out "$OUT/decode_qwen3_h200.json" ;;
    # Qwen3-30B-A3B at one row: the qkv fold (on by default) against the norm's own kernel,
    # 12 of its layers, engine alone; and the MoE GPU specs (tiny Qwen3-MoE against HF)
    q40moe) run q40moespec 120 python3 -m pytest -q -m gpu tests/test_moe.py -p no:cacheprovider
            for fold in on:2,4 off:0; do
              ROLLOUT_FUSED_NORM_QKV=${fold#*:} run "q40moe_${fold%%:*}" 130 python3 benchmarks/moe_decode.py \
                --layers 12 --batch-sizes 1 --skip-hf-generate --out "$OUT/q40moe_${fold%%:*}.json"
            done ;;
    q40ab4) ab_shape q40ab4 benchmarks/ab_fortieth_session_e.json 300 qwen3-1.7b ${ROUNDS:-2} 1 ;;
    # forty-first session: the one-row rule for shapes the table does not list
    q41spec) run q41spec 150 python3 -m pytest -q -m gpu tests/test_triton_gemv.py -k "unlisted or rule" \
              -p no:cacheprovider ;;
    q41spec2) run q41spec2 120 python3 -m pytest -q -s -m gpu tests/test_triton_gemv.py -k "rule_equal" \
              -p no:cacheprovider ;;
    q41_8b_more) make_model q41_8b_make qwen3-8b 120
              run q41hf8 300 python3 benchmarks/decode_throughput.py --shape qwen3-8b --device cuda --dtype bfloat16 \
                --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 --out "$OUT/q41hf8.json"
              ab_shape q41ab8 benchmarks/ab_fortyfirst_session_b.json 160 qwen3-8b 1 1
              drop_model qwen3-8b ;;
    # the same table at batch 128 alone, the engine at half the free memory (HF beside it)
    q41hf8b) make_model q41_8b_make qwen3-8b 120
              run q41hf8b 300 python3 benchmarks/decode_throughput.py --shape qwen3-8b --device cuda --dtype bfloat16 \
                --batch-sizes 128 --prompt-len 128 --new-tokens 128 --repeats 2 --mem-fraction 0.5 --out "$OUT/q41hf8b.json"
              drop_model qwen3-8b ;;
    # engine vs HF at 1, 32 and 128 rows for the 4B and 7B shapes, HF beside the engine
    q41hf47) for m in qwen3-4b:90:180 qwen2.5-7b:100:210; do IFS=: read -r shape mk secs <<< "$m"
                make_model "q41_${shape}_make" "$shape" "$mk"
                run "q41hf_$shape" "$secs" python3 benchmarks/decode_throughput.py --shape "$shape" --device cuda \
                  --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 \
                  --mem-fraction 0.5 --out "$OUT/q41hf_$shape.json"
                drop_model "$shape"; done ;;
    q41tma4b) ab_cached q41tma4b benchmarks/ab_fortyfirst_session_c.json 200 qwen3-4b ${ROUNDS:-2} 32 128 ;;
    q41small8b) ab_cached q41small8b benchmarks/ab_fortyfirst_session_d.json 200 qwen3-8b 1 2 4 ;;
    q41_4b) ab_cached q41_4b benchmarks/ab_fortyfirst_session.json 150 qwen3-4b ${ROUNDS:-2} 1 ;;
    q41_8b) ab_cached q41_8b benchmarks/ab_fortyfirst_session.json 200 qwen3-8b ${ROUNDS:-2} 1 ;;
    q41_7b) ab_cached q41_7b benchmarks/ab_fortyfirst_session.json 200 qwen2.5-7b ${ROUNDS:-2} 1 ;;
    # forty-second session: does the batch-128 TMA GEMM loop overlap its loads and its MMAs?
    q42c) run q42overlap 240 python3 benchmarks/gpu_gemm_overlap_probe.py --out "$OUT/q42overlap.json" ;;
    # forty-second session: Triton's warp specialization of that loop with device-made descriptors
    q42d) run q42ws 420 python3 benchmarks/gpu_ws_probe.py --out "$OUT/q42ws.json" ;;
    # forty-second session: the batch-128 gate/up + SiLU warp-specialized by hand in Gluon
    q42e) run q42gluon 400 python3 benchmarks/gluon_gate_up_probe.py --out "$OUT/q42gluon.json" ;;
    # the stream-K Gluon gate/up (first run), and the GPU spec of the one-row norm + qkv fold
    q43a) run q43gluon 300 python3 benchmarks/gluon_gate_up_probe.py --out "$OUT/q43gluon.json"
          run q43fold 200 python3 -m pytest -q -m gpu tests/test_triton_norm_qkv_rope.py -p no:cacheprovider ;;
    # the unswapped Gluon gate/up: x's rows on wgmma's M side, 64 + 8 weight rows a program (125 tiles)
    q43b) run q43xonm 300 python3 benchmarks/gluon_gate_up_probe.py --out "$OUT/q43xonm.json" ;;
    # the engine's Gluon gate/up: the engine A/B at batch 128, then its GPU specs
    q43c) make_model q43make qwen2-1.5b 90
          ab_stage q43ab benchmarks/ab_fortythird_session.json 330 128
          run q43spec 150 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py tests/test_triton_pdl.py \
              tests/test_triton_gemv.py -k "gluon or gate_up or 128 or prefetch" -p no:cacheprovider ;;
    # the final code's Gluon specs, then a second decode-table run
    q43e) run q43spec3 150 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py tests/test_triton_pdl.py \
              tests/test_triton_gemv.py -k "gluon or gate_up or 128 or prefetch" -p no:cacheprovider
          run decode2 420 python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda \
              --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 \
              --out "$OUT/decode2.json" ;;
    # the Gluon gate/up entry against the TMA one again, three rounds
    q43f) make_model q43make qwen2-1.5b 90
          ROUNDS=3 ab_stage q43ab3 benchmarks/ab_fortythird_session_c.json 330 128 ;;
    # the Gluon GEMM as down split along K: its specs (and gate/up's after the refactor), alone,
    # in the engine
    q43g) run q43gspec 80 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py -p no:cacheprovider
          run q43gdown 50 python3 benchmarks/gpu_gluon_gate_up.py --proj down --rows 128 --out "$OUT/q43gdown.json"
          make_model q43make qwen2-1.5b 40
          ROUNDS=1 ab_stage q43ab4 benchmarks/ab_fortythird_session_d.json 110 128 ;;
    # the Gluon GEMM as down, o and qkv at 128 rows: its GPU specs, each projection's sweep (its
    # best config where it beats the table alone), those winners in the engine (one round)
    q45a) run q45spec 120 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py -p no:cacheprovider
          for p in down o qkv; do
            run "q45$p" 70 python3 benchmarks/gpu_gluon_gate_up.py --proj "$p" --rows 128 \
                --min-gain 1.0 --out "$OUT/q45$p.json" --configs-out "$OUT/q45${p}_configs.json"
          done
          make_model q45make qwen2-1.5b 60
          ROUNDS=${ROUNDS:-1} ab_stage q45ab benchmarks/ab_fortyfifth_session.json 200 128 ;;
    # qkv on the Gluon GEMM (q45a's winner) and a wider qkv / o sweep's, three rounds
    q45b) for p in qkv o; do
            run "q45b$p" 170 python3 benchmarks/gpu_gluon_gate_up.py --proj "$p" --wide --rows 128 \
                --min-gain 1.0 --out "$OUT/q45b$p.json" --configs-out "$OUT/q45b${p}_configs.json"
            tail -n 1 "$OUT/q45b$p.log"
          done
          make_model q45make qwen2-1.5b 60
          ROUNDS=${ROUNDS:-3} ab_stage q45ab2 benchmarks/ab_fortyfifth_session_b.json 240 128 ;;
    # qkv at 65-128 rows on the Gluon GEMM in the table: the GPU specs its path runs through, the
    # decode table, the A/B against the entry it replaced
    # a wider qkv sweep, its best in the engine where it beats the table's entry alone
    q45c) run q45cspec 130 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py tests/test_split_sum.py \
              tests/test_triton_qkv_rope.py tests/test_triton_pdl.py tests/test_triton_gemv.py \
              -k "gluon or 128 or split or qkv" -p no:cacheprovider
          run decode 280 python3 benchmarks/decode_throughput.py --shape qwen2-1.5b --device cuda \
              --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 --repeats 2 \
              --out "$OUT/decode.json"
          make_model q45make qwen2-1.5b 40
          ROUNDS=${ROUNDS:-2} ab_stage q45ab3 benchmarks/ab_fortyfifth_session_c.json 120 128 ;;
    q45w) run q45wqkv 150 python3 benchmarks/gpu_gluon_gate_up.py --proj qkv --wide --rows 128 \
              --min-gain 1.0 --out "$OUT/q45wqkv.json" --configs-out "$OUT/q45wqkv_configs.json"
          tail -n 1 "$OUT/q45wqkv.log"
          if [ "$(cat "$OUT/q45wqkv_configs.json" 2>/dev/null)" != "[]" ]; then
            make_model q45make qwen2-1.5b 40
            ROUNDS=${ROUNDS:-2} ab_stage q45ab4 benchmarks/ab_fortyfifth_session_d.json 120 128; fi ;;
    # the batch-128 decode graph kernel by kernel on the final table (PDL off, so the split adds up)
    q45k) run q45kernels 240 env ROLLOUT_PDL=0 python3 benchmarks/graph_kernel_profile.py --batch-sizes 128 \
              --out "$OUT/q45kernels.json" ;;
    # the Gluon gate/up swept at 16-128 rows, then its winners at 32 and 64 rows in the engine
    q43d) run q43sweep 240 python3 benchmarks/gpu_gluon_gate_up.py --out "$OUT/q43sweep.json" \
              --configs-out "$OUT/q43sweep_configs.json"
          if [ -s "$OUT/q43sweep_configs.json" ]; then make_model q43make qwen2-1.5b 90
            ab_stage q43ab2 benchmarks/ab_fortythird_session_b.json 240 32 64; fi ;;
    # forty-seventh session: a prefill chunk's gate/up with the SiLU in the Gluon GEMM's epilogue
    # (it ran as gpu_prefill_gate_up.py, folded since into gpu_gluon_gate_up.py --prefill)
    q47a) run q47prefill 200 python3 benchmarks/gpu_gluon_gate_up.py --prefill --rows 4096 8192 \
              --out "$OUT/q47prefill.json" ;;
    # where batch 128's decode step goes now: the fifteenth session's ablation at 128 rows
    q47abl) make_model q47make qwen2-1.5b 90
            ROUNDS=${ROUNDS:-1} ab_stage q47abl benchmarks/ab_fifteenth_session_ablation.json 480 128 ;;
    # down and o at 128 rows on the Gluon GEMM split along K, in the engine
    q47f) make_model q47make qwen2-1.5b 90
          ab_stage q47f benchmarks/ab_fortyseventh_session.json 420 128 ;;
    # down's new entry against the old, o and a deeper preload on top; its GPU specs; the table
    q47g) make_model q47make qwen2-1.5b 90
          ab_stage q47g benchmarks/ab_fortyseventh_session_b.json 240 128
          run q47spec 200 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py tests/test_split_sum.py \
            -p no:cacheprovider ;;
    # with o's 128-row entry on the Gluon GEMM too: the specs that run the 128-row path
    q47h) run q47hspec 200 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py tests/test_split_sum.py \
            tests/test_triton_pdl.py -p no:cacheprovider ;;
    # down, o, qkv (and gate/up) at 17-64 rows on the Gluon GEMM: its spec at fewer rows than
    # the x tile, then the engine A/B at batches 32 and 64
    q48a) run q48aspec 150 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py -p no:cacheprovider
          make_model q48make qwen2-1.5b 90
          ab_stage q48a benchmarks/ab_fortyeighth_session.json 420 32 64 ;;
    # q48a's winners at 17-64 rows confirmed, down left out at 17-32, qkv split in 4
    q48b) make_model q48make qwen2-1.5b 90
          ab_stage q48b benchmarks/ab_fortyeighth_session_b.json 480 32 64 ;;
    # with qkv and o at 17-64 rows and down at 33-64 on the Gluon GEMM: the specs that run
    # those paths (kernels, deferred sums, the fused-qkv fallbacks, the TMA entries they
    # replaced, decode logits under PDL)
    q48c) run q48cspec 280 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py tests/test_split_sum.py \
            tests/test_triton_qkv_rope.py tests/test_triton_gemv.py tests/test_triton_pdl.py \
            -p no:cacheprovider ;;
    # the fused qkv spec at 64 rows on the fallback entry; qkv and o at 128 rows in 64-row x tiles
    q48d) run q48dspec 150 python3 -m pytest -q -m gpu tests/test_triton_qkv_rope.py -p no:cacheprovider
          make_model q48make qwen2-1.5b 90
          ab_stage q48d benchmarks/ab_fortyeighth_session_c.json 330 128 ;;
    # down at 17-32 rows on the Gluon GEMM in other tiles and splits
    q48e) make_model q48make qwen2-1.5b 90
          ab_stage q48e benchmarks/ab_fortyeighth_session_d.json 300 32 ;;
    # down's 32-row entry now Gluon 128 x 7: its specs; the same tiles at 64 and 128 rows
    # forty-ninth session: gate and up rows in one wgmma (the gated Gluon GEMM): its GPU specs,
    # the gate/up sweep with this tree and with 3471a17's (base49.tar: git archive 3471a17
    # rollout benchmarks pyproject.toml, carried untracked), the engine A/B of the two trees
    q49a) mkdir -p /tmp/base49 && tar -xf base49.tar -C /tmp/base49
          run q49spec 120 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py -p no:cacheprovider
          run q49sweep 150 python3 benchmarks/gpu_gluon_gate_up.py --rows 32 64 128 \
              --out "$OUT/q49sweep.json" --configs-out "$OUT/q49sweep_configs.json"
          run q49prefill 90 python3 benchmarks/gpu_gluon_gate_up.py --prefill --rows 4096 8192 \
              --out "$OUT/q49prefill.json"
          make_model q49make qwen2-1.5b 90
          ab_stage q49a benchmarks/ab_fortyninth_session.json 300 32 64 128
          (cd /tmp/base49 && PYTHONPATH=/tmp/base49 run q49sweep_base 100 python3 \
              benchmarks/gpu_gluon_gate_up.py --rows 128 --out "$OUT/q49sweep_base.json") ;;
    # fiftieth session: the LM head on the Gluon GEMM at 17-128 rows (tiles filling whole waves)
    # and the 128-row gate/up's preloaded stages, in the engine; then the LM head alone
    # decode step graphs (rollout/step_graphs.py): their specs, then off / up to 16 / up to 128
    # fifty-second session: batch 1 in an engine sized for 1 or 128 requests and beside batches
    # 32 and 128 (the decode table's process, HF aside), engine alone, alternated
    q52a) make_model q52make qwen2-1.5b 90
          ab_stage q52a benchmarks/ab_fiftysecond_session.json 330 1 ;;
    # step graphs at batch 1 only, and the per-head attention at batch 1, in the decode
    # benchmark's process shape (batches 1, 32, 128), engine alone
    q52b) make_model q52make qwen2-1.5b 90
          ab_shape q52b benchmarks/ab_fiftysecond_session_b.json 560 qwen2-1.5b 2 1 32 128 ;;
    # the decode table's own run (beside HF), the default and q52b's "both" (step graphs at batch
    # 1 only, the per-head attention at batch 1), alternated, two rounds
    q52c) make_model q52make qwen2-1.5b 90
          PER_HEAD_1='1:1,256,8,2,1,1|8,128,4,3,1;16:8,32,4,2,1|8,128,4,3,1;32:4,64,2,3,0,0,1;64:4,64,2,3;128:1,128,4,2,1;256:1,64,2,4'
          for r in 1 2; do
            for v in default both; do
              if [ $v = both ]; then envs="ROLLOUT_STEP_GRAPH_MAX_BS=1 ROLLOUT_DECODE_ATTN_CONFIGS=$PER_HEAD_1"; else envs=""; fi
              run q52c_${v}_$r 150 env $envs python3 benchmarks/decode_throughput.py --shape qwen2-1.5b \
                --device cuda --dtype bfloat16 --batch-sizes 1 32 128 --prompt-len 128 --new-tokens 128 \
                --repeats 2 --out "$OUT/q52c_${v}_$r.json"
            done
          done ;;
    # the per-head attention at batch 1 and step graphs at batch 1 only (the new defaults): the
    # whole engine with PDL and without, the step graphs, the attention kernels and graphs
    q52spec) run q52spec 150 python3 -m pytest -q -m gpu tests/test_triton_pdl.py tests/test_step_graphs.py -p no:cacheprovider
             run q52spec_kernels 110 python3 -m pytest -q -m gpu tests/test_triton_kernels.py -p no:cacheprovider ;;
    q51spec) run q51spec 200 python3 -m pytest -q -m gpu tests/test_step_graphs.py tests/test_graph_inputs.py \
            tests/test_triton_sampler.py tests/test_generate.py tests/test_overlap_schedule.py -p no:cacheprovider ;;
    q51a) make_model q51make qwen2-1.5b 90
          ab_stage q51a benchmarks/ab_fiftyfirst_session.json 300 1 32 128 ;;
    # the step graphs' forward forked behind the input kernel: the specs (bf16 many times), then
    # off / up to 16 at batch 1, three rounds
    q51b) run q51bspec 200 bash -c 'python3 -m pytest -q -m gpu tests/test_step_graphs.py -p no:cacheprovider \
            && python3 -m pytest -q tests/test_triton_sampler.py tests/test_graph_inputs.py -p no:cacheprovider'
          make_model q51make qwen2-1.5b 90
          ROUNDS=3 ab_stage q51b benchmarks/ab_fiftyfirst_session_b.json 240 1 ;;
    # the whole engine with PDL and without (bit for bit), then step graphs and the first norm's trigger
    q51c) run q51cspec 170 python3 -m pytest -q -m gpu tests/test_triton_pdl.py tests/test_step_graphs.py -p no:cacheprovider
          make_model q51make qwen2-1.5b 90
          ab_stage q51c benchmarks/ab_fiftyfirst_session_c.json 150 1 ;;
    q50a) make_model q50make qwen2-1.5b 90
          ab_stage q50a benchmarks/ab_fiftieth_session.json 420 32 64 128
          run q50lm 100 python3 benchmarks/gpu_gluon_gate_up.py --proj lm_head --rows 32 64 128 \
              --out "$OUT/q50lm.json" ;;
    # q50a's winner (gate/up preload 4) against 5, with the LM head at 17-32 rows on Gluon,
    # and with qkv's and o's 128-row entries preloading all six stages
    q50b) make_model q50make qwen2-1.5b 90
          ab_stage q50b benchmarks/ab_fiftieth_session_b.json 480 32 128 ;;
    # on top of gate/up preload 4: down's, qkv's and o's preloaded stages at 128 rows
    q50c) make_model q50make qwen2-1.5b 90
          ab_stage q50c benchmarks/ab_fiftieth_session_c.json 300 128 ;;
    # the table, gate/up preload 4, and with down preload 4 too: three rounds
    q50d) make_model q50make qwen2-1.5b 90
          ROUNDS=3 ab_stage q50d benchmarks/ab_fiftieth_session_d.json 300 128 ;;
    # the table with gate/up's and down's 128-row entries preloading four stages: their specs
    q50spec) run q50spec 280 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py tests/test_split_sum.py \
            tests/test_triton_pdl.py -p no:cacheprovider ;;
    # the new table against qkv / o preloading 4 stages and down 5
    q50e) make_model q50make qwen2-1.5b 90
          ab_stage q50e benchmarks/ab_fiftieth_session_e.json 300 128 ;;
    # o preloading 4 stages, and with qkv 4: three rounds
    q50f) make_model q50make qwen2-1.5b 90
          ROUNDS=3 ab_stage q50f benchmarks/ab_fiftieth_session_f.json 300 128 ;;
    # the step probe with the sampler captured into the graph without PDL (batch 1 and 128)
    q50g) run q50g 240 python3 benchmarks/step_graph_probe.py --batch-sizes 1 128 --rounds 3 \
              --out "$OUT/q50g.json" ;;
    # the batch-128 attention's stages and warps again; the 17-64-row Gluon entries preloading 4
    q50h) make_model q50make qwen2-1.5b 90
          ab_stage q50h benchmarks/ab_fiftieth_session_h.json 300 32 64 128 ;;
    # gate/up at 33-64 rows on the Gluon GEMM too: the specs that run the gated kernel's paths
    q49b) run q49bspec 200 python3 -m pytest -q -m gpu tests/test_gluon_gemm.py tests/test_triton_gemv.py \
            tests/test_triton_pdl.py -p no:cacheprovider ;;
    # and the model-level specs through the 33-128-row paths (deferred sums, fused qkv fallbacks)
    q49d) run q49dspec 240 python3 -m pytest -q -m gpu tests/test_split_sum.py tests/test_triton_qkv_rope.py \
            tests/test_fused_ops.py -p no:cacheprovider ;;
    # batch 128's prefill steps on CUDA graphs (8,192 and 8,448 tokens), or in steps of 4,096
    q49e) make_model q49make qwen2-1.5b 90
          ROUNDS=${ROUNDS:-3} ab_stage q49e benchmarks/ab_fortyninth_session_c.json 300 128 ;;
    # gate/up at 17-32 rows on the Gluon GEMM in the engine; then the batch-128 layer's kernels
    # under Nsight Compute (the Gluon GEMMs' DRAM, L2 and tensor-pipe counters)
    q49c) make_model q49make qwen2-1.5b 90
          ab_stage q49c benchmarks/ab_fortyninth_session_b.json 220 32
          NCU_ROWS=128 bash "$0" ncu-kernels ;;
    q48f) run q48fspec 130 python3 -m pytest -q -m gpu tests/test_split_sum.py tests/test_gluon_gemm.py \
            -k "down or model_logits or table_entry or fewer_rows" -p no:cacheprovider
          make_model q48make qwen2-1.5b 90
          ab_stage q48f benchmarks/ab_fortyeighth_session_e.json 260 64 128 ;;
    *) if [ -f "benchmarks/gpu_$stage.py" ]; then
         run "$stage" 540 python3 "benchmarks/gpu_$stage.py" --out "$OUT/$stage.json"
       else echo "unknown stage $stage"; fi ;;
  esac
done
