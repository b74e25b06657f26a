"""kv-epp picker: the ext_proc endpoint picker and its routing pipeline."""

__version__ = "0.1.0"
