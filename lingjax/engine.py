"""The Engine: a loaded target (+ optional draft) and tokenizer, serving `generate` and `stream`.

The CLI, the server and the benchmark all use it. Decoding runs on the device in chunks of
`chunk_steps` speculative steps; while chunk k+1 runs, the host reads chunk k's tokens (JAX async
dispatch), so streaming adds no host sync to the critical path. One request at a time (batch 1).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.model.ling import LingModel
from lingjax.sampling import SamplingArrays, SamplingParams
from lingjax.spec_decode import FINISH_LENGTH, FINISH_NAMES, FINISH_RUNNING, FINISH_STOP, Decoder, DraftOverride, SpecConfig


class RequestError(ValueError):
    """A request the engine cannot serve as given (the message says what to change)."""


@dataclasses.dataclass
class GenerationStats:
    ttft_s: float = 0.0
    total_s: float = 0.0
    tokens_per_s: float = 0.0        # decode speed after the first token
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_length: float = 0.0      # committed tokens per speculative step
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stats: GenerationStats


@dataclasses.dataclass
class StreamChunk:
    token_ids: list[int]     # new tokens since the last chunk
    text: str                # new text since the last chunk ("" without a tokenizer)
    result: GenerationResult | None = None   # set on the final chunk


def _bucket(n: int) -> int:
    """Round buffer sizes up to a power of two (>= 16) so few shapes get compiled."""
    return max(16, 1 << (n - 1).bit_length())


class Engine:
    def __init__(self, target: LingModel, tokenizer=None, draft=None, *, spec: SpecConfig | None = None,
                 chunk_steps: int = 16, max_context: int | None = None, extra_stop_ids: Sequence[int] = (),
                 target_chunk_s: float = 0.2):
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.cfg = target.cfg
        self.spec = spec or SpecConfig("dspark" if draft is not None else "none")
        self.chunk_steps = chunk_steps
        self.target_chunk_s = target_chunk_s
        self._step_costs: dict = {}
        self.max_context = min(max_context or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)
        ids = set(self.cfg.eos_token_ids) | set(extra_stop_ids)
        if tokenizer is not None:
            ids |= set(tokenizer.stop_token_ids)
        self.stop_ids = tuple(sorted(ids))
        self._decoders: dict = {}
        self._logits_fn = None
        self.decoder(self.spec, True)  # validates the spec / draft combination now, not per request

    # ---- decoders -----------------------------------------------------------------------------
    def decoder(self, spec: SpecConfig, greedy: bool, stop_sequences=()) -> Decoder:
        key = (spec, greedy, tuple(stop_sequences))
        if key not in self._decoders:
            self._decoders[key] = Decoder(self.target, spec, draft=self.draft if spec.method == "dspark" else None,
                                          stop_ids=self.stop_ids, stop_sequences=tuple(stop_sequences), greedy=greedy)
        return self._decoders[key]

    def step_costs(self, spec: SpecConfig):
        """Relative step time per verify width, measured once per spec for the 'confidence' policy
        (DSpark's rule needs the marginal cost of verifying one more token); ones otherwise."""
        if spec.verify_policy != "confidence" or len(spec.widths) == 1:
            return jnp.ones((len(spec.widths),), jnp.float32)
        if spec not in self._step_costs:
            self._step_costs[spec] = jnp.asarray(measure_verify_costs(self.target, spec.widths), jnp.float32)
        return self._step_costs[spec]

    @staticmethod
    def prompt_bucket(n: int) -> int:
        """Compiled prompt length for an n-token prompt: the next power of two (>= 16), so a server
        compiles O(log context) prefills instead of one per prompt length. The padding is masked
        (`valid_len`): KDA states skip it and its MLA entries are overwritten before use."""
        return _bucket(n)

    # ---- inputs -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("the prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token id(s) {bad[:5]} out of range [0, {self.cfg.vocab_size})")
        return ids

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, spec: SpecConfig) -> int:
        room = self.max_context - prompt_len - spec.drafts - 2
        if room < 1:
            raise RequestError(f"prompt of {prompt_len} tokens leaves no room in the context of "
                               f"{self.max_context} tokens (n_prompt_tokens={prompt_len}, n_ctx={self.max_context})")
        if max_tokens is None:
            return room
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_tokens > room:
            raise RequestError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                               f"{self.max_context} tokens (at most {room} new tokens fit)")
        return max_tokens

    # ---- generation ---------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], *, sampling: SamplingParams = SamplingParams(),
               max_tokens: int | None = None, stop: Sequence[str] = (), stop_token_sequences=(),
               spec: SpecConfig | None = None, override: DraftOverride | None = None,
               chunk_steps: int | None = None) -> Iterator[StreamChunk]:
        """Yield StreamChunks as device chunks complete; the last one carries the result.

        chunk_steps: speculative steps per device call. Default: start with the engine's
        `chunk_steps` and then size chunks to last about `target_chunk_s` each (measured), since
        every device call costs a few ms of fixed host/launch work (docs/PERFORMANCE.md)."""
        adapt = chunk_steps is None and self.target_chunk_s > 0
        chunk_steps = chunk_steps or self.chunk_steps
        t_start = time.perf_counter()
        spec = spec or self.spec
        ids = self.encode_prompt(prompt)
        max_new = self.resolve_max_tokens(len(ids), max_tokens, spec)
        dec = self.decoder(spec, sampling.greedy, stop_token_sequences)
        samp = SamplingArrays.from_params(sampling)
        cost = self.step_costs(spec)
        padded = ids + [0] * (self.prompt_bucket(len(ids)) - len(ids))
        state = dec.prefill(dec.params, jnp.asarray([padded], jnp.int32), _bucket(max_new), jnp.int32(max_new),
                            jax.random.key(sampling.seed), samp, cost, prompt_len=jnp.int32(len(ids)))
        detok = self.tokenizer.stream_decoder() if self.tokenizer else None
        emitted, text, t_first, ends, found = 0, "", None, [], None
        finish = FINISH_RUNNING
        while True:
            if t_first is None:  # first token: read the prefill before compiling / enqueueing the loop
                n_out, fin, out_buf, steps = jax.device_get((state.n_out, state.finish, state.out, state.steps))
                t_first = t_read = time.perf_counter()
                nxt = dec.run(dec.params, state, samp, override, max_steps=chunk_steps)
            else:
                nxt = dec.run(dec.params, state, samp, override, max_steps=chunk_steps)   # enqueued
                n_out, fin, out_buf, now_steps = jax.device_get((state.n_out, state.finish, state.out, state.steps))
                t_now = time.perf_counter()
                if adapt and now_steps > steps:   # size the chunk after next from the measured step time
                    step_s = (t_now - t_read) / (now_steps - steps)
                    chunk_steps = int(min(4096, max(4, self.target_chunk_s / max(step_s, 1e-6))))
                t_read, steps = t_now, now_steps
            n_out, fin = int(n_out), int(fin)
            new = out_buf[emitted:n_out].tolist()
            first_new = emitted
            emitted = n_out
            pieces = [detok.feed(t) for t in new] if detok else []
            delta = "".join(pieces)
            for piece in pieces:                       # text length after each token
                ends.append((ends[-1] if ends else 0) + len(piece))
            text += delta
            found = _find_stop(text, stop, len(text) - len(delta))
            if found is not None:
                cut, length = found
                delta = delta[: max(0, cut - (len(text) - len(delta)))]
                text = text[:cut]
                # keep the tokens up to the one that completes the stop string
                n_out = next(i + 1 for i, e in enumerate(ends) if e >= cut + length)
                new = new[: max(0, n_out - first_new)]
                fin = FINISH_STOP
            if fin != FINISH_RUNNING:
                finish = fin
                last = state
                break
            if new or delta:
                yield StreamChunk(new, delta)
            state = nxt
        t_end = time.perf_counter()
        if detok and found is None:
            tail = detok.flush()
            delta += tail
            text += tail
        tokens = out_buf[:n_out].tolist()
        steps = int(last.steps)
        stats = GenerationStats(
            ttft_s=t_first - t_start, total_s=t_end - t_start,
            tokens_per_s=(len(tokens) - 1) / max(t_end - t_first, 1e-9) if len(tokens) > 1 else 0.0,
            steps=steps, drafted=int(last.drafted), accepted=int(last.accepted),
            accept_length=(int(last.accepted) + steps) / steps if steps else 0.0,
            accepted_per_position=np.asarray(last.pos_accepted).tolist() if spec.drafts else [],
            prompt_tokens=len(ids), completion_tokens=len(tokens))
        result = GenerationResult(tokens, text if self.tokenizer else None, FINISH_NAMES[finish], stats)
        yield StreamChunk(new, delta, result)

    def generate(self, prompt, **kw) -> GenerationResult:
        """Non-streaming: without stop strings the whole request is one device call."""
        if not kw.get("stop") and "chunk_steps" not in kw:
            kw["chunk_steps"] = 1 << 30
        for chunk in self.stream(prompt, **kw):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a result")

    def prompt_logits(self, prompt: str | Sequence[int]) -> np.ndarray:
        """float32 logits [T, V] of every prompt position (one prefill)."""
        ids = self.encode_prompt(prompt)
        if len(ids) > self.max_context:
            raise RequestError(f"prompt of {len(ids)} tokens exceeds the context of {self.max_context}")
        if self._logits_fn is None:
            graph, params = nnx.split(self.target)

            def fn(params, t):
                m = nnx.merge(graph, params)
                return m(t, m.init_cache(1, t.shape[1], with_mtp=False)).logits
            self._logits_fn = (jax.jit(fn), params)
        fn, params = self._logits_fn
        return np.asarray(fn(params, jnp.asarray([ids], jnp.int32))[0], np.float32)


def measure_verify_costs(target: LingModel, widths: Sequence[int], context: int = 256, repeats: int = 3):
    """Wall time of a verify forward over n+1 tokens for each n in widths, normalised to the
    smallest. The draft pass costs the same at every width, so it does not change the ranking
    much and is not included."""
    graph, params = nnx.split(target)

    @jax.jit
    def verify(params, tokens, cache):
        m = nnx.merge(graph, params)
        return m(tokens, cache, logits="all", pending=True).logits

    cache = target.init_cache(1, context + max(widths) + 1, with_mtp=False)
    cache = cache._replace(pos=jnp.int32(context))
    times = []
    for n in widths:
        toks = jnp.zeros((1, n + 1), jnp.int32)
        verify(params, toks, cache).block_until_ready()
        t = time.perf_counter()
        for _ in range(repeats):
            r = verify(params, toks, cache)
        r.block_until_ready()
        times.append((time.perf_counter() - t) / repeats)
    return [x / times[0] for x in times]


def _find_stop(text: str, stops: Sequence[str], new_from: int) -> tuple[int, int] | None:
    """(start, length) of the earliest stop string that ends in the new part of `text`, or None."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, len(s))
    return best


__all__ = ["Engine", "GenerationResult", "GenerationStats", "RequestError", "StreamChunk",
           "FINISH_STOP", "FINISH_LENGTH"]
