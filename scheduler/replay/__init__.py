"""Trace replay through the front door and its reports (pool on against off, set-ups side by side)."""
