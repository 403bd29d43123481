"""Sampling parameters, logit filtering, and the speculative acceptance rules.

Greedy: accept the longest prefix of drafts that equal the target argmax; the bonus token is the
target argmax at the first mismatch (or after the last draft).
Sampling: standard speculative rejection sampling (lossless): accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from normalize(max(0, p_j - q_j)); if every
draft is accepted draw the bonus from p. A deterministic drafter has one-hot q.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 = off. top_p 1 = off. seed for reproducible sampling."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0 and self.temperature == self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingArrays(NamedTuple):
    """Device-side sampling knobs (traced, so changing them does not recompile)."""
    temperature: jax.Array  # f32 scalar (> 0 when sampling)
    top_p: jax.Array        # f32 scalar
    top_k: jax.Array        # int32 scalar, 0 = off

    @staticmethod
    def from_params(p: SamplingParams) -> "SamplingArrays":
        return SamplingArrays(jnp.float32(max(p.temperature, 1e-6)), jnp.float32(p.top_p), jnp.int32(p.top_k))


def filter_logits(logits, top_k=None, top_p=None):
    """Top-k then top-p (nucleus) filtering over the last axis; removed entries -> -inf.

    top_k: int (static or traced), 0/None = off. top_p: float (static or traced), >= 1 = off.
    Ties at a threshold are kept.
    """
    neg = jnp.asarray(-jnp.inf, logits.dtype)
    srt = jnp.sort(logits, axis=-1)[..., ::-1]                            # descending
    v = logits.shape[-1]
    if top_k is not None:
        k = jnp.asarray(top_k, jnp.int32)
        kth = jnp.take_along_axis(srt, jnp.clip(k - 1, 0, v - 1)[..., None] * jnp.ones(srt.shape[:-1] + (1,), jnp.int32), -1)
        kth = jnp.where(k > 0, kth, -jnp.inf)
        logits = jnp.where(logits < kth, neg, logits)
        srt = jnp.where(srt < kth, neg, srt)
    if top_p is not None:
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs                        # mass strictly above
        keep = (before < jnp.asarray(top_p, probs.dtype)).at[..., 0].set(True)
        thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < thresh, neg, logits)
    return logits


def target_probs(logits, s: SamplingArrays):
    """Sampling distribution p of the target: softmax(filter(logits / T)). logits [..., V]."""
    z = filter_logits(logits / s.temperature.astype(logits.dtype), s.top_k, s.top_p)
    return jax.nn.softmax(z, axis=-1)


def sample_token(key, logits, s: SamplingArrays):
    z = filter_logits(logits / s.temperature.astype(logits.dtype), s.top_k, s.top_p)
    return jax.random.categorical(key, z, axis=-1).astype(jnp.int32)


def accept_greedy(target_logits, drafts, n):
    """target_logits [W, V] for slots [anchor, d_1..d_{W-1}]; drafts [W-1]; n = drafts verified (<= W-1).

    Returns (accepted a in 0..n, bonus token): a = longest prefix with d_j == argmax(slot j-1).
    """
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)            # [W]
    match = (best[:-1] == drafts) & (jnp.arange(drafts.shape[0]) < n)
    a = jnp.sum(jnp.cumprod(match.astype(jnp.int32)))
    return a.astype(jnp.int32), best[a]


def accept_sample(key, target_logits, drafts, draft_probs, n, s: SamplingArrays):
    """Lossless speculative rejection sampling.

    target_logits [W, V]; drafts [W-1]; draft_probs [W-1, V] (q_j; one-hot for deterministic
    drafters) or None (= one-hot of drafts); n drafts verified. Returns (a, bonus).
    """
    w, vocab = target_logits.shape
    p = target_probs(target_logits, s)                                     # [W, V]
    q = jax.nn.one_hot(drafts, vocab, dtype=p.dtype) if draft_probs is None else draft_probs.astype(p.dtype)
    k_acc, k_res = jax.random.split(key)
    pd = jnp.take_along_axis(p[:-1], drafts[:, None], axis=-1)[:, 0]
    qd = jnp.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
    u = jax.random.uniform(k_acc, (w - 1,), p.dtype)
    ok = (u * qd < pd) & (jnp.arange(w - 1) < n)                           # u < p/q without dividing
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)
    # residual at the first rejection, or plain p after the last verified draft
    rejected = a < n
    q_pad = jnp.concatenate([q, jnp.zeros((1, vocab), q.dtype)], axis=0)
    resid = jnp.maximum(p[a] - jnp.where(rejected, q_pad[a], 0.0), 0.0)
    resid = jnp.where(resid.sum() > 0, resid, p[a])                        # p == q exactly: any p-sample
    bonus = jax.random.categorical(k_res, jnp.log(resid)).astype(jnp.int32)
    return a, bonus
