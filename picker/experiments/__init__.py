"""Session-level experiments: arms, the stable assignment of sessions to them, the decision log, the per-arm
counts, and the offline report of the log (docs/experiments.md)."""
