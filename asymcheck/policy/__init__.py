"""What the Checkpointer decides: pacing, the failure budget, preemption and its agreement across ranks."""
