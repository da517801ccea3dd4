"""Process-wide host settings of a worker: memory (allocator, huge pages) and floating-point hygiene."""
