"""FSDP Handbook library."""
