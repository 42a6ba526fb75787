"""From logits to tokens: the sampler, per-request logits controls, stop strings and structured output."""
