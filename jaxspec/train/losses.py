"""Draft training objectives, over a batch of target features.

Notation: sequence x_0 .. x_{L-1}; target features f_p at positions p (EAGLE-3: the residual streams
entering three layers, concatenated; EAGLE-1/2: the final normed hidden); target logits z_p predict
x_{p+1}. Draft row p at test step k (k = 0 .. K-1) reads token x_{p+k+1} at position p + k and
predicts x_{p+k+2}, whose target distribution is softmax(z_{p+k+1}). Loss counts only where
x_{p+k+2} is an assistant token.

EAGLE-3 (training-time test, the paper's recipe): step 0 feeds fc(f_p); step k feeds the draft's
own step k-1 output, and row p attends to step-0 keys of rows <= p plus its own keys of steps
1..k: exactly what a depth-k draft node sees at inference (committed prefix + its ancestors).
Step k's loss is weighted 0.8^k. The target distribution is restricted to the draft vocabulary.
Instead of the target's logits, the loss may take labels: the draft-vocabulary index of each next
token x_{p+1} (-1 outside the draft vocabulary), the target's own tokens, as online training
has them from what it served (a greedy token is the target's argmax; a sampled one, a draw
from its distribution): cross-entropy against that one token, and a row whose token the draft
vocabulary lacks counts as a miss.

EAGLE-1/2: one step; smooth-L1 regression of the draft output onto f_{p+1} plus 0.1 x the
cross-entropy against the target distribution through the target's LM head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.config import rope_inv_freq
from jaxspec.models.llama import apply_rope

TTT_DECAY = 0.8
EAGLE2_CLS_WEIGHT = 0.1


def _shift(x, k, length):
    """x[:, k : k + length] with zero padding past the end. x: [B, L, ...]."""
    pad = [(0, 0), (0, k + length - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad)[:, k : k + length]


def _soft_ce(logits, target_logits, w):
    """Mean over weighted rows of -sum q log p; logits/target_logits [B, T, V]; w [B, T]."""
    q = jax.nn.softmax(target_logits.astype(jnp.float32), -1)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    ce = -(q * lp).sum(-1)
    return (ce * w).sum() / jnp.maximum(w.sum(), 1.0)


def _acc(logits, target_logits, w):
    hit = jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1)
    return (hit * w).sum() / jnp.maximum(w.sum(), 1.0)


def _hard_ce(logits, labels, w):
    """Mean over weighted rows whose label is in the draft vocabulary of -log p(label);
    logits [B, T, Vd]; labels [B, T] int (-1: outside); w [B, T]."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    ce = -jnp.take_along_axis(lp, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
    w = w * (labels >= 0)
    return (ce * w).sum() / jnp.maximum(w.sum(), 1.0)


def _hard_acc(logits, labels, w):
    hit = jnp.argmax(logits, -1) == labels
    return (hit * w).sum() / jnp.maximum(w.sum(), 1.0)


def eagle3_ttt_loss(head, embed, tokens, feats, target_logits, mask, steps: int, rows=None):
    """head: Eagle3Head; embed: [V, H] target embedding; tokens [B, L]; feats [B, L, 3H];
    target_logits [B, L, Vd] (target logits restricted to the draft vocabulary) or labels [B, L]
    int (the draft-vocabulary index of x_{p+1}, -1 outside it); mask [B, L].
    rows: None, or (first [B] int, Q static): only the rows first_b .. first_b + Q - 1 (moved
    back to fit in the sequence) are queried and scored; the others only give step 0's keys and
    values. The same loss when every row with a label lies in that window (online training:
    the output tokens and the few rows before them), at the cost of Q rows instead of L.
    Returns (loss, {"loss_k", "acc_k"} per step)."""
    hard = target_logits.ndim == 2
    cfg = head.cfg
    b, length = tokens.shape
    t = length - 1  # rows p = 0 .. L-2 have a next token
    m = head.midlayer
    at = m.self_attn
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = nh // nkv
    inv = jnp.asarray(rope_inv_freq(cfg))
    h_all = head.fc(feats[:, :t].astype(embed.dtype))
    every = jnp.broadcast_to(jnp.arange(t), (b, t))
    if rows is None:
        nq, idx = t, every
        pick = lambda x: x
        causal = jnp.tril(jnp.ones((t, t), bool))
    else:
        first, nq = rows
        idx = jnp.clip(first, 0, t - nq)[:, None] + jnp.arange(nq)[None, :]  # [B, Q]
        pick = lambda x: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), 1)
        causal = (idx[:, :, None] >= jnp.arange(t)[None, None, :])[:, None, None]  # [B, 1, 1, Q, L-1]
    h = pick(h_all)
    ks, vs = [], []
    total = 0.0
    metrics = {}
    scale = d**-0.5
    for k in range(steps):
        if k == 0:  # every row: step 0's keys and values are every later row's context
            emb, hid, pos = embed[_shift(tokens, 1, t)], h_all, every
        else:
            emb, hid, pos = embed[pick(_shift(tokens, k + 1, t))], h, idx + k
        x = jnp.concatenate([m.input_layernorm(emb), m.hidden_norm(hid)], -1)
        if k == 0 and rows is not None and not at.shards:  # queries only at the rows scored
            q = apply_rope(at.q_proj(pick(x)).reshape(b, nq, nh, d), idx, inv)
            kk, vv = at.k_proj(x).reshape(b, t, nkv, d), at.v_proj(x).reshape(b, t, nkv, d)
        else:
            q, kk, vv = at.project(x)
            q = pick(apply_rope(q, pos, inv)) if k == 0 else apply_rope(q, pos, inv)
        q = q.reshape(b, nq, nkv, g, d)
        ks.append(apply_rope(kk, pos, inv))
        vs.append(vv)
        s0 = jnp.einsum("btkgd,bskd->bkgts", q, ks[0]) * scale
        s0 = jnp.where(causal, s0, -jnp.inf)
        sd = [jnp.einsum("btkgd,btkd->bkgt", q, ks[j])[..., None] * scale for j in range(1, k + 1)]
        p = jax.nn.softmax(jnp.concatenate([s0] + sd, -1).astype(jnp.float32), -1).astype(vv.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", p[..., :t], vs[0])
        for j in range(1, k + 1):
            out = out + jnp.einsum("bkgt,btkd->btkgd", p[..., t + j - 1], vs[j])
        residual = at.o_proj(out.reshape(b, nq, nh * d)) + h
        o = m.mlp(m.post_attention_layernorm(residual)) + residual
        logits = head.logits(head.norm(o))
        tl = pick(_shift(target_logits, k + 1, t))
        w = pick(_shift(mask, k + 2, t))
        lk = _hard_ce(logits, tl, w) if hard else _soft_ce(logits, tl, w)
        total = total + TTT_DECAY**k * lk
        metrics[f"loss_{k}"] = lk
        metrics[f"acc_{k}"] = _hard_acc(logits, tl, w) if hard else _acc(logits, tl, w)
        h = o
    return total, metrics


def eagle2_loss(head, embed, lm_head_fn, tokens, feats, target_logits, mask):
    """head: Eagle2Head; feats [B, L, H] final target hidden; target_logits [B, L, V];
    lm_head_fn: the target's LM head. Returns (loss, metrics)."""
    b, length = tokens.shape
    t = length - 1
    emb = embed[tokens[:, 1:]]
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = KVCache.create(head.cfg, b, t, emb.dtype)
    _, o, _ = head(emb, feats[:, :t].astype(emb.dtype), pos, cache)
    w = mask[:, 2:]
    w = jnp.pad(w, ((0, 0), (0, t - w.shape[1])))
    tgt_feat = feats[:, 1:].astype(jnp.float32)
    reg = jnp.where(jnp.abs(o - tgt_feat) < 1.0, 0.5 * (o - tgt_feat) ** 2, jnp.abs(o - tgt_feat) - 0.5).mean(-1)
    reg = (reg * w).sum() / jnp.maximum(w.sum(), 1.0)
    logits = lm_head_fn(o)
    tl = target_logits[:, 1:]
    cls = _soft_ce(logits, tl, w)
    return reg + EAGLE2_CLS_WEIGHT * cls, {"loss_reg": reg, "loss_cls": cls, "acc_0": _acc(logits, tl, w)}
