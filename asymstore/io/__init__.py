"""Blocking I/O helpers: durable files, small metadata files, the root lock."""
