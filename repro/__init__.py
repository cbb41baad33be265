"""Reproductions of the papers the group read: one subpackage per paper."""
