"""Command-line tools shipped with cpu_backend (`python -m cpu_backend.tools.<name>`)."""
