"""ENGINE_NUMERICS_VERSION: bumped by any engine change that could alter an output for the same inputs.

The result cache (workers/result_cache.py, through workers/model_identity.py) keys every body with it: a
kernel, sampler, model-layer or tokenization change that moves a single logit must bump it, so results
computed before are never served as if this engine had computed them. Pure Python: the store and the
workers read it without torch.
"""

# 2: the AVX-512 decode attention path (issue 34) sums q.k and the values in another order than AVX2 did.
# 3: the AVX2 decode attention scales scores after the dot (as AVX-512 does) and reads int8 / u8 codes with
#    its own loops; bf16 on an AVX2-only CPU runs oneDNN's fp32 GEMM over widened weights, not bf16 F.linear.
# 4: on an AVX2-only CPU float32 / bfloat16 linears run the panel GEMM (csrc/panel_gemm.cpp), which sums in
#    k order, not oneDNN's order.
# 5: kv_cache_dtype "auto" is u8 for a bfloat16 model on CPU (EngineConfig.resolved_kv_cache_dtype), stored
#    by the native store_kv_quantized_.
# 6: float32 linears run the panel GEMM on AVX-512 CPUs too (14 x 32 tiles); int8 weights take float32
#    activations and a u8 KV cache by default on CPU, through oneDNN's int8 GEMM on AMX CPUs.
# 7: a float32 model's plain greedy rows take the argmax of the candidates a bf16 GEMM of the head screens,
#    their logits summed by greedy_head.cpp's dot product, not the head's GEMM (CPUs with a native bf16 GEMM);
#    float32 linears run the panel GEMM on AVX-512 CPUs without AMX too.
ENGINE_NUMERICS_VERSION = 7
