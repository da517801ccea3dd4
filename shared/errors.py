"""Exception types that cross package boundaries."""

from __future__ import annotations


class HyssmError(Exception):
    """Base class of hyssm's own errors."""


class ModelLoadError(HyssmError):
    """A checkpoint cannot be loaded; the message names the file, architecture or tensor."""


class StartupError(HyssmError):
    """A process could not start; the message is one line for the operator."""


class StateCowAllocError(HyssmError):
    """No state slot could be had for a copy-on-write, even after eviction.

    Raised by the radix cache's match-with-CoW. Whoever raises it has already released the
    matched node's lock and assigned no slot to the request: the caller treats it as an
    ordinary out-of-memory refusal (the request stays queued and is retried).
    """
