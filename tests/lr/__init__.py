"""``retune.lr`` and ``ScheduledLRFinder``."""
