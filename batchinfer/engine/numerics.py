"""ENGINE_NUMERICS_VERSION: bumped by any engine change that could alter an output for the same inputs.

The result cache (workers/result_cache.py) keys every body with it: a kernel, sampler, model-layer or
tokenization change that moves a single logit must bump it, so results computed before are never served
as if this engine had computed them. Pure Python: the store and the workers read it without torch.
"""

ENGINE_NUMERICS_VERSION = 1
