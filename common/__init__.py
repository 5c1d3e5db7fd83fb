"""Thin helpers shared by the scripts: envs, prompts, models, generation, run plumbing. No algorithm lives here."""
