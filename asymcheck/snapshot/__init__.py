"""Taking one version's snapshot: the pure partition planner, hooks, the copy engine, host slots, edits."""
