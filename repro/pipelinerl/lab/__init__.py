"""Measurements and diagnosis, never imported by the fast path."""
