"""Host state and run history: what a host serves now (last_good) and how runs compare (runs)."""
