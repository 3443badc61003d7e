"""The reasoning-gym task family."""
