"""Alembic environment and versions: the only way tracetap's schema changes."""
