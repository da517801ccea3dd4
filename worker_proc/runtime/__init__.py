"""The model runtime of a worker rank: `ModelRunner` (runner) and the replay of decode steps."""
