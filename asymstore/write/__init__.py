"""The write path: staging a step, packing segments, writing a version to each tier, the background cascade."""
