"""The server's Prometheus metrics, in a registry of its own (several servers may live in one process, as in tests):
the engine's load is read when /metrics is scraped, the rest counted from the events the server hands out."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanojax.front import EngineStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40)
_LOAD = (("running", "nanojax_requests_running", "Sequences being computed"),  # EngineStats' field, metric, help
         ("waiting", "nanojax_requests_waiting", "Sequences waiting for KV pages or a batch slot"),
         ("kv_pages_total", "nanojax_kv_pages_total", "KV pages in the pool"),
         ("kv_pages_used", "nanojax_kv_pages_used", "KV pages held by running sequences"))


class ServeMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self._queried = self._hits = 0  # prompt tokens, and those of them found in the prefix cache
        self._up = Gauge("nanojax_engine_up", "1 while the engine serves requests (/health answers 200), else 0",
                         registry=r)
        self._load = {field: Gauge(name, doc, registry=r) for field, name, doc in _LOAD}
        self.prompt_tokens = Counter("nanojax_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.cached_tokens = Counter("nanojax_prefix_cache_hit_tokens",
                                     "Prompt tokens whose KV came from the prefix cache", registry=r)
        Gauge("nanojax_prefix_cache_hit_rate", "prefix_cache_hit_tokens / prompt_tokens since start",
              registry=r).set_function(lambda: self._hits / self._queried if self._queried else 0.0)
        self.generation_tokens = Counter("nanojax_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("nanojax_requests_finished", "Choices finished, by reason", ["finish_reason"],
                                registry=r)
        self.aborted = Counter("nanojax_requests_aborted", "Requests aborted before they finished (the client went "
                               "away, or its response failed)", registry=r)
        latency = {"buckets": _LATENCY_BUCKETS, "registry": r}
        self.ttft = Histogram("nanojax_time_to_first_token_seconds", "From a request's arrival to its first token",
                              **latency)
        self.itl = Histogram("nanojax_inter_token_latency_seconds", "Between successive streamed events of a choice "
                             "(a multi-step dispatch delivers several tokens in one event)", **latency)
        self.e2e = Histogram("nanojax_request_latency_seconds", "From a request's arrival to its last choice's end",
                             **latency)

    def choice_done(self, event) -> None:
        self.generation_tokens.inc(len(event.token_ids))
        self.finished.labels(event.finish_reason).inc()
        if event.time_to_first_token is not None:
            self.ttft.observe(event.time_to_first_token)
        if event.choice == 0:  # its prompt's, once for the prompt's n choices
            self.prompt_tokens.inc(len(event.prompt_token_ids))
            self.cached_tokens.inc(event.num_cached_tokens)
            self._queried += len(event.prompt_token_ids)
            self._hits += event.num_cached_tokens

    def exposition(self, stats: EngineStats | None, up: bool) -> bytes:
        """The metrics with the engine's load just read (None: it could not be read; its gauges keep their values)."""
        self._up.set(up)
        if stats is not None:
            for field, gauge in self._load.items():
                gauge.set(getattr(stats, field))
        return generate_latest(self.registry)
