"""GET /metrics: one server's metrics in Prometheus' text format (prometheus-client, the extra [serve]).

The names are vLLM's (and TGI's), prefixed ``gpt2numba_``. Each fact is fed where it is known, and at
most once a step or once a choice, never once a token: the engine thread tells the tokens in and out and
the times (jobs.Watcher's calls), the routes tell each completion's status. What the server holds now
(the queue, the batch, the prefix cache's counts) is read when Prometheus asks, so keeping it costs the
engine nothing. Each server has its own registry: two in one process (a test's) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .jobs import Watcher

__all__ = ["CONTENT_TYPE", "Metrics"]

# What generate_latest writes for names that need no escaping (these): the classic text format, under its
# classic type (recent prometheus-client's CONTENT_TYPE_LATEST says version=1.0.0, for UTF-8 names)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; a CPU server: a token in 10 ms (GPT-2 small, alone) to 1 s (xl, a full batch), prompts queued for minutes
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)


class Metrics(Watcher):
    """The registry of one server: what the engine tells (Watcher's calls, on its thread), each completion's
    status (``answered``, from the routes), and the engine's state read at each scrape (``watch``)."""

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("gpt2numba_requests", "Completion requests answered, by HTTP status (a stream: "
                                "the status its end carried, 499 if the client left first)", ["status"],
                                registry=registry)
        self.prompt_tokens = Counter("gpt2numba_prompt_tokens", "Prompt tokens taken in: each choice's prompt "
                                     "as it starts (n choices of a prompt count it n times)", registry=registry)
        self.generation_tokens = Counter("gpt2numba_generation_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("gpt2numba_time_to_first_token_seconds", "From a request's submission to its "
                              "first generated token", buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram("gpt2numba_time_per_output_token_seconds", "A choice's mean time between its "
                              "tokens (choices that end with two tokens or more)", buckets=TPOT_BUCKETS,
                              registry=registry)
        self.request_time = Histogram("gpt2numba_e2e_request_latency_seconds", "From a request's submission "
                                      "to the end of its last choice (requests served in full)",
                                      buckets=REQUEST_BUCKETS, registry=registry)
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_cpu_seconds_total, ...

    def watch(self, engine) -> None:
        """Read the engine's queue, batch and prefix cache at each scrape."""
        self.registry.register(_EngineState(engine))

    def text(self) -> bytes:
        """Every metric, in Prometheus' text format (CONTENT_TYPE)."""
        return generate_latest(self.registry)

    # the routes
    def answered(self, status: int) -> None:
        self.requests.labels(str(status)).inc()

    # the engine thread (jobs.Watcher)
    def started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def step(self, generated_tokens: int) -> None:
        self.generation_tokens.inc(generated_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def choice_done(self, seconds_per_token: float) -> None:
        self.tpot.observe(seconds_per_token)

    def request_done(self, seconds: float) -> None:
        self.request_time.observe(seconds)


class _EngineState:
    """A collector: the engine's queue and batch, and its prefix cache's counts if it has one, as they are
    when Prometheus asks (read from the event loop's thread: plain ints the engine thread keeps)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine = self.engine
        yield GaugeMetricFamily("gpt2numba_num_requests_waiting", "Requests with a choice not yet started",
                                value=engine.queued)
        yield GaugeMetricFamily("gpt2numba_num_choices_waiting", "Choices not yet started, over every request",
                                value=engine.queued_choices)
        yield GaugeMetricFamily("gpt2numba_num_sequences_running", "Sequences in flight (in the batch or paused)",
                                value=engine.active)
        yield GaugeMetricFamily("gpt2numba_num_sequences_paused", "Sequences paused, their places given to "
                                "requests with nothing in flight", value=engine.paused)
        yield CounterMetricFamily("gpt2numba_num_preemptions", "Sequences paused so far", value=engine.preemptions)
        own, shared = engine.positions
        positions = GaugeMetricFamily("gpt2numba_kv_cache_positions", "Cache positions of the sequences in flight: "
                                      "written into their own arrays, or read in place from others'", labels=["kind"])
        positions.add_metric(["own"], own)
        positions.add_metric(["shared"], shared)
        yield positions
        yield GaugeMetricFamily("gpt2numba_kv_cache_max_positions", "Cache positions the sequences in flight may "
                                "own at once (--kv-cache-mb); 0 for no bound", value=engine.max_positions or 0)
        if getattr(engine, "speculation", None) is not None:  # vLLM's spec_decode counters
            stats = engine.batch.stats
            yield CounterMetricFamily("gpt2numba_spec_decode_num_draft_tokens", "Tokens drafted (speculative "
                                      "decoding)", value=stats.drafted)
            yield CounterMetricFamily("gpt2numba_spec_decode_num_accepted_tokens", "Drafted tokens the model kept",
                                      value=stats.accepted)
        prefixes = getattr(engine, "prefixes", None)  # None: no prefix cache (or an engine without one)
        if prefixes is None:
            return
        for name, what, value in [("lookups", "Prefix cache lookups", prefixes.lookups),
                                  ("hits", "Prefix cache lookups that found a prefix", prefixes.hits),
                                  ("hit_tokens", "Prompt tokens found in the prefix cache", prefixes.hit_tokens),
                                  ("evictions", "Prefix cache evictions", prefixes.evictions)]:
            yield CounterMetricFamily(f"gpt2numba_prefix_cache_{name}", what, value=value)
        yield GaugeMetricFamily("gpt2numba_prefix_cache_bytes", "Bytes the prefix cache holds",
                                value=prefixes.nbytes)
        yield GaugeMetricFamily("gpt2numba_prefix_cache_blocks", "Blocks the prefix cache holds",
                                value=len(prefixes))
