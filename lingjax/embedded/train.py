"""Train the embedded default model: a small Ling-3.0 target, then its DSpark draft.

    python -m lingjax.embedded.train --out lingjax/embedded/weights        # one H200: ~8 minutes
    python -m lingjax.embedded.train --out /tmp/smoke --smoke              # CPU, seconds

Data: the Python standard library's *.py files as bytes (`lingjax.embedded.data`); a hash of each
file's path holds ~5% of the files out for `python -m lingjax.embedded.evaluate`.

Phase 1, target (`LingModel`, the real model code, float32 parameters and AdamW state):
  loss = CE(next token) + mtp_weight * CE(MTP layer: token t+2 from the final hidden at t and
  embed(token t+1)). The MoE layers run through `experts_dense` while traced (same function as
  the model's expert paths, see dense_moe.py). The router's expert_bias (selection only, no
  gradient) gets the auxiliary-loss-free balance update: bias_e += rate * sign(mean load - load_e)
  after every step.
Phase 2, draft (`DSparkDraft`, the frozen target supplies taps, embeddings and lm_head):
  per training window, `anchors` random positions a; the context cache holds the target's taps of
  the whole window and each block sees positions < a (cache length = a); the block is
  [x_a, MASK x 7] at positions a..a+7; slot j is trained toward the target's prediction at
  position a+j (given the true prefix): CE to its argmax + tv_weight * TV distance to its
  distribution, on the Markov-corrected logits with the previous token teacher-forced (the
  anchor, then the target's argmax of the slot before); slot losses are weighted exp(-j/decay).
  The confidence head gets BCE toward [argmax of slot j == target argmax] on stop-gradient
  features (it does not shape the draft).
Both phases: AdamW (b2 0.95, weight decay on matrices only), linear warmup then cosine decay to
5%, global-norm clipping at 1. Seeded (numpy windows, jax init and anchors); saved in bfloat16.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lingjax.cache import init_cache
from lingjax.embedded import config as ecfg
from lingjax.embedded.data import Corpus, WindowSampler, load_corpus
from lingjax.embedded.dense_moe import dense_moe_experts, moe_modules
from lingjax.embedded.load import load_target, param_count, save_embedded
from lingjax.model.dspark import DSparkDraft
from lingjax.model.ling import LingModel

# Defaults for one H200 (~5 min target + ~3 min draft, compile included); see the module doc.
# Without --target-steps / --draft-steps a phase runs for a time budget: its step count is fixed
# after a short calibration (steps/s measured after compilation) and recorded in train_log.json;
# pass the logged counts back as --target-steps / --draft-steps to reproduce a run exactly.
FULL = dict(target_minutes=4.5, draft_minutes=2.5, batch=64, seq=512, anchors=32, target_lr=2e-3,
            draft_lr=1e-3, warmup=200, log_every=100, max_files=None, eval_batches=8)
SMOKE = dict(target_steps=8, draft_steps=6, batch=2, seq=64, anchors=4, target_lr=3e-3,
             draft_lr=3e-3, warmup=2, log_every=2, max_files=12, eval_batches=0)
CALIBRATION_STEPS = 30


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m lingjax.embedded.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (lingjax/embedded/weights to update the shipped model)")
    ap.add_argument("--smoke", action="store_true", help="tiny config, batch and step counts (CPU tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, help="fixed step count (default: --target-minutes budget)")
    ap.add_argument("--draft-steps", type=int, help="fixed step count (default: --draft-minutes budget)")
    ap.add_argument("--target-minutes", type=float, help="time budget of the target phase, compile included")
    ap.add_argument("--draft-minutes", type=float, help="time budget of the draft phase, compile included")
    ap.add_argument("--batch", type=int, help="windows per step (both phases)")
    ap.add_argument("--seq", type=int, help="window length in tokens (bytes)")
    ap.add_argument("--anchors", type=int, help="draft blocks per window")
    ap.add_argument("--target-lr", type=float)
    ap.add_argument("--draft-lr", type=float)
    ap.add_argument("--warmup", type=int, help="warmup steps (both phases)")
    ap.add_argument("--log-every", type=int)
    ap.add_argument("--max-files", type=int, help="use only the first N files of each split")
    ap.add_argument("--eval-batches", type=int, help="held-out batches scored after the target phase (0 = skip)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--balance-rate", type=float, default=1e-3, help="expert_bias update rate (0 = off)")
    ap.add_argument("--tv-weight", type=float, default=1.0)
    ap.add_argument("--conf-weight", type=float, default=0.1)
    ap.add_argument("--slot-decay", type=float, default=6.0, help="draft slot j loss weight exp(-j/decay)")
    ap.add_argument("--target-from", help="load the target from this directory instead of training it")
    args = ap.parse_args(argv)
    for k, v in (SMOKE if args.smoke else FULL).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


# ---- shared pieces ------------------------------------------------------------------------------
def optimizer(weight_decay: float, params) -> optax.GradientTransformation:
    """AdamW direction without the learning rate (the step multiplies by -lr, which it is given)."""
    mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                       optax.add_decayed_weights(weight_decay, mask))


def apply_lr(params, updates, lr):
    return jax.tree.map(lambda p, u: p - (lr * u).astype(p.dtype), params, updates)


class Schedule:
    """Linear warmup then cosine decay to 5% of the peak, over `total` steps. With total=None
    (time budget) the total is set after CALIBRATION_STEPS from the measured steps/s."""

    def __init__(self, peak: float, warmup: int, total: int | None, budget_s: float | None):
        self.peak, self.warmup, self.total, self.budget_s = peak, warmup, total, budget_s
        self.t0 = time.perf_counter()
        self.t1 = None
        if total is None and not budget_s:
            raise ValueError("give a step count or a time budget")

    def lr(self, step: int) -> float:
        """Learning rate of 0-based step `step`."""
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if self.total is None:
            return self.peak
        frac = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.peak * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))

    def running(self, done: int) -> bool:
        return self.total is None or done < self.total

    def observe(self, done: int, metrics) -> None:
        """Calibrate the budgeted step count (blocks on the device twice, at steps 1 and CALIBRATION_STEPS)."""
        if self.total is not None or done not in (1, CALIBRATION_STEPS):
            return
        jax.block_until_ready(metrics)
        now = time.perf_counter()
        if done == 1:
            self.t1 = now
            return
        rate = (done - 1) / max(now - self.t1, 1e-9)
        left = self.budget_s - (now - self.t0)
        self.total = max(done, done + int(rate * left))
        print(f"  {rate:.2f} steps/s after compilation ({self.t1 - self.t0:.0f}s): "
              f"{self.total} steps fit the {self.budget_s / 60:.1f} min budget", flush=True)


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


class Progress:
    """Periodic progress lines: step, metrics, steps/s (between prints), elapsed."""

    def __init__(self, name: str, every: int):
        self.name, self.every = name, max(1, every)
        self.t0 = self.t_last = time.perf_counter()
        self.last_step = 0
        self.history: list[dict] = []

    def maybe(self, step: int, total: int | None, metrics, lr: float) -> None:
        if step % self.every and step != total:
            return
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        rate = (step - self.last_step) / max(now - self.t_last, 1e-9)
        self.t_last, self.last_step = now, step
        m.update(lr=lr, step=step, elapsed_s=round(now - self.t0, 2), steps_per_s=round(rate, 2))
        self.history.append(m)
        body = "  ".join(f"{k} {v:.4g}" for k, v in m.items() if k not in ("step", "elapsed_s", "steps_per_s"))
        eta = f", ~{(total - step) / rate:.0f}s left" if total and rate > 0 else ""
        print(f"[{self.name}] step {step}/{total or '?'}  {body}  {rate:.2f} steps/s  "
              f"{now - self.t0:.0f}s elapsed{eta}", flush=True)


# ---- phase 1: target ----------------------------------------------------------------------------
def target_loss(model: LingModel, tokens, mtp_weight: float):
    """tokens [B, L+2] -> (loss, metrics, expert loads [n_moe, E])."""
    cfg = model.cfg
    x, y, y2 = tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]
    b, t = x.shape
    with dense_moe_experts([]) as rec:
        cache = init_cache(cfg, b, t, model.dtype, with_mtp=model.mtp is not None)
        out = model(x, cache, logits="all")
        ce = xent(out.logits, y).mean()
        loss, metrics = ce, {"ce": ce}
        if model.mtp is not None:
            h2, _ = model.mtp_forward(out.hidden, y, out.cache, pos=0)
            ce2 = xent(model.logits(h2), y2).mean()
            loss = loss + mtp_weight * ce2
            metrics["mtp_ce"] = ce2
    loads = jnp.stack([jnp.bincount(i.reshape(-1), length=cfg.num_experts) for i in rec])
    return loss, metrics, loads


def make_target_step(graphdef, tx, mtp_weight: float, balance_rate: float):
    def loss_fn(params, tokens):
        loss, metrics, loads = target_loss(nnx.merge(graphdef, params), tokens, mtp_weight)
        return loss, (metrics, loads)

    @jax.jit
    def step(params, opt_state, tokens, lr):
        (loss, (metrics, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = apply_lr(params, updates, lr)
        model = nnx.merge(graphdef, params)
        mods = moe_modules(model)
        assert len(mods) == loads.shape[0], (len(mods), loads.shape)
        for mod, load in zip(mods, loads):
            load = load.astype(jnp.float32)
            bias = mod.expert_bias.get_value()
            mod.expert_bias.set_value(bias + balance_rate * jnp.sign(load.mean() - load).astype(bias.dtype))
        frac = loads / loads.sum(-1, keepdims=True)
        metrics = dict(metrics, loss=loss, max_load=frac.max(-1).mean() * loads.shape[-1],
                       grad_norm=optax.global_norm(grads))
        return nnx.state(model), opt_state, metrics

    return step


@jax.jit
def _eval_target(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with dense_moe_experts():
        out = model(x, init_cache(model.cfg, x.shape[0], x.shape[1], model.dtype, with_mtp=False), logits="all")
    return xent(out.logits, y).mean()


def heldout_ce(model, corpus: Corpus, seq: int, batch: int, seed: int, n_batches: int) -> float:
    graphdef, params = nnx.split(model)
    sampler = WindowSampler(corpus.heldout, batch, seq + 1, seed + 12345)
    return float(np.mean([_eval_target(graphdef, params, jnp.asarray(sampler.next())) for _ in range(n_batches)]))


def train_target(args, cfg, corpus: Corpus) -> tuple[LingModel, dict]:
    model = LingModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    tx = optimizer(args.weight_decay, params)
    opt_state = tx.init(params)
    step = make_target_step(graphdef, tx, args.mtp_weight, args.balance_rate)
    sampler = WindowSampler(corpus.train, args.batch, args.seq + 2, args.seed)
    sched = Schedule(args.target_lr, args.warmup, args.target_steps, (args.target_minutes or 0) * 60)
    prog = Progress("target", args.log_every)
    print(f"[target] {param_count(model) / 1e6:.2f}M parameters, batch {args.batch} x {args.seq}, "
          f"{args.target_steps or f'{args.target_minutes} min of'} steps", flush=True)
    i = 0
    while sched.running(i):
        lr = sched.lr(i)
        params, opt_state, metrics = step(params, opt_state, jnp.asarray(sampler.next()), jnp.float32(lr))
        i += 1
        sched.observe(i, metrics)
        prog.maybe(i, sched.total, metrics, lr)
    jax.block_until_ready(params)
    model = nnx.merge(graphdef, params)
    summary = {"steps": i, "seconds": round(time.perf_counter() - prog.t0, 1),
               "final": prog.history[-1] if prog.history else {}, "history": prog.history}
    print(f"[target] done in {summary['seconds']}s", flush=True)
    if args.eval_batches:
        ce = heldout_ce(model, corpus, args.seq, args.batch, args.seed, args.eval_batches)
        summary.update(heldout_ce_nats=ce, heldout_bits_per_token=ce / math.log(2))
        print(f"[target] held-out CE {ce:.4f} nats ({ce / math.log(2):.4f} bits/token)", flush=True)
    return model, summary


# ---- phase 2: draft -----------------------------------------------------------------------------
def markov_teacher_forced(draft: DSparkDraft, hidden, base, prev):
    """Corrected logits and confidence logits with given previous tokens (teacher forcing).

    hidden [..., Bk, D], base [..., Bk, V], prev [..., Bk] -> (corrected [..., Bk, V], conf [..., Bk]).
    The same formulas as `DSparkDraft.propose_greedy`, with prev in place of the draft's own chain.
    """
    acc = jnp.float32
    corrected, conf = base, None
    e = None
    if draft.markov_w1 is not None:
        e = jnp.take(draft.markov_w1[...], prev, axis=0)
        corrected = base + jnp.dot(e, draft.markov_w2.weight[...], preferred_element_type=acc)
    if draft.conf_proj is not None:
        h = jax.lax.stop_gradient(hidden)
        if draft.cfg.confidence_head_with_markov and e is not None:
            h = jnp.concatenate([h, jax.lax.stop_gradient(e).astype(h.dtype)], axis=-1)
        w = draft.conf_proj.weight[...]
        conf = jnp.dot(h.astype(w.dtype), w, preferred_element_type=acc)[..., 0] + draft.conf_bias[...][0]
    return corrected, conf


class DraftBlocks(NamedTuple):
    hidden: jax.Array      # [B, A, Bk, D] draft output (final-normed)
    corrected: jax.Array   # [B, A, Bk, V] base logits + Markov bias of `prev`
    conf: jax.Array | None  # [B, A, Bk] confidence logits
    p_logits: jax.Array    # [B, A, Bk, V] target logits for the same next tokens
    labels: jax.Array      # [B, A, Bk] target argmax
    prev: jax.Array        # [B, A, Bk] teacher-forced previous tokens (anchor, labels[:-1])


def draft_blocks(draft: DSparkDraft, target: LingModel, tokens, anchors) -> DraftBlocks:
    """The draft's blocks at `anchors` [B, A] of windows `tokens` [B, L], as at inference: the
    context cache holds the target taps of the window and block a sees positions < a only."""
    cfg = draft.cfg
    bk = cfg.block_size
    b, t = tokens.shape
    with dense_moe_experts():
        out = target(tokens, init_cache(target.cfg, b, t, target.dtype, with_mtp=False),
                     logits="all", tap_layers=tuple(cfg.target_layer_ids))
    taps, t_logits = jax.lax.stop_gradient(out.taps), jax.lax.stop_gradient(out.logits)
    embed, lm_head = jax.lax.stop_gradient(target.embed[...]), jax.lax.stop_gradient(target.lm_head[...])

    cache = draft.append_context(draft.init_cache(b, t, per_row=True), taps, jnp.zeros((b,), jnp.int32))
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)                          # [B, A]
    ids = jnp.concatenate([anchor_tok[..., None],
                           jnp.full(anchors.shape + (bk - 1,), cfg.mask_token_id, jnp.int32)], axis=-1)
    block_embeds = jnp.take(embed, ids, axis=0)                                         # [B, A, Bk, D]

    def one_block(start, emb):                                                          # [B], [B, Bk, D]
        return draft.forward_block(cache._replace(length=start), emb, start)
    hidden = jax.vmap(one_block, in_axes=(1, 1), out_axes=1)(anchors, block_embeds)     # [B, A, Bk, D]
    base = jnp.einsum("baqe,ev->baqv", hidden, lm_head.astype(hidden.dtype), preferred_element_type=jnp.float32)

    pos = anchors[..., None] + jnp.arange(bk, dtype=jnp.int32)                         # [B, A, Bk]
    p_logits = t_logits[jnp.arange(b)[:, None, None], pos].astype(jnp.float32)         # [B, A, Bk, V]
    labels = jnp.argmax(p_logits, axis=-1).astype(jnp.int32)
    prev = jnp.concatenate([anchor_tok[..., None], labels[..., :-1]], axis=-1)
    corrected, conf = markov_teacher_forced(draft, hidden, base, prev)
    return DraftBlocks(hidden, corrected, conf, p_logits, labels, prev)


def draft_loss(draft: DSparkDraft, target: LingModel, tokens, anchors, *, tv_weight, conf_weight, slot_decay):
    """tokens [B, L], anchors [B, A] in 1..L-Bk -> (loss, metrics)."""
    bk = draft.cfg.block_size
    _, corrected, conf, p_logits, labels, _ = draft_blocks(draft, target, tokens, anchors)
    ce = xent(corrected, labels)
    tv = 0.5 * jnp.abs(jax.nn.softmax(corrected) - jax.nn.softmax(p_logits)).sum(-1)
    hit = (jnp.argmax(corrected, axis=-1) == labels)
    w = jnp.exp(-jnp.arange(bk, dtype=jnp.float32) / slot_decay)
    w = w / w.sum()
    per_slot = ce + tv_weight * tv
    metrics = {"ce": (ce * w).sum(-1).mean(), "tv": (tv * w).sum(-1).mean()}
    loss = (per_slot * w).sum(-1).mean()
    if conf is not None:
        bce = optax.sigmoid_binary_cross_entropy(conf, hit.astype(jnp.float32))
        loss = loss + conf_weight * bce.mean()
        metrics["conf_bce"] = bce.mean()
    # accepted drafts per block if the target continued with these labels (greedy, teacher forced)
    run = jnp.cumprod(hit.astype(jnp.int32), axis=-1).sum(-1)
    metrics.update(loss=loss, slot0_acc=hit[..., 0].mean(), est_accept_len=1.0 + run.mean())
    return loss, metrics


def make_draft_step(dgraph, tgraph, tparams, tx, args):
    def loss_fn(dparams, tokens, anchors):
        return draft_loss(nnx.merge(dgraph, dparams), nnx.merge(tgraph, tparams), tokens, anchors,
                          tv_weight=args.tv_weight, conf_weight=args.conf_weight, slot_decay=args.slot_decay)

    @jax.jit
    def step(dparams, opt_state, tokens, key, lr):
        bk = nnx.merge(dgraph, dparams).cfg.block_size
        anchors = jax.random.randint(key, (tokens.shape[0], args.anchors), 1, tokens.shape[1] - bk + 1)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(dparams, tokens, anchors.astype(jnp.int32))
        updates, opt_state = tx.update(grads, opt_state, dparams)
        return apply_lr(dparams, updates, lr), opt_state, dict(metrics, grad_norm=optax.global_norm(grads))

    return step


def train_draft(args, cfg, target: LingModel, corpus: Corpus) -> tuple[DSparkDraft, dict]:
    draft = DSparkDraft(cfg, dtype=jnp.float32, rngs=nnx.Rngs(args.seed + 1))
    dgraph, dparams = nnx.split(draft)
    tgraph, tparams = nnx.split(target)
    tx = optimizer(args.weight_decay, dparams)
    opt_state = tx.init(dparams)
    step = make_draft_step(dgraph, tgraph, tparams, tx, args)
    sampler = WindowSampler(corpus.train, args.batch, args.seq, args.seed + 1)
    key = jax.random.key(args.seed + 2)
    sched = Schedule(args.draft_lr, args.warmup, args.draft_steps, (args.draft_minutes or 0) * 60)
    prog = Progress("draft", args.log_every)
    print(f"[draft] {param_count(draft) / 1e6:.2f}M parameters, batch {args.batch} x {args.seq}, "
          f"{args.anchors} blocks of {cfg.block_size} per window, "
          f"{args.draft_steps or f'{args.draft_minutes} min of'} steps", flush=True)
    i = 0
    while sched.running(i):
        lr = sched.lr(i)
        dparams, opt_state, metrics = step(dparams, opt_state, jnp.asarray(sampler.next()),
                                           jax.random.fold_in(key, i), jnp.float32(lr))
        i += 1
        sched.observe(i, metrics)
        prog.maybe(i, sched.total, metrics, lr)
    jax.block_until_ready(dparams)
    summary = {"steps": i, "seconds": round(time.perf_counter() - prog.t0, 1),
               "final": prog.history[-1] if prog.history else {}, "history": prog.history}
    print(f"[draft] done in {summary['seconds']}s", flush=True)
    return nnx.merge(dgraph, dparams), summary


# ---- main ---------------------------------------------------------------------------------------
def _versions() -> dict:
    import flax
    return {"python": sys.version.split()[0], "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "numpy": np.__version__, "platform": platform.platform()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    tcfg, dcfg = ecfg.smoke_configs() if args.smoke else (ecfg.target_config(), ecfg.draft_config())
    print(f"devices: {jax.devices()}", flush=True)
    corpus = load_corpus(max_files=args.max_files)
    print(f"corpus: {json.dumps(corpus.summary())}", flush=True)
    if args.target_from:
        target = load_target(args.target_from, jnp.float32)
        tcfg = target.cfg
        t_summary = {"loaded_from": str(args.target_from)}
    else:
        target, t_summary = train_target(args, tcfg, corpus)
    draft, d_summary = train_draft(args, dcfg, target, corpus)
    log = {
        "command": "python -m lingjax.embedded.train " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args), "seed": args.seed, "corpus": corpus.summary(),
        "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
        "versions": _versions(), "total_seconds": round(time.perf_counter() - t0, 1),
        "target": {"parameters": param_count(target), **t_summary},
        "draft": {"parameters": param_count(draft), **d_summary},
    }
    log["reproduce"] = (f"python -m lingjax.embedded.train --out {args.out} --seed {args.seed}"
                        + (" --smoke" if args.smoke else "")
                        + (f" --target-steps {t_summary['steps']}" if "steps" in t_summary else "")
                        + f" --draft-steps {d_summary['steps']}")
    save_embedded(args.out, target, draft, train_log=log)
    print(f"saved to {args.out} in {log['total_seconds']}s total", flush=True)
    return log


if __name__ == "__main__":
    main()
