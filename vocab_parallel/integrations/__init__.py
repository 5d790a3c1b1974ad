"""Integrations of the vocabulary-parallel head with training frameworks (imported lazily)."""
