"""/metrics: the server's counters and gauges in Prometheus' text format, under SGLang's metric
names with a jaxspec: prefix (per tree shape too, when speculation is on)."""

from __future__ import annotations

from typing import Any

from jaxspec.server.scheduler import Scheduler


def prometheus_text(sched: Scheduler, model: str) -> str:
    """Prometheus exposition text (SGLang's metric names under the jaxspec: prefix)."""
    st = sched.stats
    label = '{model_name="' + model.replace('"', "'") + '"}'
    rows: list[tuple[str, str, str, Any]] = [
        ("num_requests_total", "counter", "requests accepted", st.requests),
        ("num_requests_finished_total", "counter", "requests finished (stop or length)", st.finished),
        ("num_requests_aborted_total", "counter", "requests cancelled (client gone or shutdown)", st.aborted),
        ("num_requests_rejected_total", "counter", "requests refused because the queue was full", st.rejected),
        (
            "num_requests_failed_total",
            "counter",
            "requests ended by an internal error (the server kept running)",
            st.failed,
        ),
        ("num_recoveries_total", "counter", "times the device state was lost and re-created", st.recoveries),
        (
            "num_grammar_rejections_total",
            "counter",
            "constrained requests failed because their grammar refused an emitted token (a bug)",
            st.grammar_rejections,
        ),
        (
            "num_compiles_on_demand_total",
            "counter",
            "device programs a request had to wait for (none compiled covered it)",
            sched.programs.compiles_on_demand,
        ),
        (
            "background_compile_remaining",
            "gauge",
            "background work left: program shapes to compile, programs to compile again for the program store, "
            "compiled programs not yet run once",
            sched.programs.background_left(),
        ),
        ("prompt_tokens_total", "counter", "prompt tokens of accepted requests", st.prompt_tokens),
        (
            "prefill_tokens_total",
            "counter",
            "prompt tokens prefilled (not served by the prefix cache)",
            st.prefill_tokens,
        ),
        ("cached_tokens_total", "counter", "prompt tokens served by the prefix cache", st.cached_tokens),
        (
            "cache_hit_rate",
            "gauge",
            "share of the admitted prompt tokens served by the prefix cache",
            round(st.cached_tokens / max(st.cached_tokens + st.prefill_tokens, 1), 4),
        ),
        ("generation_tokens_total", "counter", "generated tokens", st.generation_tokens),
        ("gen_throughput", "gauge", "generated tokens per second over the last 10 s", round(st.tokens_per_s(), 3)),
        (
            "spec_accept_length",
            "gauge",
            "mean tokens per speculative round of finished speculative requests (plain steps left out)",
            sched.avg_spec_accept_length or 0.0,
        ),
        ("spec_verify_ct_total", "counter", "speculative rounds of finished speculative requests", st.spec_verify_ct),
        (
            "spec_plain_steps_total",
            "counter",
            "plain steps of finished speculative requests (adaptive speculation turned speculation off)",
            st.spec_plain_steps,
        ),
        (
            "spec_plain_step_share",
            "gauge",
            "share of those requests' rounds run as plain steps",
            round(sched.plain_step_share, 4),
        ),
        ("num_running_reqs", "gauge", "requests holding a slot", sched.running),
        ("num_queue_reqs", "gauge", "requests waiting for a slot", sched.queue_depth),
        ("max_running_requests", "gauge", "request slots", sched.slots),
    ]
    online = sched.eng.online.stats() if sched.eng.online is not None else None
    if online is not None:  # online draft training
        rows += [
            ("draft_version", "gauge", "draft weights swapped in by online training so far", online["draft_version"]),
            ("online_train_steps_total", "counter", "online draft training steps", online["online_train_steps"]),
            (
                "online_train_failed_steps_total",
                "counter",
                "online training steps dropped (a loss not finite, an error); the weights stayed",
                online["online_train_failed_steps"],
            ),
            (
                "online_train_score",
                "gauge",
                "expected accept length of the draft in use on held-back recent requests (last scoring)",
                online["online_train_score_in_use"] or 0.0,
            ),
        ]
    shared = sched.eng.shared_text_stats()
    if shared is not None:  # NGRAM's / the text-match candidates' text shared by requests
        rows += [
            (
                "spec_shared_text_tokens",
                "gauge",
                "tokens of finished requests held for text matching (bounded by --speculative-ngram-capacity)",
                shared["tokens"],
            ),
            ("spec_shared_text_capacity", "gauge", "the most tokens held for text matching", shared["capacity"]),
        ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP jaxspec:{name} {help_}", f"# TYPE jaxspec:{name} {kind}", f"jaxspec:{name}{label} {value}"]
    if sched.spec is not None:  # per tree shape (adaptive speculation's candidates; "off": plain steps)
        for name, help_, counts in (
            ("spec_shape_dispatches_total", "dispatches run with each tree shape", st.shape_dispatches),
            (
                "spec_shape_rounds_total",
                "rounds run with each tree shape (a plain step counts as one)",
                st.shape_rounds,
            ),
        ):
            out += [f"# HELP jaxspec:{name} {help_}", f"# TYPE jaxspec:{name} counter"]
            out += [f'jaxspec:{name}{label[:-1]},shape="{x}"}} {counts[x]}' for x in sched.shapes]
    return "\n".join(out) + "\n"
