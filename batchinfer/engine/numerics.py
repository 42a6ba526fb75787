"""ENGINE_NUMERICS_VERSION: bumped by any engine change that could alter an output for the same inputs.

The result cache (workers/result_cache.py) keys every body with it: a kernel, sampler, model-layer or
tokenization change that moves a single logit must bump it, so results computed before are never served
as if this engine had computed them. Pure Python: the store and the workers read it without torch.
"""

# 2: the AVX-512 decode attention path (issue 34) sums q.k and the values in another order than AVX2 did.
ENGINE_NUMERICS_VERSION = 2
