"""Helpers for end-to-end tests that run real servers over real HTTP."""
