"""KDA's lab: tuning sweeps, diagnosis and the offline PTX snapshot. Nothing on the fast path
imports from here; everything here imports the fast path."""
