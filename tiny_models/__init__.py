"""The default tiny models (committed folders) and their builder, build.py."""
