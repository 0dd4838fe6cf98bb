"""A sweep of cells: plan, run each in a fresh process with per-phase peaks, append its row."""
