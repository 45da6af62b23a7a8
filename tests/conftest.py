"""Shared test set-up. Pytest puts this folder on sys.path, so tests import `factories` from it."""
