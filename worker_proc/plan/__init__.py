"""The execution plan: the one place that decides which product method, kernel set and thread count run
(candidates, timing, choice, copies, the cache file and the pinned plan)."""
