"""Speculative decoding on the worker: verifying drafts and drafting with MTP layers."""
