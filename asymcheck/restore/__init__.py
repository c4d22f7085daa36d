"""Resuming: reading the newest fitting version into the live objects, on the same or another number of ranks."""
