"""The project's pages and entry points: docs site, README, examples, demo, CLI, GPU scripts."""
