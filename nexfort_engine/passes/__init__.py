"""Graph passes, one per module, each counting what it rewrote in ``counters["nexfort"]``."""
