"""Integrations with other libraries (imported on demand; nothing here imports at package import)."""
