"""Triton attention kernels over the token-granular paged KV cache (req_to_token → slot).

`decode_attention` (split-KV, two stages, or a program per query head: decode_head.py) and
`extend_attention` (causal prefill of new tokens after a cached prefix). Both run compiled on a
GPU or, with TRITON_INTERPRET=1 set before triton is imported, interpreted on CPU tensors (fp32),
which is how CI tests them."""
from rollout.attention.triton_kernels.decode import decode_attention
from rollout.attention.triton_kernels.extend import extend_attention

__all__ = ["decode_attention", "extend_attention"]
