"""`jaxspec train-draft`: trains an EAGLE-3 (or EAGLE-1/2) head for a frozen target.

Loop: batches of padded chats -> frozen target forward (features + logits, jitted, no grad) ->
draft loss (losses.py) -> AdamW with linear warmup + cosine decay and global-norm clipping.
Orbax checkpoints (params, optimizer state, step) every `save_every` steps under OUT/ckpt; a rerun
with the same OUT resumes. At the end the head is written in the public layout (config.json +
bf16 model.safetensors) that jaxspec and SGLang load, with train_log.json and loss.svg beside it.

With a deadline (`train(deadline=...)`), the run plans as many of its `steps` as fit: every length
bucket is compiled first, then the step rate is measured and the learning-rate schedule is fitted to
the steps that fit, re-planned as the rate is measured again. `init_head` starts from the weights
(and draft vocabulary) of a head written before, so a later run continues where an earlier one
stopped, with a fresh optimizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jaxspec.args import flag
from jaxspec.cache import KVCache
from jaxspec.convert.checkpoint import np_dtype
from jaxspec.errors import JaxspecError
from jaxspec.models.eagle import build_eagle, eagle3_capture_layers, eagle_config, eagle_key
from jaxspec.models.params import load_module, module_tensors
from jaxspec.train.data import Example, draft_vocab, pad_batch
from jaxspec.train.losses import eagle2_loss, eagle3_ttt_loss

LM_HEAD_INIT_SCALE = 0.25  # EAGLE-3 warm start: draft LM head = this x the target's rows
LENGTH_BUCKET = 128  # training batches are padded to a multiple of this (at most max_len)
PLAN_EVERY = 25  # with a deadline, the steps that fit are re-planned every this many steps


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training flags of `jaxspec train-draft` (each field is a flag: jaxspec/args.py)."""

    algorithm: str = flag("EAGLE3", "head to train", choices=("EAGLE3", "EAGLE"))
    steps: int = flag(1000, "optimizer steps")
    batch_size: int = flag(4, "conversations per step")
    max_len: int = flag(512, "tokens per training sequence (longer chats are cut)")
    lr: float = flag(3e-4, "peak learning rate (AdamW, linear warmup then cosine decay)")
    warmup: int = flag(50, "warmup steps")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    clip: float = flag(0.5, "global gradient-norm clip")
    ttt_steps: int = flag(4, "EAGLE-3 training-time-test depth")
    draft_vocab_size: int = flag(
        8192, "EAGLE-3 draft vocabulary (most frequent assistant tokens); with --draft-vocab-coverage, the least"
    )
    draft_vocab_coverage: float = flag(
        0.0,
        "choose the EAGLE-3 draft vocabulary by coverage instead: the fewest most-frequent tokens (a multiple of "
        "256, between --draft-vocab-size and --draft-vocab-max) covering this share of the target's own answer "
        "tokens (the regenerated answers; all training answers without --regenerate); 0: off",
    )
    draft_vocab_max: int = flag(32768, "the largest draft vocabulary --draft-vocab-coverage may choose")
    save_every: int = flag(200, "orbax checkpoint interval (steps)")
    seed: int = flag(0, "initialisation and data-order seed")


def output_rows(model):
    """The target's output embedding [V, H]: its LM head's rows, or the tied input embedding."""
    return model.embed_tokens[...] if model.lm_head is None else model.lm_head.kernel[...].T


def _read_head(path: str, algorithm: str) -> dict[str, np.ndarray]:
    """The tensors of a head written before (public layout), checked to be of `algorithm`'s kind."""
    from jaxspec.convert.sources import open_source

    src = open_source(path)
    kind = eagle_config(src.config)[0] if src.kind == "eagle" else None
    if kind != algorithm:
        raise JaxspecError(f"--init-head {path} is not an {algorithm} head (it is {kind or src.kind})")
    return {n: src.get(n) for n in src.names}


def draft_hf_config(target_cfg_dict: dict, algorithm: str, draft_vocab_size: int | None) -> dict:
    """config.json of a draft head for this target (SGLang's LlamaForCausalLMEagle[3] layout)."""
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "bos_token_id",
        "eos_token_id",
        "head_dim",
    )
    cfg = {k: target_cfg_dict[k] for k in keep if target_cfg_dict.get(k) is not None}
    # transformers 5 writes rope settings as rope_parameters; SGLang (transformers 4) reads rope_theta /
    # rope_scaling, and a missing rope_theta silently becomes 10000
    rope = dict(target_cfg_dict.get("rope_parameters") or {})
    if "rope_theta" not in cfg and rope.get("rope_theta") is not None:
        cfg["rope_theta"] = rope.pop("rope_theta")
    if "rope_scaling" not in cfg and rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg.update(
        model_type="llama",
        num_hidden_layers=1,
        hidden_act="silu",
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLMEagle3" if algorithm == "EAGLE3" else "LlamaForCausalLMEagle"],
    )
    if algorithm == "EAGLE3":
        cfg["draft_vocab_size"] = draft_vocab_size
    return cfg


class Trainer:
    def __init__(
        self,
        target,
        target_cfg_dict: dict,
        examples: list[Example],
        cfg: TrainConfig,
        out: str,
        progress: bool = True,
        vocab_ids: np.ndarray | None = None,
        init_head: str | None = None,
    ):
        """vocab_ids: the EAGLE-3 draft vocabulary (sorted target ids; default: the cfg.draft_vocab_size
        most frequent answer tokens); init_head: a head directory to start from (its vocabulary wins)."""
        if cfg.algorithm not in ("EAGLE", "EAGLE3"):
            raise JaxspecError(f"train-draft supports EAGLE and EAGLE3, not {cfg.algorithm}")
        if not examples:
            raise JaxspecError("no training examples")
        self.target, self.cfg, self.out, self.progress = target, cfg, out, progress
        self.examples = examples
        tcfg = target.cfg
        self.ids = None
        init = _read_head(init_head, cfg.algorithm) if init_head else None
        if cfg.algorithm == "EAGLE3":
            eos = [i for i in tcfg.eos_token_ids if i < tcfg.vocab_size]
            if init is not None:
                d2t = np.asarray(init["d2t"], np.int64)
                vocab_ids = (np.arange(len(d2t)) + d2t).astype(np.int32)
            elif vocab_ids is None:
                vocab_ids = draft_vocab(examples, cfg.draft_vocab_size, tcfg.vocab_size, always=eos)
            self.ids = np.asarray(vocab_ids, np.int32)
        self.hf_config = draft_hf_config(target_cfg_dict, cfg.algorithm, None if self.ids is None else len(self.ids))
        kind, dcfg, extra = eagle_config(self.hf_config)
        head = build_eagle(kind, dcfg, extra, jnp.float32, nnx.Rngs(cfg.seed))
        if self.ids is not None:
            head.d2t[...] = jnp.asarray(self.ids - np.arange(len(self.ids)), jnp.int32)
            # Warm start: the draft's LM head begins as the target's own rows for the draft vocabulary
            # (the token geometry), scaled down so that the first logits are soft rather than
            # confidently wrong (copying the target's output norm too made the initial loss ~4x log V).
            w = output_rows(target.model)
            head.lm_head.kernel[...] = LM_HEAD_INIT_SCALE * jnp.asarray(w[jnp.asarray(self.ids)].T, jnp.float32)
        if init is not None:
            head = load_module(
                lambda: build_eagle(kind, dcfg, extra, jnp.float32, nnx.Rngs(cfg.seed)),
                eagle_key,
                init,
                init.__getitem__,
                jnp.float32,
                progress=False,
                ignore=lambda n: n in ("t2d", "embed_tokens.weight") or n.endswith("rotary_emb.inv_freq"),
            )
        graphdef, params, rest = nnx.split(head, nnx.Param, ...)  # type: ignore[misc]
        self.graphdef: Any = graphdef
        self.params: Any = params
        self.rest: Any = rest
        self.capture = eagle3_capture_layers(tcfg) if kind == "EAGLE3" else ()
        # AdamW with the learning rate applied in the update (it is an argument of the step), so that a
        # deadline can re-plan the schedule without recompiling
        self.tx = optax.chain(
            optax.clip_by_global_norm(cfg.clip), optax.scale_by_adam(), optax.add_decayed_weights(cfg.weight_decay)
        )
        self.opt_state = self.tx.init(self.params)
        self.planned = cfg.steps  # the steps the schedule spans (fewer when a deadline cuts the run)
        self.step = 0
        self.log: list[dict] = []
        self._tgt_graphdef, self._tgt_params = nnx.split(target.model)
        self._features = jax.jit(self._features_impl)
        self._update = jax.jit(self._update_impl, donate_argnums=(0, 1))
        self._eval_loss = jax.jit(self._loss)  # one program for every evaluation (held-out, per category)
        # the same on features computed elsewhere (online training: the server's), against the tokens
        self.update_given = jax.jit(self._update_given_impl, donate_argnums=(0, 1), static_argnames=("nq",))
        self.eval_given = jax.jit(self._eval_given_impl, static_argnames=("nq",))

    # ---- jitted pieces --------------------------------------------------------------------------

    def _features_impl(self, tparams, ids):
        """Frozen target: (features [B, L, F], logits [B, L, Vd or V]) for a batch of ids [B, L]."""
        tgt = nnx.merge(self._tgt_graphdef, tparams)
        b, length = ids.shape
        cache = KVCache.create(tgt.cfg, b, length, jnp.float32)
        h, _, cap = tgt(ids, jnp.broadcast_to(jnp.arange(length), (b, length)), cache, capture_layers=self.capture)
        if self.ids is None:
            return h, tgt.logits(h)
        w = output_rows(tgt)  # [V, H]
        logits = jnp.einsum("blh,vh->blv", h, w[jnp.asarray(self.ids)], preferred_element_type=jnp.float32)
        return jnp.concatenate(list(cap), -1), logits

    def _loss(self, params, rest, tparams, ids, mask, feats, tlogits, rows=None):
        head = nnx.merge(self.graphdef, params, rest)
        tgt = nnx.merge(self._tgt_graphdef, tparams)
        embed = jax.lax.stop_gradient(tgt.embed_tokens[...])
        if self.ids is not None:
            return eagle3_ttt_loss(head, embed, ids, feats, tlogits, mask, self.cfg.ttt_steps, rows)
        return eagle2_loss(head, embed, tgt.logits, ids, feats, tlogits, mask)

    def _update_impl(self, params, opt_state, rest, tparams, ids, mask, lr):
        feats, tlogits = jax.lax.stop_gradient(self._features_impl(tparams, ids))
        (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
            params, rest, tparams, ids, mask, feats, tlogits
        )
        return self._apply(params, opt_state, grads, lr) + (loss, metrics)

    def _apply(self, params, opt_state, grads, lr):
        """AdamW's step at learning rate lr -> (params, opt_state)."""
        updates, opt_state = self.tx.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: -lr * u, updates)
        return optax.apply_updates(params, updates), opt_state

    def _labels(self, ids, vocab=None):
        """The draft-vocabulary index of each next token [B, L] (-1 outside it; the last column's
        is never used). vocab: the draft vocabulary [Vd] (sorted target ids; default self.ids)."""
        assert self.ids is not None, "labels are EAGLE-3's"
        vocab = jnp.asarray(self.ids) if vocab is None else vocab
        lut = jnp.full((self.target.cfg.vocab_size,), -1, jnp.int32)
        lut = lut.at[vocab].set(jnp.arange(vocab.shape[0], dtype=jnp.int32))
        return lut[jnp.pad(ids[:, 1:], ((0, 0), (0, 1)))]

    def _eval_given_impl(self, params, rest, tparams, ids, mask, feats, first=None, nq=None, vocab=None):
        """EAGLE-3 loss and metrics on given features [B, L, F] (any float dtype), labels the tokens;
        with first [B] and nq, only rows first .. first + nq - 1 scored (losses.eagle3_ttt_loss rows);
        vocab: the head's draft vocabulary [Vd] when it is not self.ids (an argument: no recompile)."""
        rows = None if nq is None else (first, nq)
        labels = self._labels(ids, vocab)
        return self._loss(params, rest, tparams, ids, mask, feats.astype(jnp.float32), labels, rows)

    def _update_given_impl(
        self, params, opt_state, rest, tparams, lr, ids, mask, feats, first=None, nq=None, vocab=None
    ):
        """One update on given features [B, L, F] (no target forward), labels the tokens; first, nq
        and vocab as in _eval_given_impl."""
        labels = self._labels(ids, vocab)
        rows = None if nq is None else (first, nq)
        (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
            params, rest, tparams, ids, mask, feats.astype(jnp.float32), labels, rows
        )
        return self._apply(params, opt_state, grads, lr) + (loss, metrics)

    def set_vocab(self, vocab: np.ndarray, src: np.ndarray, added: np.ndarray) -> None:
        """Gives the EAGLE-3 head the draft vocabulary `vocab` [Vd] (sorted target ids, the size it
        has): its LM-head row d becomes the old row src[d], or, where src[d] < 0, the next row of
        `added` [number of such d, H], whose optimizer moments start at 0. Shapes stay, so nothing
        recompiles; update_given / eval_given must then be given `vocab`."""
        assert self.ids is not None and len(vocab) == len(self.ids), "an EAGLE-3 vocabulary of the same size"
        take = jnp.asarray(np.maximum(src, 0))
        fresh = jnp.asarray(src < 0)

        def remap(path, leaf, rows):  # the LM head's kernel is [H, Vd]; every other leaf is kept
            if "lm_head" not in jax.tree_util.keystr(path):
                return leaf
            return jnp.where(fresh[None, :], rows.T.astype(leaf.dtype), leaf[:, take])

        full = np.zeros((len(src), np.shape(added)[-1]), np.float32)
        full[src < 0] = added
        rows = jnp.asarray(full)
        zeros = jnp.zeros_like(rows)
        self.params = jax.tree_util.tree_map_with_path(lambda p, x: remap(p, x, rows), self.params)
        self.opt_state = jax.tree_util.tree_map_with_path(lambda p, x: remap(p, x, zeros), self.opt_state)
        d2t = vocab - np.arange(len(vocab))
        self.rest = jax.tree_util.tree_map_with_path(
            lambda p, x: jnp.asarray(d2t, x.dtype) if "d2t" in jax.tree_util.keystr(p) else x, self.rest
        )
        self.ids = np.asarray(vocab, np.int32)

    def lr_at(self, step: int) -> float:
        """Linear warmup to cfg.lr, then cosine decay to a tenth of it at `self.planned` steps."""
        warm, total = max(self.cfg.warmup, 1), max(self.planned, self.cfg.warmup + 1)
        if step < warm:
            return self.cfg.lr * step / warm
        frac = min((step - warm) / max(total - warm, 1), 1.0)
        return self.cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def evaluate(self, examples: list[Example]) -> dict:
        """Mean loss/accuracy per test step on held-out examples (no update)."""
        loss_fn = self._eval_loss
        sums: dict = {}
        n = 0
        for s in range(0, len(examples), self.cfg.batch_size):
            ids, mask = pad_batch(examples[s : s + self.cfg.batch_size], self.cfg.max_len)
            feats, tlogits = self._features(self._tgt_params, jnp.asarray(ids))
            loss, m = loss_fn(
                self.params, self.rest, self._tgt_params, jnp.asarray(ids), jnp.asarray(mask), feats, tlogits
            )
            for k, v in {"loss": loss, **m}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n += 1
        return {k: v / max(n, 1) for k, v in sums.items()}

    # ---- loop -------------------------------------------------------------------------------------

    def _batches(self) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
        """(step, (ids, mask)) from `self.step` on. Each epoch shuffles the examples, groups them into
        batches of similar length and pads each batch only to its length bucket (a multiple of
        LENGTH_BUCKET, so a handful of shapes compile), then shuffles the batch order. The order
        depends only on the seed, so a resumed run sees the same batches."""
        rng = np.random.default_rng(self.cfg.seed)
        bs = self.cfg.batch_size
        lens = np.asarray([min(len(e.ids), self.cfg.max_len) for e in self.examples])
        batches: list[np.ndarray] = []
        while len(batches) < self.cfg.steps:
            perm = rng.permutation(len(self.examples))
            perm = perm[np.argsort(lens[perm], kind="stable")]
            epoch = [perm[i : i + bs] for i in range(0, len(perm) - bs + 1, bs)] or [perm]
            batches += [epoch[i] for i in rng.permutation(len(epoch))]
        for step in range(self.step, self.cfg.steps):
            idx = batches[step]
            length = self._padded_len(int(lens[idx].max()))
            yield step, pad_batch([self.examples[i] for i in idx], length)

    def _padded_len(self, n: int) -> int:
        """The length a batch whose longest example has n tokens is padded to."""
        return min(self.cfg.max_len, -(-min(n, self.cfg.max_len) // LENGTH_BUCKET) * LENGTH_BUCKET)

    def _ckpt_manager(self):
        import orbax.checkpoint as ocp

        return ocp.CheckpointManager(
            os.path.abspath(os.path.join(self.out, "ckpt")), options=ocp.CheckpointManagerOptions(max_to_keep=2)
        )

    def restore(self) -> bool:
        import orbax.checkpoint as ocp

        mgr = self._ckpt_manager()
        last = mgr.latest_step()
        if last is None:
            return False
        state = {"params": self.params, "opt_state": self.opt_state}
        restored = mgr.restore(last, args=ocp.args.StandardRestore(state))
        self.params, self.opt_state, self.step = restored["params"], restored["opt_state"], int(last)
        log = os.path.join(self.out, "train_log.json")
        if os.path.exists(log):
            self.log = [r for r in json.load(open(log))["log"] if r["step"] <= self.step]
        return True

    def save(self) -> None:
        import orbax.checkpoint as ocp

        mgr = self._ckpt_manager()
        mgr.save(self.step, args=ocp.args.StandardSave({"params": self.params, "opt_state": self.opt_state}))
        mgr.wait_until_finished()
        self._write_log()

    def train(self, deadline: float | None = None) -> list[dict]:
        """Runs the steps from `self.step` to cfg.steps, or as many as fit before `deadline` (a
        time.monotonic() value), leaving the schedule fitted to them; returns the log."""
        os.makedirs(self.out, exist_ok=True)
        if deadline is not None:
            self._compile_buckets()
        bar = tqdm(
            total=self.cfg.steps,
            initial=self.step,
            desc=f"train {self.cfg.algorithm} head",
            unit="step",
            disable=not self.progress,
        )
        t0 = time.perf_counter()
        timed: list[tuple[int, float]] = []  # (step, monotonic time) of the steps since the last plan
        first = len(self.log)
        for step, (ids, mask) in self._batches():
            if deadline is not None:
                timed.append((step, time.monotonic()))
                if len(self.log) > first and (step >= self.planned or timed[-1][1] >= deadline):
                    break  # (one step at least, however late it starts)
                if len(timed) >= PLAN_EVERY:
                    rate = (len(timed) - 1) / max(timed[-1][1] - timed[0][1], 1e-6)
                    self.planned = min(self.cfg.steps, step + int(rate * (deadline - timed[-1][1])))
                    timed = timed[-1:]
                    bar.total = max(self.planned, step)
                    bar.refresh()
            lr = jnp.float32(self.lr_at(step))
            self.params, self.opt_state, loss, m = self._update(
                self.params, self.opt_state, self.rest, self._tgt_params, jnp.asarray(ids), jnp.asarray(mask), lr
            )
            self.step = step + 1
            row = {
                "step": self.step,
                "loss": float(loss),
                **{k: float(v) for k, v in m.items()},
                "lr": float(lr),
                "time_s": time.perf_counter() - t0,
            }
            self.log.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row.get('acc_0', 0):.3f}")
            bar.update(1)
            if not math.isfinite(row["loss"]):
                raise JaxspecError(f"loss became {row['loss']} at step {self.step}; lower --lr")
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
                self.save()
        bar.close()
        if self.log and self.log[-1]["step"] % self.cfg.save_every and self.step < self.cfg.steps:
            self.save()  # a deadline stopped the run between checkpoints
        return self.log

    def _compile_buckets(self) -> None:
        """Compiles the update for every batch length the data will use (one step each on copies of
        the state, thrown away), so that the step rate measured after it is the steady one."""
        lens = sorted({self._padded_len(len(e.ids)) for e in self.examples})
        for length in lens:
            ids = jnp.zeros((min(self.cfg.batch_size, len(self.examples)), length), jnp.int32)
            copy = jax.tree.map(jnp.copy, (self.params, self.opt_state))
            out = self._update(
                *copy, self.rest, self._tgt_params, ids, jnp.ones(ids.shape, jnp.float32), jnp.float32(0.0)
            )
            jax.block_until_ready(out)

    # ---- output -----------------------------------------------------------------------------------

    def export(self, dtype: str = "bfloat16") -> str:
        """Writes config.json + model.safetensors in the public draft layout; returns the path."""
        from safetensors.numpy import save_file

        head = nnx.merge(self.graphdef, self.params, self.rest)
        t = module_tensors(head, eagle_key)
        want = np_dtype(dtype)
        t = {k: (v.astype(want) if np.issubdtype(v.dtype, np.floating) else v) for k, v in t.items()}
        if self.ids is not None:
            t["d2t"] = t["d2t"].astype(np.int64)
            t["t2d"] = np.isin(np.arange(self.target.cfg.vocab_size), self.ids)
        save_file(t, os.path.join(self.out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(self.out, "config.json"), "w") as f:
            json.dump({**self.hf_config, "torch_dtype": dtype}, f, indent=2)
        self._write_log()
        return self.out

    def _write_log(self) -> None:
        with open(os.path.join(self.out, "train_log.json"), "w") as f:
            json.dump({"config": dataclasses.asdict(self.cfg), "log": self.log}, f)
        write_loss_svg(self.log, os.path.join(self.out, "loss.svg"))


def write_loss_svg(log: list[dict], path: str, width: int = 640, height: int = 320) -> None:
    """A dependency-free loss (and step-0 accuracy) curve."""
    if len(log) < 2:
        return
    steps = np.asarray([r["step"] for r in log], float)
    pad = 40

    def poly(vals, color):
        v = np.asarray(vals, float)
        lo, hi = float(np.nanmin(v)), float(np.nanmax(v))
        hi = hi if hi > lo else lo + 1
        xs = pad + (steps - steps[0]) / max(steps[-1] - steps[0], 1) * (width - 2 * pad)
        ys = height - pad - (v - lo) / (hi - lo) * (height - 2 * pad)
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
        return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>', lo, hi

    loss_line, llo, lhi = poly([r["loss"] for r in log], "#c0392b")
    acc_line, alo, ahi = poly([r.get("acc_0", 0.0) for r in log], "#2471a3")
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">'
        f'<rect width="100%" height="100%" fill="white"/>{loss_line}{acc_line}'
        f'<text x="{pad}" y="20" fill="#c0392b">loss {lhi:.3f} .. {llo:.3f}</text>'
        f'<text x="{pad + 200}" y="20" fill="#2471a3">step-0 accuracy {alo:.3f} .. {ahi:.3f}</text>'
        f'<text x="{pad}" y="{height - 10}">step {int(steps[0])}</text><text x="{width - pad - 60}" y="{height - 10}">step {int(steps[-1])}</text></svg>'
    )
    with open(path, "w") as f:
        f.write(svg)
