"""The demo app built on the backend: the throughput benchmark, its scheduler, the CLI."""
