"""``retune.recovery``: out-of-memory recovery, splitting and its exactness."""
