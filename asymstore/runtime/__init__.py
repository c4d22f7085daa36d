"""Process plumbing: lazy public names, pausing the garbage collector, library threads at interpreter exit."""
