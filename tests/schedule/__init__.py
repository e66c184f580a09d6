"""``retune.schedule``: models, loading, errors and triggers (no Lightning, no torch in the code under test)."""
