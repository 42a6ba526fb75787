"""Verification of proposed tokens against the target's distributions, exactly.

A sequence proposing d_1..d_k gets the target's k + 1 distributions p_0..p_k (p_j: the next token after
the sequence plus d_1..d_j, processed exactly as the sampler would process it then). Three rules:

- greedy: accept d_{j+1} while it is argmax p_j; then emit argmax p_n. The output is the output without
  speculation, token for token.
- seeded (temperature > 0 with a seed): draw position j's token as the sampler would without
  speculation, y_j = argmax(p_j / E_j) with E_j ~ Exp(1)^vocab from the sequence's own generator, and
  accept d_{j+1} while y_j == d_{j+1}. The generator is advanced once per emitted token, as without
  speculation, so a seeded request's output is the same with or without speculation and whatever else
  is batched (the policy may switch speculation on and off between steps). For an n-gram proposal (q is
  one-hot) this is distributed exactly like standard rejection sampling; for a draft model it accepts
  less often (P(y = d) instead of sum min(p, q)), the price of that invariance.
- unseeded (temperature > 0): standard speculative rejection sampling (Leviathan et al., Chen et al.):
  accept d_{j+1} with probability min(1, p_j(d) / q_j(d)); at the first rejection emit a sample of
  norm(max(0, p_j - q_j)); if all k are accepted emit a sample of p_k. q is the draft model's
  distribution, or one-hot at d for an n-gram proposal. Each emitted token is then distributed as p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(target_tokens: Sequence[int], draft_token_ids: Sequence[int]) -> list[int]:
    """The emitted tokens given each position's target argmax: the agreeing drafts, then one target token."""
    emitted = []
    for target, draft in zip(target_tokens, draft_token_ids, strict=False):
        emitted.append(target)
        if target != draft:
            return emitted
    emitted.append(target_tokens[len(draft_token_ids)])
    return emitted


def accept_replay(target_probs: torch.Tensor, draft_token_ids: Sequence[int],
                  generator: torch.Generator) -> list[int]:
    """Seeded rows: each position sampled as without speculation (exponential race), until a draft differs."""
    emitted = []
    vocab = target_probs.shape[1]
    for j in range(len(draft_token_ids) + 1):
        noise = torch.empty(vocab, device=target_probs.device).exponential_(generator=generator)
        token = int((target_probs[j] / noise).argmax())
        emitted.append(token)
        if j == len(draft_token_ids) or token != draft_token_ids[j]:
            break
    return emitted


def sample_exponential_race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One exact sample of the (unnormalised, non-negative) distribution `probs` [vocab]."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> list[int]:
    """Standard rejection sampling of one sequence's proposal; returns the emitted tokens (1 .. k + 1).

    target_probs [k + 1, vocab]; draft_probs [k, vocab] (None: one-hot at each draft token).
    """
    k = len(draft_token_ids)
    device = target_probs.device
    num_accepted = 0
    if k:
        drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=device)
        positions = torch.arange(k, device=device)
        p_draft = target_probs[positions, drafts]
        q_draft = draft_probs[positions, drafts] if draft_probs is not None else torch.ones_like(p_draft)
        uniform = torch.rand(k, generator=generator, device=device)
        # u < p / q, written without dividing (q > 0: the draft was sampled from q).
        accepted = (uniform * q_draft < p_draft).tolist()
        num_accepted = accepted.index(False) if False in accepted else k
    emitted = list(draft_token_ids[:num_accepted])
    p = target_probs[num_accepted]
    if num_accepted < k:
        if draft_probs is None:
            residual = p.clone()
            residual[draft_token_ids[num_accepted]] = 0.0
        else:
            residual = (p - draft_probs[num_accepted]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q to rounding: a rejection is then (almost) impossible
            residual = p
        p = residual
    emitted.append(sample_exponential_race(p, generator))
    return emitted
