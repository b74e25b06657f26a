"""kv-listener: engine KV-cache events in, an ordered resumable per-backend stream of index deltas out.
See docs/listener.md."""
