"""What the picker and the listener both speak: block keys, storage tiers, feed records, config files.

The listener imports only this package (an import-linter contract keeps it so); nothing here imports
the rest of the picker.
"""
