"""The on-device decode loop: draft -> choose verify length -> verify -> accept -> commit -> stop.

Batch 1. One `jax.lax.while_loop` runs whole speculative steps with no host round trip: accept
counts, positions, stop flags and statistics live in `DecodeState` on the device. The host calls
`run(state, max_steps)` once per chunk of steps (streaming) or once for the whole request.

Drafters: 'dspark' (DSpark draft fed by target layer taps), 'mtp' (the target's own NEXTN layer,
chained), 'none' (plain decoding). Rollback of KDA/conv state uses replay: the verify pass leaves
the recurrent state at the block start and `ling.commit` re-runs the accepted prefix's state
update from the stored k/v/g/beta (docs/ARCHITECTURE.md, "speculative verify").
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax import sampling, sharding
from lingjax.cache import LingCache, init_cache
from lingjax.model import dense
from lingjax.model.kernels import kernel_mesh
from lingjax.model.ling import LingModel, commit

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_RUNNING: None, FINISH_STOP: "stop", FINISH_LENGTH: "length"}
POLICIES = ("fixed", "adaptive", "confidence")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """method: 'dspark' | 'mtp' | 'none'. block_size: drafts proposed per step (DSpark block or MTP
    steps). verify_policy: 'fixed' verifies all; 'adaptive' (Lucebox) and 'confidence' (DSpark
    expected-tokens-per-second rule) pick among `verify_widths` (numbers of drafts to verify)."""
    method: str = "dspark"
    block_size: int = 8
    verify_policy: str = "fixed"
    verify_widths: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.method not in ("dspark", "mtp", "none"):
            raise ValueError(f"unknown speculative method {self.method!r} (dspark, mtp, none)")
        if self.verify_policy not in POLICIES:
            raise ValueError(f"unknown verify policy {self.verify_policy!r} ({', '.join(POLICIES)})")
        if self.method != "none" and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def drafts(self) -> int:
        return 0 if self.method == "none" else self.block_size

    @property
    def widths(self) -> tuple[int, ...]:
        """Sorted numbers of drafts a step may verify (each is one compiled verify branch)."""
        if self.method == "none":
            return (0,)
        if self.verify_widths:
            w = tuple(sorted(set(self.verify_widths)))
            if w[0] < 1 or w[-1] > self.block_size:
                raise ValueError(f"verify widths {w} must lie in 1..block_size ({self.block_size})")
            return w
        if self.verify_policy == "fixed":
            return (self.block_size,)
        return tuple(sorted({1, 2, max(1, self.block_size // 2), self.block_size}))


class DraftOverride(NamedTuple):
    """Benchmark/test hook: replace the drafter's proposals by oracle tokens while every real
    draft/verify/commit op still runs. The drafts of a step anchored at position P are
    oracle[P+1 .. P+B]; with `pattern` (accepted count per step, cycled; -1 = no corruption)
    draft number pattern[i]+1 is made wrong so exactly pattern[i] are accepted (greedy). An
    oracle entry < 0 takes the drafter's own proposal there (force=True needs token ids
    everywhere: it commits oracle tokens). That choice, made per step on the traced oracle, is
    also what keeps the draft pass in the compiled step:
    before session 26 nothing read the drafter's tokens, and XLA removed the whole draft forward,
    its lm_head pass and Markov chain from every forced-acceptance benchmark."""
    oracle: jax.Array    # [L] int32, absolute positions (prompt followed by the target's greedy output)
    pattern: jax.Array   # [S] int32
    force: jax.Array | bool = False  # True: accept min(pattern, n) drafts and commit oracle tokens
    #   whatever the target says (benchmarks on random bf16 weights, where T=1 and T=9 passes can
    #   round differently and flip a near-tie argmax). False: acceptance is decided by the target.


class DecodeState(NamedTuple):
    cache: LingCache
    draft_cache: object            # DSparkCache or None
    mtp_hidden: jax.Array | None   # [1, 1, D] MTP output predicting the next first draft
    anchor: jax.Array              # int32: last committed token, not yet run through the target
    out: jax.Array                 # [max_new + B + 1] int32 generated tokens
    n_out: jax.Array               # int32 tokens generated so far
    limit: jax.Array               # int32 max new tokens
    finish: jax.Array              # int32 FINISH_*
    key: jax.Array                 # PRNG key
    steps: jax.Array               # int32 speculative steps run
    drafted: jax.Array             # int32 drafts verified (sum of n)
    accepted: jax.Array            # int32 drafts accepted
    accept_hist: jax.Array         # [B + 1] int32 histogram of accepted count per step
    pos_accepted: jax.Array        # [max(B,1)] int32 steps where draft j was accepted
    policy: jax.Array              # [2] int32 adaptive policy: (width index, clean streak)
    step_cost: jax.Array           # [len(widths)] f32 relative step time per verify width


@dataclasses.dataclass
class Decoder:
    """Builds the jitted prefill and loop for one (target, draft, spec config, stop set)."""
    target: LingModel
    spec: SpecConfig
    draft: object = None                       # DSparkDraft for method 'dspark'
    stop_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    greedy: bool = True
    tap_layers: tuple[int, ...] = ()
    # Prompts longer than this are prefilled in chunks of this many tokens (one scanned forward):
    # bounds the prefill's attention scores to [H, chunk, context] (8192 tokens at once would need
    # ~10 GB of scores per MLA layer, more than a full fp8 Ling-3.0-flash leaves on one H200).
    prefill_chunk: int = 2048

    def __post_init__(self):
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.spec.method == "dspark":
            if self.draft is None:
                raise ValueError("--spec dspark needs a DSpark draft model (--draft DIR)")
            dc = self.draft.cfg
            if self.spec.block_size > dc.block_size:
                raise ValueError(f"block size {self.spec.block_size} is larger than the draft was built for "
                                 f"({dc.block_size})")
            dc.check_fits_target(self.target.cfg.hidden_size, self.target.cfg.num_hidden_layers,
                                 self.target.cfg.vocab_size)
            self.tap_layers = tuple(dc.target_layer_ids)
            # the draft's projections follow the target's dense_kernel switch (the skinny GEMM
            # for its <= 16-row calls; a weight the kernel cannot take stays on XLA, as in the target)
            dense.set_dense_kernel(self.draft, getattr(self.target, "dense_kernel", "xla"), require_any=False)
        if self.spec.method == "mtp" and self.target.mtp is None:
            raise ValueError("--spec mtp needs the target's MTP layer (num_nextn_predict_layers >= 1 and its weights)")
        self.graph, self.params = nnx.split((self.target, self.draft))
        self._mesh = sharding.params_mesh(self.params)   # None unless the params are sharded
        stops = np.full((max(1, len(self.stop_sequences)), max([1] + [len(s) for s in self.stop_sequences])), -1, np.int32)
        for i, s in enumerate(self.stop_sequences):
            stops[i, stops.shape[1] - len(s):] = s
        self._stop_seqs = stops if self.stop_sequences else None
        self.prefill = jax.jit(self._on_mesh(self._prefill), static_argnames=("max_new",))
        # No buffer donation: the engine reads chunk k while chunk k+1 (fed from it) runs.
        self.run = jax.jit(self._on_mesh(self._run))

    def _on_mesh(self, fn):
        """`fn` traced with the params' mesh visible to Pallas KDA kernels (kda.kernel_mesh), which
        then run per device on its heads under shard_map. Plain `fn` on one device."""
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with kernel_mesh(self._mesh):
                return fn(*args, **kwargs)
        return traced

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill(self, params, prompt, max_new: int, limit, key, samp, step_cost, prompt_len=None):
        """prompt [1, T] -> DecodeState holding the first generated token as anchor.

        prompt_len (traced, optional): the prompt is padded to T (a compiled bucket) and only its
        first prompt_len tokens are real, so one compilation serves every length up to T."""
        target, draft = nnx.merge(self.graph, params)
        t = prompt.shape[1]
        n = jnp.int32(t) if prompt_len is None else jnp.asarray(prompt_len, jnp.int32)
        b = self.spec.drafts
        c, k = self._chunks(t)
        cache = self._pin(_init_cache(target, c * k + max_new + b + 2))  # chunks write whole (padded) blocks
        hidden, taps, cache = self._prefill_target(target, prompt, cache, None if prompt_len is None else n)
        key, k0 = jax.random.split(key)
        last_hidden = jax.lax.dynamic_slice_in_dim(hidden, n - 1, 1, axis=1)          # [1, 1, D]
        logits = target.logits(last_hidden)[0, 0]
        first = jnp.argmax(logits).astype(jnp.int32) if self.greedy else sampling.sample_token(k0, logits, samp)
        draft_cache, mtp_hidden = None, None
        if self.spec.method == "dspark":
            draft_cache = draft.append_context(self._pin(draft.init_cache(1, cache.max_len)), taps, 0, count=n)
        if self.spec.method == "mtp":
            shifted = jnp.concatenate([prompt[:, 1:], prompt[:, :1]], axis=1)
            nxt = jnp.where(jnp.arange(t) == n - 1, first, shifted)      # token t+1 for every position t
            h, cache = self._prefill_mtp(target, hidden, nxt, cache)
            mtp_hidden = jax.lax.dynamic_slice_in_dim(h, n - 1, 1, axis=1)
        nb = max(b, 1)
        state = DecodeState(
            cache=cache, draft_cache=draft_cache, mtp_hidden=mtp_hidden, anchor=first,
            out=jnp.zeros((max_new + b + 1,), jnp.int32), n_out=jnp.int32(0),
            limit=limit, finish=jnp.int32(FINISH_RUNNING), key=key, steps=jnp.int32(0),
            drafted=jnp.int32(0), accepted=jnp.int32(0), accept_hist=jnp.zeros((b + 1,), jnp.int32),
            pos_accepted=jnp.zeros((nb,), jnp.int32), policy=jnp.zeros((2,), jnp.int32), step_cost=step_cost)
        return self._pin(self._check_stop(state, first[None], jnp.int32(1), jnp.int32(0)))

    def _pin(self, tree):
        """With sharded params: fix the shardings of a DecodeState / cache to
        `sharding.state_shardings` (caches by head, everything else replicated), so prefill, every loop
        iteration and the loop's result keep one layout. Identity on one device."""
        return tree if self._mesh is None else sharding.constrain_state(tree, self._mesh, self.target.cfg)

    def _chunks(self, t: int) -> tuple[int, int]:
        """(chunk length, number of chunks) for a prompt of t tokens (one chunk when t <= prefill_chunk)."""
        c = min(t, self.prefill_chunk)
        return c, -(-t // c)

    def _prefill_target(self, target, prompt, cache, valid_len):
        """Target forward over the prompt [1, T] from an empty cache, in chunks (lax.scan) when long.
        Returns (final-normed hidden [1, T, D], taps [1, T, n_taps*D] or None, cache)."""
        t = prompt.shape[1]
        c, k = self._chunks(t)
        if k == 1:
            out = target(prompt, cache, logits="none", tap_layers=self.tap_layers, valid_len=valid_len)
            return out.hidden, out.taps, out.cache
        n = jnp.int32(t) if valid_len is None else valid_len
        chunks = jnp.pad(prompt, ((0, 0), (0, c * k - t))).reshape(k, 1, c)

        def body(cache, xs):
            i, toks = xs
            out = target(toks, cache, logits="none", tap_layers=self.tap_layers,
                         valid_len=jnp.clip(n - i * c, 0, c).astype(jnp.int32))
            return out.cache, (out.hidden, out.taps)
        cache, (hidden, taps) = jax.lax.scan(body, cache, (jnp.arange(k), chunks))
        unchunk = lambda a: None if a is None else jnp.moveaxis(a, 0, 1).reshape(1, k * c, -1)[:, :t]  # noqa: E731
        return unchunk(hidden), unchunk(taps), cache

    def _prefill_mtp(self, target, hidden, nxt, cache):
        """The MTP layer over the prompt (main hidden [1, T, D], next tokens [1, T]), chunked like the target."""
        t = hidden.shape[1]
        c, k = self._chunks(t)
        if k == 1:
            return target.mtp_forward(hidden, nxt, cache, pos=0)
        pad = c * k - t
        hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(1, k, c, -1).swapaxes(0, 1)
        ns = jnp.pad(nxt, ((0, 0), (0, pad))).reshape(k, 1, c)

        def body(cache, xs):
            i, h, tok = xs
            out, cache = target.mtp_forward(h, tok, cache, pos=(i * c).astype(jnp.int32))
            return cache, out
        cache, out = jax.lax.scan(body, cache, (jnp.arange(k), hs, ns))
        return jnp.moveaxis(out, 0, 1).reshape(1, k * c, -1)[:, :t], cache

    # ---- the loop -----------------------------------------------------------------------------
    def _run(self, params, state: DecodeState, samp, override, max_steps):
        """Run up to max_steps (traced int) speculative steps (fewer if the request finishes)."""
        def cond(c):
            s, i = c
            return (s.finish == FINISH_RUNNING) & (i < max_steps)

        def body(c):
            s, i = c
            return self._pin(self._step(params, s, samp, override)), i + 1

        state, _ = jax.lax.while_loop(cond, body, (self._pin(state), jnp.int32(0)))
        return state

    def _step(self, params, s: DecodeState, samp, override) -> DecodeState:
        target, draft = nnx.merge(self.graph, params)
        key, k_draft, k_acc = jax.random.split(s.key, 3)
        if self.spec.method == "none":
            out = target(s.anchor[None, None], s.cache, logits="last")
            logits = out.logits[0, -1]
            tok = jnp.argmax(logits).astype(jnp.int32) if self.greedy else sampling.sample_token(k_acc, logits, samp)
            s = s._replace(cache=out.cache, anchor=tok, key=key, steps=s.steps + 1,
                           accept_hist=s.accept_hist.at[0].add(1))
            return self._check_stop(s, jnp.zeros((1,), jnp.int32) + tok, jnp.int32(1), s.n_out)

        with jax.named_scope("draft"):
            drafts, q, conf = self._draft(target, draft, s, k_draft, samp)
        if override is not None:
            drafts = _apply_override(override, s.cache.pos, s.steps, drafts, target.cfg.vocab_size)
            q = None
        widx = self._choose_width(s, conf)
        branches = [lambda op, n=n: self._verify_commit(target, draft, op, n, samp) for n in self.spec.widths]
        operand = (s, drafts, q, k_acc, override)
        s, n, a, committed = jax.lax.switch(widx, branches, operand) if len(branches) > 1 else branches[0](operand)
        nb = self.spec.drafts
        s = s._replace(
            key=key, steps=s.steps + 1, drafted=s.drafted + n, accepted=s.accepted + a,
            accept_hist=s.accept_hist.at[a].add(1),
            pos_accepted=s.pos_accepted + (jnp.arange(nb) < a).astype(jnp.int32),
            policy=self._update_policy(s.policy, widx, n, a))
        return self._check_stop(s, committed, a + 1, s.n_out)

    def _draft(self, target, draft, s: DecodeState, key, samp):
        """Proposals d_1..d_B [B], their distributions q [B, V] (None = one-hot) and confidences."""
        b = self.spec.block_size
        p = s.cache.pos
        if self.spec.method == "dspark":
            cfg = draft.cfg
            ids = jnp.concatenate([s.anchor[None], jnp.full((b - 1,), cfg.mask_token_id, jnp.int32)])[None]
            hidden = draft.forward_block(s.draft_cache, target.embed_tokens(ids), p)
            # the base logits are the target's own lm_head product (target.logits: on the skinny GEMM
            # when the target's lm_head is, its approx modes included), not a second copy of it here
            lm_head_t = target.logits
            if self.greedy:
                prop = draft.propose_greedy(hidden, s.anchor[None], lm_head_t)
                q = None
            else:
                prop = draft.propose_sample(hidden, s.anchor[None], lm_head_t, key, samp.temperature,
                                            top_k=samp.top_k, top_p=samp.top_p)
                q = prop.draft_probs[0]
            conf = prop.confidence_logits[0] if prop.confidence_logits is not None else jnp.zeros((b,))
            return prop.tokens[0], q, conf
        # MTP: chain the NEXTN layer, each pass fed the previous draft and MTP hidden
        first = jnp.argmax(target.logits(s.mtp_hidden)[0, 0]).astype(jnp.int32)

        def link(carry, j):
            h, tok, mtp_cache = carry
            h, mtp_cache = target.mtp(h, target.embed_tokens(tok[None, None]), mtp_cache, p + j)
            nxt = jnp.argmax(target.logits(h)[0, 0]).astype(jnp.int32)
            return (h, nxt, mtp_cache), nxt
        _, rest = jax.lax.scan(link, (s.mtp_hidden, first, s.cache.mtp), jnp.arange(b - 1))
        return jnp.concatenate([first[None], rest]), None, jnp.zeros((b,))

    def _verify_commit(self, target, draft, operand, n: int, samp):
        """Verify [anchor, d_1..d_n] (static n), accept, commit. Returns (state, n, a, committed [B+1])."""
        s, drafts, q, key, override = operand
        p = s.cache.pos
        tokens = jnp.concatenate([s.anchor[None], drafts[:n]])[None]
        out = target(tokens, s.cache, logits="all", tap_layers=self.tap_layers, pending=True)
        logits = out.logits[0]
        with jax.named_scope("accept"):
            if self.greedy:
                a, bonus = sampling.accept_greedy(logits, drafts[:n], n)
            else:
                a, bonus = sampling.accept_sample(key, logits, drafts[:n], None if q is None else q[:n], n, samp)
        if override is not None:
            k = override.pattern[s.steps % override.pattern.shape[0]]
            fa = jnp.where(k < 0, n, jnp.minimum(k, n)).astype(jnp.int32)
            fb = jax.lax.dynamic_index_in_dim(override.oracle, p + 1 + fa, keepdims=False)
            force = jnp.asarray(override.force)
            a, bonus = jnp.where(force, fa, a), jnp.where(force, fb, bonus)
        cache = commit(out.cache, out.pending, a + 1, p)
        b = self.spec.drafts
        padded = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)])
        committed = jnp.where(jnp.arange(b + 1) < a, padded, bonus)   # [d_1..d_a, bonus, ...]
        draft_cache, mtp_hidden = s.draft_cache, s.mtp_hidden
        with jax.named_scope("draft"):           # the drafter's share of the commit
            if self.spec.method == "dspark":
                draft_cache = draft.append_context(s.draft_cache, out.taps, p, count=a + 1)
            if self.spec.method == "mtp":
                h, cache = target.mtp_forward(out.hidden, committed[None, :n + 1], cache, pos=p)
                mtp_hidden = jax.lax.dynamic_slice_in_dim(h, a, 1, axis=1)
        s = s._replace(cache=cache, draft_cache=draft_cache, mtp_hidden=mtp_hidden, anchor=bonus)
        return s, jnp.int32(n), a, committed

    # ---- verify-length policies --------------------------------------------------------------
    def _choose_width(self, s: DecodeState, conf):
        widths = self.spec.widths
        if len(widths) == 1:
            return jnp.int32(0)
        if self.spec.verify_policy == "adaptive":
            return s.policy[0]
        if self.spec.verify_policy == "confidence":
            # expected committed tokens for verifying n drafts: 1 + sum_{j<=n} prod_{i<=j} c_i
            c = jnp.cumprod(jax.nn.sigmoid(conf.astype(jnp.float32)))
            expect = 1.0 + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(c)])
            w = jnp.asarray(widths)
            return jnp.argmax(expect[w] / s.step_cost).astype(jnp.int32)
        return jnp.int32(len(widths) - 1)

    def _update_policy(self, policy, widx, n, a):
        """Lucebox adaptive width: grow after clean blocks (largest after two), shrink at once on a miss."""
        if self.spec.verify_policy != "adaptive" or len(self.spec.widths) == 1:
            return policy
        w = jnp.asarray(self.spec.widths)
        top = len(self.spec.widths) - 1
        clean = a == n
        streak = jnp.where(clean, policy[1] + 1, 0)
        grown = jnp.where(streak >= 2, top, jnp.minimum(widx + 1, top))
        shrunk = jnp.maximum(jnp.sum(w <= jnp.maximum(a, 1)) - 1, 0)
        return jnp.stack([jnp.where(clean, grown, shrunk), streak]).astype(jnp.int32)

    # ---- output and stop conditions -----------------------------------------------------------
    def _check_stop(self, s: DecodeState, new, count, at) -> DecodeState:
        """Append `count` tokens of `new` at out[at:]; cut at stop ids / stop sequences / limit."""
        width = new.shape[0]
        idx = jnp.arange(width)
        valid = idx < count
        hit = valid & jnp.isin(new, jnp.asarray(self.stop_ids or (-1,), jnp.int32))
        out = jax.lax.dynamic_update_slice_in_dim(s.out, new, at, axis=0)
        if self._stop_seqs is not None:
            seqs = jnp.asarray(self._stop_seqs)                           # [S, L] right-aligned, -1 pad
            L = seqs.shape[1]
            ends = at + idx                                               # absolute index of each new token
            win = jax.vmap(lambda e: jax.lax.dynamic_slice_in_dim(
                jnp.concatenate([jnp.full((L,), -2, jnp.int32), out]), e + 1, L))(ends)  # [W, L]
            match = jnp.all((seqs[None] == win[:, None]) | (seqs[None] < 0), axis=-1).any(-1)
            hit = hit | (valid & match)
        first_hit = jnp.argmax(hit)
        stopped = hit.any()
        n_new = jnp.where(stopped, first_hit + 1, count)
        room = s.limit - at
        length_cut = n_new >= room
        n_new = jnp.minimum(n_new, room)
        finish = jnp.where(stopped & (first_hit + 1 <= room), FINISH_STOP,
                           jnp.where(length_cut, FINISH_LENGTH, FINISH_RUNNING))
        return s._replace(out=out, n_out=(at + n_new).astype(jnp.int32), finish=finish.astype(jnp.int32))


CACHE_ALIGN = 64   # cache lengths in whole multiples (mla_kernel='pallas' needs S % 8 == 0; a few unused slots)


def _init_cache(target: LingModel, max_len: int) -> LingCache:
    max_len = -(-max_len // CACHE_ALIGN) * CACHE_ALIGN
    return init_cache(target.cfg, 1, max_len, target.dtype, with_mtp=target.mtp is not None, approx=target.approx)


def _apply_override(o: DraftOverride, pos, step, drafts, vocab: int):
    """The step's drafts [B] under the override: oracle tokens (one made wrong per `pattern`), the
    drafter's own where the oracle entry is < 0 (which keeps the draft pass live: DraftOverride)."""
    b = drafts.shape[0]
    oracle = jax.lax.dynamic_slice_in_dim(o.oracle, pos + 1, b)
    k = o.pattern[step % o.pattern.shape[0]]
    wrong = (oracle + 1) % vocab
    forced = jnp.where((jnp.arange(b) == k) & (k >= 0), wrong, oracle)
    return jnp.where(oracle < 0, drafts, forced).astype(jnp.int32)
