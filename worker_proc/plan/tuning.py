"""Every tuning constant of the execution plan, each with why it has its value: which row counts are measured, how
often and how long, how much faster a method or a thread count must be to be chosen, when a measurement is
trusted, how many bytes second weight copies may take. Read by worker_proc.plan (and the copies rule by
worker_proc.plan.method_choice); changing one that shapes a measured plan changes the plan cache key
(worker_proc.plan.source.plan_key), so no plan measured under the old value is served."""

from __future__ import annotations

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Row counts the plan measures: decode batches up to 64 rows, prefill steps up to the default chunk (512).
A library product's cost is not linear between them (a dense bfloat16 product of 128 rows can cost what
one of 256 does: oneDNN reorders the weight on every call), so each size a step commonly has is its own."""

MEASURE_ROUNDS = 3
"""Every (rows, threads) figure is the fastest of this many rounds, the thread counts taking turns: the
worker measures while its sibling processes start, and a burst of theirs must not decide a choice that is
cached for every later start."""

CHOICE_REVISION = 3
"""Part of a cached plan's key: raised whenever the code by which `choose` turns timings into rules changes, so
that a plan cached by an older rule is measured again rather than served (a pinned plan is read as it is). The
constants below that shape the choice are in the key themselves (worker_proc.plan.source.plan_key)."""

CONTENDER = 2.0
"""A round after the first times again only the methods within this factor of a key's fastest (one slower
than twice the fastest does not win by a burst that slowed the fastest in the first round)."""

MARGIN = 0.03
"""`dense` (and a smaller thread count) is kept unless another method (or more threads) is more than this much
faster: timing noise must not buy a second weight copy or a second woken core."""

SWITCH_MARGIN = 0.05
"""A product keeps the method of the next smaller row bucket unless another is more than this much faster,
and a step its thread count likewise: two choices a few percent apart trade places from one timing to the
next, and a rule that flips between them at every bucket is noise, not a measurement."""

STREAM_ROWS = 8
"""Up to this many rows a product is timed streaming its weights (worker_proc.plan.product_timer); beyond it, warm.
Streamed timing of larger products favours methods that pass over a weight several times (`gemv` and
`gemv_seq`, eight rows a pass), which lose to a cache-blocked one (`packed`) inside a step."""

DEFAULT_STREAM_BYTES = 256 << 20
"""Bytes streamed per round where the host does not report its last-level cache, and at most under
`--single-weight-copy` (a method reading a copy, `packed` or `tiled`, is timed on copies of every weight it
streams)."""

WARM_BUDGET_S = 0.05
"""A warm product stops repeating once its timed rounds took this long: a prefill-sized product is long enough
that a few repeats settle its figure, and the start-up must not wait on them."""

HOPELESS = 8.0
"""A method whose warm product of a key takes this many times the fastest one this timer has seen for that key,
row count and thread count is timed no further there (its figure is that product's): it cannot win, and one
pathologically slow (a library product at row counts it has no fast path for) would otherwise hold a worker's
start past its timeout. One slower than `HOPELESS` squared at a key is not timed there at larger row counts
either (with each doubling of the rows its rivals' time at most doubles)."""

DECODE_ROWS = 8
"""Up to this many rows a bucket's step is a decode of that many requests (as STREAM_ROWS)."""

PLAN_REPS = 2
"""Timed repetitions per product in each of the plan's rounds (MEASURE_ROUNDS)."""

CONTENDED_CORES = 0.2
"""Other processes (the server's own siblings starting, another tenant) busy on this much of a core on
average beyond the cores outside the rank's share (worker_proc.plan.source.contended) while the plan is
measured make its figures untrustworthy: a product on two threads waits for a preempted one, so fewer
threads look faster than they are, and a plan cached from such a start would hold a slower step on every
later start."""

MEASURE_ATTEMPTS = 3
"""A plan measured while the CPU was contended is measured again, at most this many times; the last one is used
(and not cached) when every attempt was contended."""

SPARE_COPY_FRACTION = 1 / 16
"""A second copy of some weights is affordable when it takes at most this share of the host's memory."""

COPY_PAYS = 0.05
"""A layout of the weights that costs more bytes (a second copy, or a copy kept beside the stored weight) is
chosen over one that costs fewer only where it makes a step's products more than this much faster, averaged
over the row buckets: a server's memory is sized by its weights, and a copy that buys a few percent on a few
row counts costs as much as one that doubles a decode step's speed."""

LORA_NATIVE_ROWS = 64
"""Up to this many rows, a step adds each layer's LoRA terms with the native op (one call per layer over every
adapter, worker_proc/kernels/native/lora_ops.cpp) in the default numerics: decode-sized steps are bound by the
per-product overhead of torch's products (two per adapter and layer), and the op's decode steps are replayed; above
it torch's GEMMs, a pair per adapter over its own rows, are the faster ones (benchmarks/bench_lora.py)."""

NO_ROW_LIMIT = 1 << 62
"""A row bound no step reaches."""
