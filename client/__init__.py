"""Clients of the KAME server: an async Python client, the CLI, and the browser page (web/)."""
