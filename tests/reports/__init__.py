"""``retune.reports``: the histories, tables, plots and ``retune report``."""
