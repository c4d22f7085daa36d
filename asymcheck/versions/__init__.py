"""The life of versions after the snapshot: the version cycle, background commits, the store's loop thread."""
