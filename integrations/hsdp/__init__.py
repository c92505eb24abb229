"""Integration of flatpool with HSDP / FSDP2 fusion groups."""
