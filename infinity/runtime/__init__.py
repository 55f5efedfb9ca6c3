"""The process a run lives in: collectives, the timeline trace, the machine's hardware, allocator settings."""
