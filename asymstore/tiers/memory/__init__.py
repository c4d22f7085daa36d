"""Memory tiers: process memory, shared-memory files, device memory, over one capacity helper."""
