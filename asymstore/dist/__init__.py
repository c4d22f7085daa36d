"""Distributed plumbing: the job's key-value store client (never a collective)."""
