"""A/B experiments on the picker: the offline report of its decision log (docs/experiments.md)."""
