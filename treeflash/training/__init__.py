"""Drafter training: data (prompts, target-regenerated responses), objective, trainer."""
