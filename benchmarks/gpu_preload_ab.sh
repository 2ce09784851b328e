#!/usr/bin/env bash
# Batch-1 decode with the one-row qkv and o GEMV launch configs of each variant (through
# ROLLOUT_SKINNY_CONFIGS: block_n, num_warps, K chunks loaded before the PDL wait), engine alone,
# one process per variant and round, variants alternated. Prints tok/s and the decode graph's
# replay ms; JSON under $OUT. Usage: bash benchmarks/gpu_preload_ab.sh [ROUNDS] [VARIANT...]
#   variant NAME=QKV_BLOCK_N,QKV_WARPS,O_BLOCK_N,O_WARPS,PRELOAD
set -uo pipefail
OUT=${OUT:-/tmp/out}
rounds=${1:-2}; shift || true
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(before=4,4,2,4,1 qkv_o_preload=4,4,2,4,3 now=2,4,2,2,3)
for r in $(seq "$rounds"); do
  for v in "${variants[@]}"; do
    name=${v%%=*}; IFS=, read -r qbn qnw obn onw pre <<< "${v#*=}"
    cfg=$OUT/gemv_$name.json
    python3 -c "import json; json.dump([
      {'M': 1, 'N': 2048, 'K': 1536, 'gated': False,
       'config': dict(block_n=$qbn, block_k=512, num_warps=$qnw, preload=$pre)},
      {'M': 1, 'N': 1536, 'K': 1536, 'gated': False,
       'config': dict(block_n=$obn, block_k=512, num_warps=$onw, preload=$pre)}], open('$cfg', 'w'))"
    ROLLOUT_SKINNY_CONFIGS=$cfg timeout 150 python3 benchmarks/decode_throughput.py --shape qwen2-1.5b \
      --device cuda --dtype bfloat16 --batch-sizes 1 --prompt-len 128 --new-tokens 128 --repeats 3 \
      --skip-hf --out "$OUT/preload_${name}_$r.json" > "$OUT/preload_${name}_$r.log" 2>&1
    python3 -c "import json; r = json.load(open('$OUT/preload_${name}_$r.json'))['rows'][0]; \
print('$name round $r:', round(r['engine']['tok_per_s'], 1), 'tok/s, replay', round(r['graph_replay_ms'], 4), 'ms')"
  done
done
