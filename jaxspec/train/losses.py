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


def eagle3_ttt_loss(head, embed, tokens, feats, target_logits, mask, steps: int):
    """head: Eagle3Head; embed: [V, H] target embedding; tokens [B, L]; feats [B, L, 3H];
    target_logits [B, L, Vd] (target logits restricted to the draft vocabulary); mask [B, L].
    Returns (loss, {"loss_k", "acc_k"} per step)."""
    cfg = head.cfg
    b, length = tokens.shape
    t = length - 1  # rows p = 0 .. L-2 have a next token
    m = head.midlayer
    at = m.self_attn
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = nh // nkv
    inv = jnp.asarray(rope_inv_freq(cfg))
    h = head.fc(feats[:, :t].astype(embed.dtype))
    causal = jnp.tril(jnp.ones((t, t), bool))
    ks, vs = [], []
    total = 0.0
    metrics = {}
    for k in range(steps):
        emb = embed[_shift(tokens, k + 1, t)]
        pos = jnp.broadcast_to(jnp.arange(t) + k, (b, t))
        x = jnp.concatenate([m.input_layernorm(emb), m.hidden_norm(h)], -1)
        q, kk, vv = at.project(x)
        q = apply_rope(q, pos, inv).reshape(b, t, nkv, g, d)
        kk = apply_rope(kk, pos, inv)
        ks.append(kk)
        vs.append(vv)
        scale = d**-0.5
        s0 = jnp.einsum("btkgd,bskd->bkgts", q, ks[0]) * scale
        s0 = jnp.where(causal, s0, -jnp.inf)
        sd = [jnp.einsum("btkgd,btkd->bkgt", q, ks[j])[..., None] * scale for j in range(1, k + 1)]
        p = jax.nn.softmax(jnp.concatenate([s0] + sd, -1).astype(jnp.float32), -1).astype(vv.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", p[..., :t], vs[0])
        for j in range(1, k + 1):
            out = out + jnp.einsum("bkgt,btkd->btkgd", p[..., t + j - 1], vs[j])
        residual = at.o_proj(out.reshape(b, t, nh * d)) + h
        o = m.mlp(m.post_attention_layernorm(residual)) + residual
        logits = head.logits(head.norm(o))
        tl = _shift(target_logits, k + 1, t)
        w = _shift(mask, k + 2, t)
        lk = _soft_ce(logits, tl, w)
        total = total + TTT_DECAY**k * lk
        metrics[f"loss_{k}"] = lk
        metrics[f"acc_{k}"] = _acc(logits, tl, w)
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
