"""``retune.compat``: Lightning's hook calls and combined loaders, as Lightning runs them."""
