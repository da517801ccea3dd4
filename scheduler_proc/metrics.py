"""Scheduler counters and their export as MetricRecords (shared/messages/server_info.py) for GET
/metrics.

Counters are whole numbers that only go up; gauges are read from the live state when `info()` is
called. Names start with `hyssm_`; every labelled counter shows all its label values from the start.
"""

from __future__ import annotations

from collections import Counter

from shared.messages import MetricRecord

REFUSAL_REASONS = ("kv", "mamba_state", "cow_alloc", "worker_refusal", "lora_slot")

_COUNTERS: dict[str, str] = {
    "hyssm_admission_attempts_total": "Admission attempts of waiting requests (budget checks).",
    "hyssm_admission_rounds_total": "Rounds in which admission was tried, by outcome of the latch.",
    "hyssm_admission_refusals_total": "Admissions refused for memory (or for want of a LoRA adapter slot), by "
    "reason.",
    "hyssm_admission_retries_total": "Admission attempts of requests refused before.",
    "hyssm_admission_deferred_total": "Admissions deferred because a per-round budget was used up.",
    "hyssm_admitted_requests_total": "Requests admitted into the running batch (re-admissions included).",
    "hyssm_prefix_cache_queried_tokens_total": "Prompt tokens looked up in the prefix cache at admission.",
    "hyssm_prefix_cache_hit_tokens_total": "Tokens matched at admission: state = resumed from a cached "
    "Mamba state, kv_only = KV matched past the deepest cached state (recomputed).",
    "hyssm_prefill_tokens_total": "Prompt (and recomputed) tokens computed by the workers.",
    "hyssm_generated_tokens_total": "Tokens sampled.",
    "hyssm_checkpoints_total": "Mamba state checkpoints: saved into the cache, or skipped (no slot).",
    "hyssm_retractions_total": "Running requests retracted, by cause (kv = decode memory, priority).",
    "hyssm_retracted_tokens_total": "Computed tokens of requests at the moment they were retracted.",
    "hyssm_retract_recomputed_tokens_total": "Of those, tokens recomputed on re-admission.",
    "hyssm_requests_finished_total": "Requests finished, by finish reason.",
    "hyssm_spec_verify_steps_total": "Slices that verified drafted tokens (--speculative-algorithm).",
    "hyssm_spec_draft_tokens_total": "Drafted tokens verified.",
    "hyssm_spec_accepted_tokens_total": "Drafted tokens accepted (tokens per verify step = 1 + accepted / steps).",
    "hyssm_state_store_loads_total": "Loads of stored prefixes from the state store: started, loaded, or failed "
    "(an entry missing or damaged: the prefix was computed).",
    "hyssm_state_store_loaded_tokens_total": "Prompt tokens whose KV and state were loaded from the state store.",
    "hyssm_cache_hits_total": "Requests that started from a cached prefix, by the tier it came from (memory: the "
    "radix cache's pools; store: loaded from the state store first).",
    "hyssm_cache_hit_tokens_total": "Prompt tokens served from a cache tier at admission, by tier.",
    "hyssm_image_encodings_total": "Images of prompt slices given to the vision tower: encoded, or served from the "
    "encoder cache (an image whose prefix the radix cache served is neither).",
}

# label and the values every exposition shows (as zeros before the first event)
_LABELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hyssm_admission_rounds_total": ("outcome", ("attempted", "latched")),
    "hyssm_admission_refusals_total": ("reason", REFUSAL_REASONS),
    "hyssm_admission_deferred_total": ("reason", ("running", "prefill")),
    "hyssm_prefix_cache_hit_tokens_total": ("kind", ("state", "kv_only")),
    "hyssm_checkpoints_total": ("result", ("saved", "skipped")),
    "hyssm_retractions_total": ("cause", ("kv", "priority")),
    "hyssm_requests_finished_total": ("reason", ("stop", "length", "abort", "error")),
    "hyssm_state_store_loads_total": ("result", ("started", "loaded", "failed")),
    "hyssm_cache_hits_total": ("tier", ("memory", "store")),
    "hyssm_cache_hit_tokens_total": ("tier", ("memory", "store")),
    "hyssm_image_encodings_total": ("result", ("encoded", "cached")),
}


_HISTOGRAMS: dict[str, str] = {
    "hyssm_state_store_load_seconds": "Time a worker took to load a stored prefix (read, check, copy into the pools).",
    "hyssm_state_store_write_seconds": "Time the worker's writer took to store one entry (queue wait excluded).",
}
HISTOGRAM_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SchedulerMetrics:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        # per histogram: the count of observations <= each bound, then of all of them; their sum
        self.histograms: dict[str, list[int]] = {name: [0] * (len(HISTOGRAM_BOUNDS) + 1) for name in _HISTOGRAMS}
        self.histogram_sums: dict[str, float] = dict.fromkeys(_HISTOGRAMS, 0.0)
        for name in _COUNTERS:
            label, values = _LABELS.get(name, ("", ()))
            if not label:
                self.counts[(name, ())] += 0
            for value in values:
                self.counts[(name, ((label, value),))] += 0

    def inc(self, name: str, value: int = 1, **labels: str) -> None:
        assert name in _COUNTERS, name
        self.counts[(name, tuple(sorted(labels.items())))] += value

    def observe(self, name: str, value: float) -> None:
        counts = self.histograms[name]
        for i, bound in enumerate(HISTOGRAM_BOUNDS):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1
        self.histogram_sums[name] += value

    def get(self, name: str, **labels: str) -> int:
        return self.counts[(name, tuple(sorted(labels.items())))]

    def records(self, gauges: list[tuple[str, str, dict[str, str], float]]) -> list[MetricRecord]:
        """Every counter, then the `gauges` given as (name, help, labels, value)."""
        out = [
            MetricRecord(name=name, type="counter", help=_COUNTERS[name], labels=dict(labels), value=value)
            for (name, labels), value in sorted(self.counts.items())
        ]
        for name, help_text, labels, value in gauges:
            out.append(MetricRecord(name=name, type="gauge", help=help_text, labels=labels, value=float(value)))
        for name, counts in self.histograms.items():
            les = [*(str(b) for b in HISTOGRAM_BOUNDS), "+Inf"]
            out += [MetricRecord(name=name, type="histogram", help=_HISTOGRAMS[name], labels={"le": le}, value=n)
                    for le, n in zip(les, counts, strict=True)]
            out.append(MetricRecord(name=name, type="histogram", help=_HISTOGRAMS[name], labels={"le": "sum"},
                                    value=self.histogram_sums[name]))
        return out
